"""Loss functions: each returns (sum of weighted per-token losses, normaliser).

Returning a sum lets gradients accumulate across forward_backward calls; optim_step divides
by the normaliser accumulated over all of them, so two half-batches equal one full batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpu_runtime.batches import Collated
from gpu_runtime.errors import BadInput

LossFn = Callable[[torch.Tensor, Collated, dict[str, Any]], tuple[torch.Tensor, float]]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t] | prefix) for every position, in fp32."""
    # Flattened to (tokens, vocab): cross_entropy over a strided class dim (the (B, V, T) layout) is ~10% slower on CPU.
    flat = logits.float().reshape(-1, logits.size(-1))
    return -torch.nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="none").view_as(targets)


def cross_entropy(logprobs: torch.Tensor, batch: Collated, config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    return -(logprobs * batch.weights).sum(), float(batch.weights.sum())


def importance_sampling(logprobs: torch.Tensor, batch: Collated, config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    # Policy gradient corrected for sampling from older weights: -ratio * advantage per token.
    ratio = torch.exp(logprobs - batch.extras["logprobs"])
    mask = batch.weights
    return -(ratio * batch.extras["advantages"] * mask).sum(), float((mask != 0).sum())


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling}


def get_loss(name: Any, config: Any) -> tuple[LossFn, dict[str, Any]]:
    if name not in LOSSES:
        raise BadInput(f"unknown loss_fn {name!r}; available: {sorted(LOSSES)}", field="loss_fn")
    if config is not None and not isinstance(config, dict):
        raise BadInput("loss_fn_config must be an object or null", field="loss_fn_config")
    if config:
        raise BadInput(f"{name} takes no loss_fn_config, got keys {sorted(config)}", field="loss_fn_config")
    return LOSSES[name], dict(config or {})
