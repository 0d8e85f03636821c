"""Soft targets: cross_entropy with (N, K) target_tokens and weights, a weighted sum over K targets per position (a
teacher's top-K, as the cookbook's distillation recipes send). The loss is -sum_k w[i, k] * logp(t[i, k]).

The pass gathers the K logprobs from the logits it already has (`gather_logprobs`): the memory beyond the logits is
(B, T, K), bounded by MAX_SOFT_TARGETS. A datum's 1-D weights become sum_k |w[i, k]|, so a mean reduction divides
by the weight mass, as it does for 1-D weights. Padding cells (target 0, weight 0) contribute nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gpu_runtime.contract.training_settings import MAX_SOFT_TARGETS
from gpu_runtime.errors import BadInput

SoftLists = tuple[list[list[int]], list[list[float]]]  # (N, K) targets and weights


@dataclass
class SoftBatch:
    targets: torch.Tensor  # [B, T, K] long; rows without soft targets hold zeros
    weights: torch.Tensor  # [B, T, K]; 0 on padding and on rows without soft targets
    rows: torch.Tensor  # [B] bool: which rows take their loss from here
    logprobs: torch.Tensor | None = None  # [B, T, K], set by the pass from its logits

    def slice(self, span: slice) -> SoftBatch:
        return SoftBatch(self.targets[span], self.weights[span], self.rows[span],
                         None if self.logprobs is None else self.logprobs[span])


def is_2d(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(v, list) for v in value)


def check(inputs: dict[str, Any], at: str, n: int, loss_fn: str, vocab_size: int) -> SoftLists:
    """(N, K) target_tokens and weights, validated: cross_entropy only, the same rectangular shape, ids in the
    vocabulary, finite weights, K within its bound."""
    if loss_fn != "cross_entropy":
        raise BadInput(f"{at}.target_tokens is 2-D (soft targets), which only cross_entropy takes, not {loss_fn}",
                       field=f"{at}.target_tokens")
    extra = sorted(set(inputs) - {"target_tokens", "weights"})
    if extra:
        raise BadInput(f"{at}.{extra[0]}: soft targets take target_tokens and weights only", field=f"{at}.{extra[0]}")
    targets, weights = inputs["target_tokens"], inputs.get("weights")
    if weights is None:
        raise BadInput(f"{at}.weights is required with 2-D target_tokens (one weight per target)", field=f"{at}.weights")
    width = _shape(targets, f"{at}.target_tokens", n)
    if _shape(weights, f"{at}.weights", n) != width:
        raise BadInput(f"{at}.weights must have target_tokens' shape ({n}, {width})", field=f"{at}.weights")
    for row in targets:
        for t in row:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise BadInput(f"{at}.target_tokens has {t!r}, not a token id in 0..{vocab_size - 1}",
                               field=f"{at}.target_tokens")
    for row in weights:
        for w in row:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
                raise BadInput(f"{at}.weights must hold finite numbers, got {w!r}", field=f"{at}.weights")
    return [list(row) for row in targets], [[float(w) for w in row] for row in weights]


def _shape(rows: Any, where: str, n: int) -> int:
    if not isinstance(rows, list) or len(rows) != n or not all(isinstance(row, list) for row in rows):
        raise BadInput(f"{where} must be {n} rows (one per position of model_input)", field=where)
    width = len(rows[0])
    if not 1 <= width <= MAX_SOFT_TARGETS or any(len(row) != width for row in rows):
        raise BadInput(f"{where} must be rectangular with 1..{MAX_SOFT_TARGETS} targets per position", field=where)
    return width


def summary(soft: SoftLists) -> tuple[list[int], list[float]]:
    """The 1-D view the rest of a batch keeps: each position's first target, and its weight mass sum_k |w|."""
    targets, weights = soft
    return [row[0] for row in targets], [sum(abs(w) for w in row) for row in weights]


def collate(softs: list[SoftLists | None], width: int, device: torch.device) -> SoftBatch | None:
    """None when no row has soft targets (the pass then runs exactly as before)."""
    if all(soft is None for soft in softs):
        return None
    k = max(len(soft[0][0]) for soft in softs if soft is not None)
    targets = torch.zeros(len(softs), width, k, dtype=torch.long)
    weights = torch.zeros(len(softs), width, k, dtype=torch.float32)
    rows = torch.zeros(len(softs), dtype=torch.bool)
    for i, soft in enumerate(softs):
        if soft is None:
            continue
        t, w = torch.tensor(soft[0], dtype=torch.long), torch.tensor(soft[1], dtype=torch.float32)
        targets[i, :t.size(0), :t.size(1)], weights[i, :w.size(0), :w.size(1)] = t, w
        rows[i] = True
    return SoftBatch(targets.to(device), weights.to(device), rows.to(device))


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t, k] | prefix) in fp32: the K targets' logits less the log-partition, (B, T, K)."""
    flat = logits.float()
    return flat.gather(-1, targets) - torch.logsumexp(flat, dim=-1, keepdim=True)


def loss(soft: SoftBatch, like: torch.Tensor) -> torch.Tensor:
    """-sum_k w * logp per position, [B, T]."""
    if soft.logprobs is None:
        raise RuntimeError("the pass did not gather the soft targets' logprobs")
    return -(soft.logprobs.to(like.dtype) * soft.weights.to(like.dtype)).sum(-1)
