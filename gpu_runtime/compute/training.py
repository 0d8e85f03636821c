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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpu_runtime.compute.batches import Collated, Datum, collate, rows
from gpu_runtime.compute.custom_losses import custom_loss
from gpu_runtime.compute.joined_rows import arrange, build, joins
from gpu_runtime.compute.lora import ops
from gpu_runtime.compute.lora.layer import Segment, routed
from gpu_runtime.compute.losses import LOSSES, normaliser
from gpu_runtime.compute.optim_tick import StepOrder, optimizer_tick
from gpu_runtime.compute.pass_logprobs import checkpointed, pass_logprobs
from gpu_runtime.compute.plan import Outcome, PartOutcome, PassPart, RunWeights
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.errors import BadInput

if TYPE_CHECKING:
    from gpu_runtime.compute.sharding import RankShard


def forward_backward_pass(entry: BaseEntry, runs: Mapping[str, RunWeights], parts: list[PassPart], device: torch.device,
                          shard: RankShard | None = None, checkpoint_layers: int = 0) -> list[Outcome]:
    """One forward and backward pass of the base; each run's loss sum is backpropagated into its own LoRA's .grad
    (a sum: optim_step divides by the normaliser accumulated over the calls). A pass of forward parts only runs
    without autograd and touches no gradient. `checkpoint_layers`: decoder layers recomputed in backward.

    No host sync inside: normalisers come from the host's own lists, a part whose loss is not finite is kept out of
    every gradient on the device (its rows' gradient zeroed before it reaches the model), and the pass's loss sums and
    outputs come back in one device-to-host copy at its end (a sharded pass also sums its losses over the ranks).

    A part whose datums join (compute/joined_rows.py) runs them side by side in fewer model rows; the logprobs come
    back in the padded layout, so the losses below never know."""
    forward_only = all(part.forward_only for part in parts)
    local = parts if shard is None else shard.rows_of_this_rank(parts)
    # this pass's gradients alone are all-reduced
    stash = None if shard is None or forward_only else shard.stash_grads(runs, parts)
    datums = [datum for part in local for datum in part.examples] or [_padding_row(entry)]
    data = collate(datums, device)
    spans, start = [], 0
    for part in local:
        spans.append(slice(start, start + len(part.examples)))
        start += len(part.examples)
    # which parts' datums share model rows (joined_rows.py); the segments then name model rows, not datums
    join = [shard is None and joins(part, runs, entry.model) for part in local]
    model_rows, joined = spans, None
    if any(join):
        arranged, model_rows = arrange(data.lengths, spans, join)
        joined = build(arranged, data.lengths, data.input_ids, data.targets, data.soft_targets, data.soft_weights)
    segments = [Segment(part.run_id, rows_of.start, rows_of.stop, dropout_seed=part.dropout_seed,
                        call_rows=part.call_rows, call_width=part.call_width, row_offset=part.row_offset)
                for part, rows_of in zip(local, model_rows) if part.examples and part.run_id is not None]
    checkpoint_layers = 0 if forward_only else checkpoint_layers
    kernel = _lora_kernel(parts, device)
    with torch.set_grad_enabled(not forward_only), routed(entry.routing, segments, kernel), \
            checkpointed(entry.model, checkpoint_layers):
        logprobs = pass_logprobs(entry.model, data, segments, sharded=shard is not None, joined=joined)
        sums: list[torch.Tensor | None] = []
        norms: list[float] = []
        shipped: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (part, logprobs, elementwise) to copy back
        metrics: dict[int, dict[str, torch.Tensor]] = {}  # a custom loss's metrics, per part, copied back with them
        failed: dict[int, BadInput] = {}  # a custom graph that failed on these rows: that part alone is refused
        for i, (part, span) in enumerate(zip(local, spans)):
            if not part.examples:
                sums.append(None)  # none of this call's rows are on this rank
                norms.append(0.0)
                continue
            if part.custom is not None:
                try:
                    elementwise, metrics[i] = custom_loss(logprobs[span], rows(data, span), part.custom)
                except BadInput as exc:
                    sums.append(None)
                    norms.append(0.0)
                    failed[i] = exc
                    continue
            else:
                elementwise = LOSSES[part.loss_fn](logprobs[span], rows(data, span), part.loss_config)
            sums.append(elementwise.sum())
            norms.append(normaliser(part.loss_fn, part.examples))
            if part.return_outputs:
                shipped.append((i, logprobs[span].detach(), elementwise.detach()))
        if shard is None:
            if not forward_only:
                _backward([s for s in sums if s is not None], logprobs, _finite_rows(sums, spans, data))
            host = _to_host(sums, shipped, metrics)  # the pass's one device-to-host copy
            totals = list(zip(host.sums, norms))
            outputs = _outputs(local, host.outputs, data.lengths, spans)
        else:
            totals = shard.all_reduce_sums(list(zip(sums, norms)))  # every rank decides alike which parts count
            outputs = _outputs(local, _to_host([], shipped).outputs, data.lengths, spans)
            if any(part.return_outputs for part in parts):
                outputs = shard.gather_outputs(outputs)
            if not forward_only:
                # Every rank runs backward through every layer, rows or not: FSDP's gathers must match across ranks.
                ok = torch.tensor([math.isfinite(t) for t, _ in totals], device=logprobs.device)
                rows_ok = _rows_of(ok, spans, data)
                _backward([s for s in sums if s is not None] + [logprobs.nan_to_num().sum() * 0.0], logprobs, rows_ok)
    outcomes: list[Outcome] = []
    host_metrics = host.metrics if shard is None else {}
    for i, ((global_sum, norm), part_outputs) in enumerate(zip(totals, outputs)):
        if i in failed:
            outcomes.append(failed[i])
            continue
        if not math.isfinite(global_sum):
            # Its rows' gradients were zeroed: a NaN/inf would poison every gradient this run accumulated so far.
            outcomes.append(BadInput(f"the batch's loss is {global_sum}; check its weights and tokens", field="batch"))
            continue
        outcomes.append(PartOutcome(global_sum, norm, part_outputs, host_metrics.get(i), lora_kernel=kernel,
                                    join_rows=join[i]))
    if shard is not None and stash is not None:
        shard.reduce_grads(stash)
    return outcomes


