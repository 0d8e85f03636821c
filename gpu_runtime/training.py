"""The training step on one rank: a forward+backward pass over several runs' rows, and AdamW.

The engine calls both in a single process. In a multi-GPU pool (gpu_runtime/ranks.py) every rank
calls them with the same arguments, which rank 0 broadcast: `forward_backward_pass` then takes only
this rank's rows, sums each part's loss and normaliser over the ranks (so a loss is normalised over
the global token count), and adds the ranks' summed gradients to each run's own (gpu_runtime/sharding.py).
`adamw_step` needs no communication: every rank holds the same gradients and applies the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gpu_runtime.batches import Collated, Example, collate
from gpu_runtime.errors import BadInput, SignalError
from gpu_runtime.losses import LOSSES, target_logprobs
from gpu_runtime.multilora import Segment, routed
from gpu_runtime.pool import BaseEntry
from gpu_runtime.run_state import RunState

if TYPE_CHECKING:
    from gpu_runtime.sharding import RankShard

Outcome = tuple[float, float] | SignalError  # (loss sum, normaliser) of a part, or why it was left out


@dataclass
class PassPart:
    """One call's rows in one pass, as plain data: rank 0 broadcasts these, and every rank runs the same ones."""

    run_id: str
    examples: list[Example]
    row_offset: int  # where these rows start within the call: its dropout masks are sliced from there
    call_rows: int  # the whole call's rows and padded width: its dropout masks are drawn at this shape
    call_width: int
    dropout_seed: int
    loss_fn: str
    loss_config: dict[str, Any] = field(default_factory=dict)
    backup: bool = False  # the first part of a split call: keep the run's gradients, to put back if a later part fails


def forward_backward_pass(entry: BaseEntry, runs: dict[str, RunState], parts: list[PassPart], device: torch.device,
                          shard: RankShard | None = None) -> list[Outcome]:
    """One forward and backward pass of the base; each run's loss sum is backpropagated into its own LoRA's .grad
    (a sum: optim_step divides by the normaliser accumulated over the calls)."""
    local = parts if shard is None else shard.rows_of_this_rank(parts)
    stash = None if shard is None else shard.stash_grads(runs, parts)  # this pass's gradients alone are all-reduced
    rows = [example for part in local for example in part.examples] or [_padding_row(entry)]
    data = collate(rows, device)
    segments, spans, start = [], [], 0
    for part in local:
        end = start + len(part.examples)
        spans.append(slice(start, end))
        if part.examples:
            segments.append(Segment(part.run_id, start, end, dropout_seed=part.dropout_seed, call_rows=part.call_rows,
                                    call_width=part.call_width, row_offset=part.row_offset))
        start = end
    with routed(entry.routing, segments):
        logits = entry.model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits
    logprobs = target_logprobs(logits, data.targets)
    sums: list[tuple[torch.Tensor | None, float]] = []
    for part, span in zip(local, spans):
        if part.examples:
            sums.append(LOSSES[part.loss_fn](logprobs[span], _rows(data, span), part.loss_config))
        else:
            sums.append((None, 0.0))  # none of this call's rows are on this rank
    if shard is None:
        totals = [(float(s.item()) if s is not None else 0.0, n) for s, n in sums]
        total: torch.Tensor | None = None
    else:
        totals = shard.all_reduce_sums(sums)  # every rank decides alike which parts count
        # Every rank runs backward through every layer, rows or not: FSDP's gathers must match across ranks.
        total = logprobs.nan_to_num().sum() * 0.0
    outcomes: list[Outcome] = []
    for (loss_sum, _), (global_sum, normaliser) in zip(sums, totals):
        if not math.isfinite(global_sum):
            # Left out of backward: a NaN/inf would poison every gradient this run accumulated so far.
            outcomes.append(BadInput(f"the batch's loss is {global_sum}; check its weights and tokens", field="batch"))
            continue
        if loss_sum is not None:
            total = loss_sum if total is None else total + loss_sum
        outcomes.append((global_sum, normaliser))
    if total is not None:
        total.backward()  # sums, accumulated in .grad; optim_step divides by each run's own normaliser
    if shard is not None and stash is not None:
        shard.reduce_grads(stash)
    return outcomes


def adamw_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, normaliser: float,
               settings: dict[str, float]) -> float:
    """AdamW on the summed gradients divided by their normaliser; clears them. Returns the gradient norm; a
    non-finite one skips the step (the gradients are dropped all the same)."""
    grads = [param.grad for param in params if param.grad is not None]
    if grads:  # summed token losses → their mean over all calls; one foreach call, the bits of a div_ each
        torch._foreach_div_(grads, normaliser)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings["grad_clip_norm"] or math.inf))
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


def _padding_row(entry: BaseEntry) -> Example:
    """A rank with no rows this pass runs one of weight 0: it must still take part in every gather."""
    pad = entry.base.tokenizer.pad_token_id or 0
    return Example([pad, pad], [0.0, 0.0])


def _rows(data: Collated, rows: slice) -> Collated:
    return Collated(data.input_ids[rows], data.attention_mask[rows], data.targets[rows], data.weights[rows],
                    {k: v[rows] for k, v in data.extras.items()})
