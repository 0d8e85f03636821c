"""`merged` checkpoints: a plain model with one run's LoRA folded into the base weights."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from gpu_runtime.pool import BaseEntry
from gpu_runtime.run_state import RunState


def merged_model(entry: BaseEntry, state: RunState) -> PreTrainedModel:
    """W + scaling · B·A for each layer the run targets; the shared base is read, never modified."""
    base = entry.model
    scaling = state.lora["alpha"] / state.lora["r"]
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        tensors[name.replace(".base_layer.", ".")] = tensor
    with torch.no_grad():
        for path, (A, B) in state.weights.items():
            weight = tensors[f"{path}.weight"]
            tensors[f"{path}.weight"] = (weight.float() + (B.float() @ A.float()) * scaling).to(weight.dtype)
    # On the meta device nothing is initialised; assign=True then adopts our tensors as they are.
    with torch.device("meta"):
        merged = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), dtype=base.dtype)
    merged.load_state_dict(tensors, assign=True, strict=True)
    merged.tie_weights()
    merged.generation_config = copy.deepcopy(base.generation_config)
    return merged