def _lora_kernel(parts: list[PassPart], device: torch.device) -> ops.Impl:
    """The pass's segmented LoRA kernel: the one its replayed records name (recovery replays a record alone in its
    pass, so parts never disagree), else today's choice for every live part."""
    named = {part.lora_kernel for part in parts if part.lora_kernel is not None}
    if len(named) > 1:
        raise ValueError(f"one pass, one LoRA kernel: its parts name {sorted(named)}")
    return ops.pass_kernel(device, next(iter(named), None))


def _finite_rows(sums: list[torch.Tensor | None], spans: list[slice], data: Collated) -> torch.Tensor:
    """[rows] bool on the device: whether each row's part has a finite loss sum (no host sync to know)."""
    ok = torch.stack([torch.isfinite(s) if s is not None else torch.ones((), dtype=torch.bool, device=data.weights.device)
                      for s in sums]) if sums else torch.ones(0, dtype=torch.bool, device=data.weights.device)
    return _rows_of(ok, spans, data)


def _rows_of(per_part: torch.Tensor, spans: list[slice], data: Collated) -> torch.Tensor:
    """A per-part flag spread over each part's rows (rows past the parts, e.g. a padding row, are False)."""
    index = [i for i, span in enumerate(spans) for _ in range(span.stop - span.start)]
    index += [len(spans)] * (data.input_ids.shape[0] - len(index))
    padded = torch.cat([per_part.to(torch.bool), torch.zeros(1, dtype=torch.bool, device=per_part.device)])
    return padded[torch.tensor(index, dtype=torch.long).to(per_part.device, non_blocking=True)]


def _backward(losses: list[torch.Tensor], logprobs: torch.Tensor, rows_ok: torch.Tensor) -> None:
    """Backpropagate the sum of `losses` (each run's, into its own .grad); rows whose part is not finite get a zero
    gradient at the logprobs, so nothing of them reaches the model. Values are torch.where's: bitwise those of
    backpropagating the finite parts alone."""
    if not losses or not logprobs.requires_grad:
        return
    logprobs.register_hook(lambda grad: torch.where(rows_ok[:, None], grad, 0.0))
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    total.backward()  # sums, accumulated in .grad; optim_step divides by each run's own normaliser


@dataclass
class _Host:
    sums: list[float]
    outputs: dict[int, tuple[list[float], list[float]]]  # part → its logprobs and elementwise losses, flattened
    metrics: dict[int, dict[str, float]]  # part → a custom loss's metrics


def _to_host(sums: list[torch.Tensor | None], shipped: list[tuple[int, torch.Tensor, torch.Tensor]],
             metrics: dict[int, dict[str, torch.Tensor]] | None = None) -> _Host:
    """Every loss sum, shipped output and custom metric in one device-to-host copy (`tolist` of one flat fp32 tensor)."""
    metrics = metrics or {}
    pieces = [torch.stack([s.detach().float() for s in sums if s is not None])] if any(s is not None for s in sums) else []
    for _, lp, el in shipped:
        pieces += [lp.float().reshape(-1), el.float().reshape(-1)]
    pieces += [m.reshape(1) for part in metrics.values() for m in part.values()]
    flat: list[float] = torch.cat(pieces).tolist() if pieces else []
    present = iter(flat[:sum(s is not None for s in sums)])
    host = _Host([next(present) if s is not None else 0.0 for s in sums], {}, {})
    at = sum(s is not None for s in sums)
    for i, lp, _ in shipped:
        n = lp.numel()
        host.outputs[i] = (flat[at:at + n], flat[at + n:at + 2 * n])
        at += 2 * n
    for i, part in metrics.items():
        host.metrics[i] = dict(zip(part, flat[at:at + len(part)]))
        at += len(part)
    return host


def _outputs(local: list[PassPart], shipped: dict[int, tuple[list[float], list[float]]], lengths: list[int],
             spans: list[slice]) -> list[list[dict[str, list[float]]] | None]:
    """Each datum's per-position logprobs and losses, cut to its own length, per part that asked for them."""
    width = max(lengths) if lengths else 0
    outputs: list[list[dict[str, list[float]]] | None] = []
    for i, (part, span) in enumerate(zip(local, spans)):
        if not part.return_outputs:
            outputs.append(None)
            continue
        lp, el = shipped.get(i, ([], []))
        outputs.append([{"logprobs": lp[r * width:r * width + n], "elementwise_loss": el[r * width:r * width + n]}
                        for r, n in enumerate(lengths[span])])
    return outputs


def adamw_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, normaliser: float,
               settings: dict[str, float], kernel: str | None = None) -> float:
    """One run's AdamW on its summed gradients over their normaliser (an optimizer tick of one: optim_tick.py);
    clears them. Returns the gradient norm; a non-finite one skips the step (the gradients are dropped all the same)."""
    (grad_norm,) = optimizer_tick([StepOrder(params, optimizer, normaliser, settings, kernel)])
    return grad_norm


def _padding_row(entry: BaseEntry) -> Datum:
    """A rank with no rows this pass runs one of weight 0: it must still take part in every gather."""
    pad = entry.base.tokenizer.pad_token_id or 0
    return Datum([pad], [pad], [0.0])
