"""Whether a pass's activations fit the device, and how many decoder layers to recompute in backward when they do not.

An estimate, not a measurement: a transformers decoder layer keeps about (12·hidden + 4·intermediate) values per token
for backward in the model's dtype (attention's inputs and outputs, the norms, the MLP's gate, up and product), and a
checkpointed layer keeps only its input (hidden values per token). The layers checkpointed are the fewest that bring
the pass within FIT_FRACTION of the device's free memory; on a CPU nothing is measured and none are, unless asked.
"""

from __future__ import annotations

import math

import torch
from torch import nn

FIT_FRACTION = 0.8  # of the free memory: the rest for the loss head's blocks, the allocator's slack and the LoRA's own


def activation_bytes_per_token(model: nn.Module) -> tuple[int, int]:
    """(bytes one layer keeps per token, bytes a checkpointed layer keeps per token) for the model's shape and dtype."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    intermediate = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    width = next(model.parameters()).element_size()
    return (12 * hidden + 4 * intermediate) * width, hidden * width


def layers_to_checkpoint(layers: int, tokens: int, per_token: tuple[int, int], free_bytes: int) -> int:
    """The fewest of `layers` to recompute so that `tokens` tokens' activations fit FIT_FRACTION of `free_bytes`."""
    full, kept = per_token
    budget = FIT_FRACTION * free_bytes
    need = layers * full * tokens
    if need <= budget or full <= kept:
        return 0
    return min(layers, math.ceil((need - budget) / ((full - kept) * tokens)))


def free_device_bytes(device: torch.device) -> int | None:
    """The device's free memory (CUDA's own count, no stream sync); None where it is not measured (the CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)
