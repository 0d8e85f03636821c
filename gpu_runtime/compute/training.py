"""The training step on one rank: a forward+backward pass over several runs' rows, and AdamW.

The engine calls both in a single process. In a multi-GPU pool (gpu_runtime/compute/ranks.py) every rank
calls them with the same arguments, which rank 0 broadcast: `forward_backward_pass` then takes only
this rank's rows, sums each part's loss and normaliser over the ranks (so a loss is normalised over
the global token count), and adds the ranks' summed gradients to each run's own (gpu_runtime/compute/sharding.py).
`adamw_step` needs no communication: every rank holds the same gradients and applies the same step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from gpu_runtime.compute.batches import Datum, collate, rows
from gpu_runtime.compute.lora.layer import Segment, routed
from gpu_runtime.compute.losses import LOSSES, normaliser, target_logprobs
from gpu_runtime.compute.plan import Outcome, PartOutcome, PassPart, RunWeights
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.soft_targets import gather_logprobs
from gpu_runtime.errors import BadInput

if TYPE_CHECKING:
    from gpu_runtime.compute.sharding import RankShard


def forward_backward_pass(entry: BaseEntry, runs: Mapping[str, RunWeights], parts: list[PassPart], device: torch.device,
                          shard: RankShard | None = None) -> list[Outcome]:
    """One forward and backward pass of the base; each run's loss sum is backpropagated into its own LoRA's .grad
    (a sum: optim_step divides by the normaliser accumulated over the calls). A pass of forward parts only runs
    without autograd and touches no gradient."""
    forward_only = all(part.forward_only for part in parts)
    local = parts if shard is None else shard.rows_of_this_rank(parts)
    # this pass's gradients alone are all-reduced
    stash = None if shard is None or forward_only else shard.stash_grads(runs, parts)
    datums = [datum for part in local for datum in part.examples] or [_padding_row(entry)]
    data = collate(datums, device)
    segments, spans, start = [], [], 0
    for part in local:
        end = start + len(part.examples)
        spans.append(slice(start, end))
        if part.examples and part.run_id is not None:
            segments.append(Segment(part.run_id, start, end, dropout_seed=part.dropout_seed, call_rows=part.call_rows,
                                    call_width=part.call_width, row_offset=part.row_offset))
        start = end
    with torch.set_grad_enabled(not forward_only), routed(entry.routing, segments):
        logits = entry.model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits
        logprobs = target_logprobs(logits, data.targets)
        if data.soft is not None:  # (B, T, K) soft targets' logprobs from the same logits (compute/soft_targets.py)
            data.soft.logprobs = gather_logprobs(logits, data.soft.targets)
        sums: list[tuple[torch.Tensor | None, float]] = []
        outputs: list[list[dict[str, list[float]]] | None] = []
        for part, span in zip(local, spans):
            if not part.examples:
                sums.append((None, 0.0))  # none of this call's rows are on this rank
                outputs.append([] if part.return_outputs else None)
                continue
            part_rows = rows(data, span)
            elementwise = LOSSES[part.loss_fn](logprobs[span], part_rows, part.loss_config)
            sums.append((elementwise.sum(), normaliser(part.loss_fn, part_rows)))
            outputs.append(_outputs(logprobs[span], elementwise, part_rows.lengths) if part.return_outputs else None)
    if shard is None:
        totals = [(float(s.item()) if s is not None else 0.0, n) for s, n in sums]
        total: torch.Tensor | None = None
    else:
        totals = shard.all_reduce_sums(sums)  # every rank decides alike which parts count
        if any(part.return_outputs for part in parts):
            outputs = shard.gather_outputs(outputs)
        # Every rank runs backward through every layer, rows or not: FSDP's gathers must match across ranks.
        total = None if forward_only else logprobs.nan_to_num().sum() * 0.0
    outcomes: list[Outcome] = []
    for part, (loss_sum, _), (global_sum, norm), part_outputs in zip(parts, sums, totals, outputs):
        if not math.isfinite(global_sum):
            # Left out of backward: a NaN/inf would poison every gradient this run accumulated so far.
            outcomes.append(BadInput(f"the batch's loss is {global_sum}; check its weights and tokens", field="batch"))
            continue
        if loss_sum is not None and not part.forward_only:
            total = loss_sum if total is None else total + loss_sum
        outcomes.append(PartOutcome(global_sum, norm, part_outputs))
    if total is not None:
        total.backward()  # sums, accumulated in .grad; optim_step divides by each run's own normaliser
    if shard is not None and stash is not None:
        shard.reduce_grads(stash)
    return outcomes


def _outputs(logprobs: torch.Tensor, elementwise: torch.Tensor, lengths: list[int]) -> list[dict[str, list[float]]]:
    """Each datum's per-position logprobs and losses, cut to its own length (one transfer for the whole part)."""
    lp, el = logprobs.detach().float().cpu(), elementwise.detach().float().cpu()
    return [{"logprobs": lp[i, :n].tolist(), "elementwise_loss": el[i, :n].tolist()} for i, n in enumerate(lengths)]


def adamw_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, normaliser: float,
               settings: dict[str, float]) -> float:
    """AdamW on the summed gradients divided by their normaliser; clears them. Returns the gradient norm; a
    non-finite one skips the step (the gradients are dropped all the same)."""
    grads = [param.grad for param in params if param.grad is not None]
    if grads:  # summed token losses → their mean over all calls; one foreach call, the bits of a div_ each
        torch._foreach_div_(grads, normaliser)
    grad_norm = clip_grad_norm(grads, settings["grad_clip_norm"] or math.inf)
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    for group in optimizer.param_groups:  # settings may change per call: schedules live in the user's loop
        group["lr"] = settings["learning_rate"]
        group["betas"] = (settings["beta1"], settings["beta2"])
        group["eps"] = settings["eps"]
        group["weight_decay"] = settings["weight_decay"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> float:
    """torch's `clip_grad_norm_`, bit for bit (the same ops in the same order), less its multiply by a coefficient
    of exactly 1 when the norm is within bounds: a pass over every gradient that changes no bit of them."""
    if not grads:
        return 0.0
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # float / tensor: torch's own expression
    if not coefficient.item() == 1.0:  # NaN too: torch multiplies then, and the caller drops these gradients anyway
        torch._foreach_mul_(grads, coefficient)
    return float(total)


def _padding_row(entry: BaseEntry) -> Datum:
    """A rank with no rows this pass runs one of weight 0: it must still take part in every gather."""
    pad = entry.base.tokenizer.pad_token_id or 0
    return Datum([pad], [pad], [0.0])
