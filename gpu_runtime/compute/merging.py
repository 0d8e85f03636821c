"""`merged` checkpoints: a plain model with one run's LoRA folded into the base weights, streamed to safetensors.

Layer by layer, each weight is read (de-quantized first when the base is 4- or 8-bit), has
`scaling · B·A` added when the run targets it, and goes into the current shard; a shard is written
once it reaches `shard_bytes`. So at most one shard of full-precision tensors is held at a time, never
the whole model de-quantized. The shared base is read, never modified. The result loads with
`AutoModelForCausalLM.from_pretrained` like any Hugging Face checkpoint, in the family's Hub layout: transformers'
own `revert_weight_conversion` (what `save_pretrained` does) turns the fused in-memory expert weights of a
mixture-of-experts base back into the Hub's names (Qwen3-MoE: one `mlp.experts.N.{gate,up,down}_proj.weight` per
expert), with each expert's `scaling · B_e·A_e` folded in first.

Tied embeddings (SmolLM2 ties lm_head to embed_tokens): a run whose LoRA targets the unembedding changed the output
projection only, so the merged model is untied: lm_head is written as base + delta, embed_tokens as the base's, and
the config says `tie_word_embeddings=False`. A run that leaves lm_head alone keeps the base's tying (one tensor).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch
from safetensors.torch import save_file
from torch import nn
from transformers.core_model_loading import revert_weight_conversion

from gpu_runtime.client.persistence import write_json
from gpu_runtime.compute.lora.experts import MultiLoraExperts
from gpu_runtime.compute.lora.layer import MultiLoraLinear
from gpu_runtime.compute.plan import RunWeights
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.quantization import dequantized_weight, quantization_of

SHARD_BYTES = 2 << 30  # Hugging Face's own default shard size is in this range; big enough for few files
MERGE_INFO = "signal_merge.json"  # says what was folded in, and whether the base was de-quantized


class MergeInfo(TypedDict):
    """What MERGE_INFO says of a merged save."""

    base_model: str
    base_revision: str | None
    run_id: str
    step: int
    dequantized_from: str | None  # the base's quantization, undone in the merged weights
    dtype: str
    shards: int
    untied_embeddings: bool


def save_merged(entry: BaseEntry, state: RunWeights, directory: Path, shard_bytes: int = SHARD_BYTES) -> MergeInfo:
    """Write config, tokenizer and sharded weights of base + this run's LoRA to `directory`."""
    model: Any = entry.model  # a PreTrainedModel; nn.Module's typing hides its config and dtype
    dtype: torch.dtype = model.dtype  # a quantized base's other tensors (embeddings, norms) are in its compute dtype
    scaling = state.lora["alpha"] / state.lora["r"]
    shard: dict[str, torch.Tensor] = {}
    size = 0
    written: list[str] = []
    tied = _tied_names(model)
    untie = any(f"{path}.weight" in tied for path in state.weights)  # a delta on a tied weight: the copies differ
    with torch.no_grad():
        for merged_name, merged in _merged_tensors(model, state.weights, scaling):
            if merged_name in tied and not untie:  # lm_head = embeddings: saved once, tied again on load
                continue
            for name, tensor in _hub_layout(model, merged_name, merged):
                tensor = tensor.to(dtype if tensor.is_floating_point() else tensor.dtype).to("cpu").contiguous()
                if size and size + tensor.numel() * tensor.element_size() > shard_bytes:
                    written.append(_write_shard(directory, shard, len(written)))
                    size = 0
                shard[name] = tensor
                size += tensor.numel() * tensor.element_size()
                del tensor
        if shard:
            written.append(_write_shard(directory, shard, len(written)))
    _name_shards(directory, written)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    if untie:
        _untie(config)
    config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    entry.base.tokenizer.save_pretrained(directory)
    info: MergeInfo = {"base_model": entry.base.name, "base_revision": entry.base.revision, "run_id": state.run_id,
            "step": state.step, "dequantized_from": entry.quantization, "dtype": str(dtype).removeprefix("torch."),
            "shards": len(written), "untied_embeddings": untie}
    write_json(directory / MERGE_INFO, info)
    return info


def _untie(config: Any) -> None:
    """`tie_word_embeddings=False`, where the model reads it (a multimodal config keeps it on its text config)."""
    config.tie_word_embeddings = False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config and hasattr(text, "tie_word_embeddings"):
        text.tie_word_embeddings = False


def _tied_names(model: nn.Module) -> set[str]:
    """Every name of a parameter after its first (transformers ties them again from the config), in the plain
    model's names: a wrapped layer's `x.base_layer.weight` is `x.weight` there."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = name.replace(".base_layer.", ".")
        if id(param) in first:
            tied.add(name)
        first.setdefault(id(param), name)
    return tied


def _merged_tensors(model: nn.Module, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                    scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the plain model's state dict, one at a time, LoRA folded in where the run has it."""
    skip: set[str] = set()
    for path, module in model.named_modules():
        if any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, MultiLoraExperts):
            skip.add(path)
            yield from _merged_experts(path, module, weights, scaling)
            continue
        base: Any = module.base_layer if isinstance(module, MultiLoraLinear) else module
        if isinstance(module, MultiLoraLinear) or quantization_of(module):
            skip.add(path)
            weight = dequantized_weight(base)
            if path in weights:
                A, B = weights[path]
                weight = weight + (B.float() @ A.float()) * scaling
            yield f"{path}.weight", weight
            if base.bias is not None:
                yield f"{path}.bias", base.bias
            continue
        prefix = f"{path}." if path else ""
        for name, param in module.named_parameters(recurse=False):
            yield prefix + name, param
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield prefix + name, buffer


def _merged_experts(path: str, module: MultiLoraExperts, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                    scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """An experts module's tensors under their plain names, each expert's delta folded into a targeted parameter."""
    for name, param in module.base_layer.named_parameters(recurse=False):
        target = module.targets.get(name)
        if target is not None and f"{path}.{name}" in weights:
            A, B = weights[f"{path}.{name}"]
            yield f"{path}.{name}", param.float() + target.delta_weight(A, B, scaling).to(param.device)
        else:
            yield f"{path}.{name}", param


def _hub_layout(model: Any, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensor under the names the family's Hub checkpoints use (one fused expert weight may be many there), as
    `save_pretrained` writes them."""
    yield from revert_weight_conversion(model, {name: tensor}).items()


def _write_shard(directory: Path, tensors: dict[str, torch.Tensor], index: int) -> str:
    name = f"shard-{index:05d}.tmp.safetensors"
    save_file(tensors, str(directory / name), metadata={"format": "pt"})
    tensors.clear()  # the shard is on disk: its tensors go
    return name


def _name_shards(directory: Path, written: list[str]) -> None:
    """Hugging Face's names: model.safetensors alone, or model-0000k-of-0000n plus an index."""
    from safetensors import safe_open

    if len(written) == 1:
        (directory / written[0]).rename(directory / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    total = 0
    for k, temp in enumerate(written, start=1):
        final = f"model-{k:05d}-of-{len(written):05d}.safetensors"
        (directory / temp).rename(directory / final)
        with safe_open(str(directory / final), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a dict
                weight_map[key] = final
        total += (directory / final).stat().st_size
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
