"""One PEFT model per base holding every run's LoRA adapter, with strict isolation between runs.

Each run is a named adapter; `activate` makes it the only one that computes and the only one
with requires_grad, so a backward pass can never touch another run's weights.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from gpu_runtime.lora import linear_module_names
from gpu_runtime.models import LoadedBase

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_key(run_id: str) -> str:
    # PEFT keeps adapters in ModuleDicts, whose keys may not contain "."; run ids may.
    return "run_" + hashlib.sha256(run_id.encode()).hexdigest()[:16]


class AdapterHost:
    def __init__(self, base: LoadedBase) -> None:
        self.base = base
        self.available_modules = linear_module_names(base.model)
        self.peft: PeftModel | None = None
        self.active: str | None = None

    @property
    def model(self) -> PeftModel:
        assert self.peft is not None, "no adapter added yet"
        return self.peft

    def add(self, run_id: str, config: LoraConfig, seed: int) -> None:
        key = adapter_key(run_id)
        # LoRA's A matrices are drawn from the global RNG: seed it, without disturbing anyone else's stream.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # PEFT 0.21 reads a property transformers 5 deprecated; nothing for us to change.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base.model, config, adapter_name=key)
            else:
                self.peft.add_adapter(key, config)
        # Adapter weights stay fp32 even on a bf16 base, so AdamW updates are not rounded away.
        for param in self.parameters(run_id).values():
            param.data = param.data.float()
        self.active = None
        self.activate(run_id)

    def activate(self, run_id: str) -> None:
        key = adapter_key(run_id)
        if self.active == key:
            return
        self.model.base_model.set_adapter(key)
        for name, param in self.model.named_parameters():
            param.requires_grad_(_is_adapter_param(name, key))
        self.active = key

    def parameters(self, run_id: str) -> dict[str, torch.nn.Parameter]:
        key = adapter_key(run_id)
        return {name: p for name, p in self.model.named_parameters() if _is_adapter_param(name, key)}

    def remove(self, run_id: str) -> None:
        key = adapter_key(run_id)
        if self.peft is not None and key in self.peft.peft_config:
            self.peft.delete_adapter(key)
        if self.active == key:
            self.active = None

    def has(self, run_id: str) -> bool:
        return self.peft is not None and adapter_key(run_id) in self.peft.peft_config

    def save_adapter(self, run_id: str, path: Path) -> None:
        """A directory `PeftModel.from_pretrained(base, path)` loads."""
        key = adapter_key(run_id)
        state = get_peft_model_state_dict(self.model, adapter_name=key)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(Path(path) / ADAPTER_WEIGHTS))
        config = copy.deepcopy(self.model.peft_config[key])
        config.base_model_name_or_path = self.base.name
        config.inference_mode = True
        config.save_pretrained(str(path))

    def load_adapter(self, run_id: str, path: Path) -> None:
        key = adapter_key(run_id)
        state = load_file(str(Path(path) / ADAPTER_WEIGHTS))
        result = set_peft_model_state_dict(self.model, state, adapter_name=key)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"adapter at {path} does not fit this run: unexpected keys {unexpected[:3]}")

    def merged_model(self, run_id: str) -> PreTrainedModel:
        """A plain model with this run's LoRA folded in; the shared base is read, never modified."""
        key = adapter_key(run_id)
        base = self.model.get_base_model()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in base.state_dict().items():
            if ".lora_" not in name:
                state[name.replace(".base_layer.", ".")] = tensor
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and key in module.lora_A:
                weight = module.base_layer.weight
                delta = module.get_delta_weight(key).to(torch.float32)
                state[f"{name}.weight"] = (weight.to(torch.float32) + delta).to(weight.dtype)
        config = copy.deepcopy(base.config)
        # On the meta device nothing is initialised; assign=True then adopts our tensors as they are.
        with torch.device("meta"):
            merged = AutoModelForCausalLM.from_config(config, dtype=base.dtype)
        merged.load_state_dict(state, assign=True, strict=True)
        merged.tie_weights()
        merged.generation_config = copy.deepcopy(base.generation_config)
        return merged


def _is_adapter_param(name: str, key: str) -> bool:
    return f".{key}." in name and ".lora_" in name
