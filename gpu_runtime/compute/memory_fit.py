"""Whether a pass's activations fit the device, how many decoder layers to recompute in backward when they do not, and
the resident runs' budget when none is set.

An estimate, not a measurement: a transformers decoder layer keeps about (12·hidden + 4·intermediate) values per token
for backward in the model's dtype (the constants: gpu_runtime/client/allocation.py, which the fit check shares), and a
checkpointed layer keeps only its input (hidden values per token). The layers checkpointed are the fewest that bring
the pass within FIT_FRACTION of the device's free memory; on a CPU nothing is measured and none are, unless asked.

The resident budget (`RuntimeOptions.resident_bytes` 0, the default) is sized each tick from what the device has:
FIT_FRACTION of the memory the runs hold plus what is free, less what a pass at the token budget keeps for backward
(`pass_reserve`). On a CPU, where nothing is measured, it is RESIDENT_BYTES_UNMEASURED.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu_runtime.client.allocation import layer_activation_values, pass_activation_bytes
from gpu_runtime.contract.runtime_options import RESIDENT_BYTES_UNMEASURED

FIT_FRACTION = 0.8  # of the free memory: the rest for the loss head's blocks, the allocator's slack and the LoRA's own


def activation_bytes_per_token(model: nn.Module) -> tuple[int, int]:
    """(bytes one layer keeps per token, bytes a checkpointed layer keeps per token) for the model's shape and dtype."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    intermediate = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    width = next(model.parameters()).element_size()
    full, kept = layer_activation_values(hidden, intermediate)
    return full * width, kept * width


def layers_to_checkpoint(layers: int, tokens: int, per_token: tuple[int, int], free_bytes: int) -> int:
    """The fewest of `layers` to recompute so that `tokens` tokens' activations fit FIT_FRACTION of `free_bytes`."""
    full, kept = per_token
    budget = FIT_FRACTION * free_bytes
    need = pass_activation_bytes(layers, tokens, per_token)
    if need <= budget or full <= kept:
        return 0
    return min(layers, math.ceil((need - budget) / ((full - kept) * tokens)))


def pass_reserve(layers: int, tokens: int, per_token: tuple[int, int], free_bytes: int) -> int:
    """What the resident budget leaves a pass of `tokens` tokens: its activations whole where they take at most half of
    `free_bytes`; past that, at least half, and at least what it keeps with every layer recomputed (a pass checkpoints
    what does not fit, `layers_to_checkpoint`: the runs trade recompute for residency, never the pass's floor)."""
    whole = pass_activation_bytes(layers, tokens, per_token)
    floor = pass_activation_bytes(layers, tokens, per_token, checkpointed=layers)
    return min(whole, max(floor, free_bytes // 2))


def resident_budget(free_bytes: int | None, held_bytes: int, reserve_bytes: int) -> int:
    """The resident runs' budget when none is set: FIT_FRACTION of what they hold plus what is free, less a pass's
    `reserve_bytes`; RESIDENT_BYTES_UNMEASURED where nothing is measured (`free_bytes` None). Counting what the runs
    hold keeps the figure steady as they grow into the free memory."""
    if free_bytes is None:
        return RESIDENT_BYTES_UNMEASURED
    return max(0, int(FIT_FRACTION * (held_bytes + free_bytes)) - reserve_bytes)


def free_device_bytes(device: torch.device) -> int | None:
    """The device's free memory (CUDA's own count, no stream sync) plus what torch's allocator holds unused (a pass's
    freed activations stay cached there, ready for the next); None where it is not measured (the CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(0, cached))
