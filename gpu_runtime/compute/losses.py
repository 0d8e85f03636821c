"""Loss functions, per position, as the Tinker cookbook defines them (docs/LOSSES.md has the formulas).

Each returns the elementwise loss [B, T] (already multiplied by the datum's weights; padding weighs 0): its sum
is what backward sees. `normaliser` is what a "mean" reduction divides by; optim_step divides the gradients
summed over every call since the last step by the sum of their normalisers, so two half-batches equal one
full batch. A "sum" reduction divides by nothing. Every function works in the dtype of the logprobs it gets
(fp32 in the runtime, float64 in the tests that check their derivatives).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from gpu_runtime.compute.batches import Collated, Datum
from gpu_runtime.contract.custom_loss import CUSTOM_LOSS_FN
from gpu_runtime.contract.training_settings import LOSS_CONFIG_DEFAULTS, RL_LOSSES

LossFn = Callable[[torch.Tensor, Collated, dict[str, float]], torch.Tensor]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t] | prefix) for every position, in fp32 (the logprob Signal reports and trains on)."""
    # Flattened to (tokens, vocab): cross_entropy over a strided class dim (the (B, V, T) layout) is ~10% slower on CPU.
    flat = logits.float().reshape(-1, logits.size(-1))
    return -torch.nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="none").view_as(targets)


def soft_target_logprobs(logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[b, t, k]·log p(ids[b, t, k]) [B, T] fp32 from full logits (ids < 0 weigh nothing)."""
    picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.clamp(min=0))
    return (picked * torch.where(ids >= 0, weights.float(), 0.0)).sum(-1)


def _input(batch: Collated, name: str, like: torch.Tensor) -> torch.Tensor:
    return batch.extras[name].to(like.dtype)


def _threshold(batch: Collated, name: str, config: dict[str, float], like: torch.Tensor) -> torch.Tensor:
    """A clip threshold per position: the datum's own where it gave one, else the config's."""
    default = torch.full_like(like, config[name])
    if name not in batch.extras:
        return default
    given = _input(batch, name, like)
    return torch.where(torch.isnan(given), default, given)


def _ratio(logprobs: torch.Tensor, batch: Collated) -> torch.Tensor:
    return torch.exp(logprobs - _input(batch, "logprobs", logprobs))


def cross_entropy(logprobs: torch.Tensor, batch: Collated, config: dict[str, float]) -> torch.Tensor:
    # Weights are used verbatim: fractional (per-example means) and negative (a custom loss's -dLoss/dlogprob).
    return -(logprobs * batch.weights.to(logprobs.dtype))


def importance_sampling(logprobs: torch.Tensor, batch: Collated, config: dict[str, float]) -> torch.Tensor:
    # Policy gradient corrected for sampling from older weights: -ratio * advantage per token.
    advantages = _input(batch, "advantages", logprobs)
    return -(_ratio(logprobs, batch) * advantages * batch.weights.to(logprobs.dtype))


def ppo(logprobs: torch.Tensor, batch: Collated, config: dict[str, float]) -> torch.Tensor:
    advantages = _input(batch, "advantages", logprobs)
    ratio = _ratio(logprobs, batch)
    low, high = _threshold(batch, "clip_low_threshold", config, ratio), _threshold(batch, "clip_high_threshold", config, ratio)
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    return -(torch.minimum(ratio * advantages, clipped * advantages) * batch.weights.to(logprobs.dtype))


def cispo(logprobs: torch.Tensor, batch: Collated, config: dict[str, float]) -> torch.Tensor:
    advantages = _input(batch, "advantages", logprobs)
    ratio = _ratio(logprobs, batch)
    low, high = _threshold(batch, "clip_low_threshold", config, ratio), _threshold(batch, "clip_high_threshold", config, ratio)
    clipped = torch.minimum(torch.maximum(ratio, low), high).detach()  # sg(clip(r)): the gradient flows through logp
    return -(clipped * logprobs * advantages * batch.weights.to(logprobs.dtype))


def dro(logprobs: torch.Tensor, batch: Collated, config: dict[str, float]) -> torch.Tensor:
    advantages = _input(batch, "advantages", logprobs)
    drift = logprobs - _input(batch, "logprobs", logprobs)
    return -((logprobs * advantages - 0.5 * config["beta"] * drift * drift) * batch.weights.to(logprobs.dtype))


def gspo(logprobs: torch.Tensor, batch: Collated, config: dict[str, float]) -> torch.Tensor:
    # GSPO-token: each sequence's length-normalised ratio s, clipped as PPO clips r, spread over its masked positions.
    advantages = _input(batch, "advantages", logprobs)
    mask = _sequence_mask(batch, logprobs)
    length = mask.sum(-1, keepdim=True).clamp(min=1.0)
    log_s = ((logprobs - _input(batch, "logprobs", logprobs)) * mask).sum(-1, keepdim=True) / length
    # Value s at every position, gradient s * dlp: summed over the sequence / length, GSPO's own gradient.
    ratio = torch.exp(log_s.detach() + logprobs - logprobs.detach())
    low, high = _threshold(batch, "clip_low_threshold", config, ratio), _threshold(batch, "clip_high_threshold", config, ratio)
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    per_token = torch.minimum(ratio * advantages, clipped * advantages)
    return -(per_token * mask / length * batch.weights.to(logprobs.dtype))


def stable_reinforce(logprobs: torch.Tensor, batch: Collated, config: dict[str, float]) -> torch.Tensor:
    # REINFORCE with a truncated importance weight sg(min(r, C)): the sampler–trainer mismatch corrected, bounded by C.
    advantages = _input(batch, "advantages", logprobs)
    cap = _threshold(batch, "clip_high_threshold", config, logprobs)
    weight = torch.minimum(_ratio(logprobs, batch), cap).detach()
    return -(weight * logprobs * advantages * batch.weights.to(logprobs.dtype))


def _sequence_mask(batch: Collated, like: torch.Tensor) -> torch.Tensor:
    """The positions a sequence ratio spans: the datum's sequence_ratio_mask where it gave one, else those that count."""
    counted = batch.counted.to(like.dtype)
    if "sequence_ratio_mask" not in batch.extras:
        return counted
    given = _input(batch, "sequence_ratio_mask", like)
    return torch.where(torch.isnan(given), counted, given)


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling, "ppo": ppo,
                             "cispo": cispo, "dro": dro, "gspo": gspo, "stable_reinforce": stable_reinforce}
assert set(LOSSES) == set(LOSS_CONFIG_DEFAULTS), "every loss the contract names has a function here"


def normaliser(loss_fn: str, datums: list[Datum]) -> float:
    """What a "mean" reduction divides these datums' loss sum by: the sum of |weights| over the target positions
    (cross_entropy), or the positions that count (RL losses: non-zero weight, or non-zero advantage without weights).
    From the host's own lists, so a pass needs no device-to-host copy for it: the weights as the pass multiplies by
    them (fp32), summed exactly."""
    if loss_fn in RL_LOSSES:
        return float(sum(d.num_targets for d in datums))
    if loss_fn == CUSTOM_LOSS_FN:  # a custom loss is one scalar per datum: its mean is per datum
        return float(len(datums))
    with np.errstate(over="ignore"):  # a weight past fp32's range is inf, as in the pass (whose loss is then refused)
        # a soft datum's weights are its (N, K) ones: the pass multiplies each target's logprob by them
        return math.fsum(float(np.abs(np.asarray(w, dtype=np.float32)).sum(dtype=np.float64))
                         if (w := d.soft_weights if d.soft_weights is not None else d.weights) is not None
                         else float(d.length) for d in datums)
