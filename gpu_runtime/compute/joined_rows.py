"""Joined rows: several datums of one call share a model row of a training pass, one after another, instead of each
being right-padded to the pass's longest (issue 30, item 6).

Positions restart at 0 for each datum and attention stays inside it (a block-diagonal causal mask, built here from the
host's layout, so transformers never reads the positions back to find the blocks: no host sync). The model runs on
the joined rows; its per-position target logprobs are gathered back into the padded [datums, width] layout (a
differentiable index gather), so every loss, output and finite-row mask reads what it reads without joining.

Which parts join (`joins`): decided from the part's own datums, so co-batching and replay decide alike, and only where
it is safe and pays:
- the model's attention takes an explicit 4D mask and positions (sdpa or eager; no sliding-window layer, which needs
  a mask of its own; no linear-attention or recurrent layer, which ignores masks and positions);
- the pass is not sharded, and the part is the whole call (a split call's rows are sliced by row_offset);
- no dropout on its rows (dropout masks are drawn per padded datum row at the call's shape);
- first-fit-decreasing into rows no wider than the part's longest datum leaves at most (1 - MIN_SAVING) of its rows.
A journaled call records whether it joined (`join_rows`) and replays as it ran; records written before replay unjoined.
`SIGNAL_JOIN_ROWS=0` turns joining off for live passes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gpu_runtime.compute.batches import host_to_device
from gpu_runtime.compute.plan import PassPart, RunWeights

JOIN_ROWS_ENV = "SIGNAL_JOIN_ROWS"  # "0": live passes never join (a replay does what its record says)
MIN_SAVING = 0.25  # a part joins only when that saves at least this share of its rows (its cells at its own width)
MASKED_IMPLEMENTATIONS = ("sdpa", "eager")  # attention that takes our 4D mask as it is


def enabled() -> bool:
    return os.environ.get(JOIN_ROWS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def windowed(config: object) -> bool:
    """Whether some attention layer of this model sees a sliding window (Gemma 2/3, GPT-OSS, Mistral, …)."""
    layer_types = getattr(config, "layer_types", None) or []
    return getattr(config, "sliding_window", None) is not None and (
        not layer_types or any("sliding" in str(kind) for kind in layer_types))


def joinable(model: nn.Module) -> bool:
    """Whether this model's attention confines each datum by our block-diagonal mask and restarts its positions."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in MASKED_IMPLEMENTATIONS or windowed(config):
        return False
    # a linear-attention (Gated DeltaNet) or recurrent layer carries state across the whole row, mask or not
    return all(str(kind) == "full_attention" for kind in getattr(config, "layer_types", None) or [])


def joins(part: PassPart, runs: Mapping[str, RunWeights], model: nn.Module) -> bool:
    """Whether this part's datums join (in an unsharded pass): see the module's docstring. A replayed part joins as its
    record says; a live one where joining is on and saves enough."""
    if not part.examples or not joinable(model):
        return False
    if part.row_offset != 0 or len(part.examples) != part.call_rows:
        return False  # a split call: its dropout masks and gradients' backup follow padded datum rows
    run = runs.get(part.run_id) if part.run_id is not None else None
    if not part.forward_only and part.dropout_seed is not None and run is not None and run.lora["dropout"] > 0:
        return False  # dropout masks are drawn per padded datum row at the call's shape
    if part.join_rows is not None:
        return part.join_rows
    return enabled() and saves([d.length for d in part.examples])


def first_fit_decreasing(lengths: list[int]) -> list[list[int]]:
    """Datums (indices into `lengths`) in rows no wider than the longest: longest first, each into the first row with
    room, ties by index (deterministic: a replay arranges alike). Never more rows, nor wider ones, than padding."""
    width = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []  # each row's free width
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if fit is None:
            rows.append([i])
            room.append(width - lengths[i])
        else:
            rows[fit].append(i)
            room[fit] -= lengths[i]
    return rows


def saves(lengths: list[int]) -> bool:
    """Whether joining these datums saves at least MIN_SAVING of their rows."""
    return len(first_fit_decreasing(lengths)) <= (1 - MIN_SAVING) * len(lengths)


@dataclass
class JoinedRows:
    """A pass's model rows [R, W]: its joined parts' datums side by side, every other datum a row of its own."""

    input_ids: torch.Tensor  # [R, W]
    positions: torch.Tensor  # [R, W] each datum's own 0..n-1 (padding continues its row's last datum)
    blocks: torch.Tensor  # [R, W] which datum of its row a cell is (padding: the row's last): attention stays inside
    targets: torch.Tensor  # [R, W]
    to_padded: torch.Tensor  # [B*T] where each cell of the padded layout is in the joined one
    padded_shape: tuple[int, int]
    soft_targets: torch.Tensor | None = None  # [R, W, K]
    soft_weights: torch.Tensor | None = None

    def mask(self, model: nn.Module) -> torch.Tensor:
        """The 4D mask [R, 1, W, W]: causal, within one datum; bool for SDPA, additive in the model's dtype for eager."""
        width = self.blocks.shape[1]
        cells = torch.arange(width, device=self.blocks.device)
        allowed = (cells[None, :] <= cells[:, None])[None, None] & \
            (self.blocks[:, None, :, None] == self.blocks[:, None, None, :])
        return implementation_mask(model, allowed)

    def padded(self, joined: torch.Tensor) -> torch.Tensor:
        """[R, W] values of the joined cells as the padded layout's [B, T] (padding holds some real cell's value, weighed
        0 by every loss); differentiable."""
        return joined.reshape(-1).index_select(0, self.to_padded).view(self.padded_shape)


def implementation_mask(model: nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A 4D bool mask as the model's attention takes it: as it is for SDPA, additive (0 or the dtype's min) for eager."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def arrange(lengths: list[int], spans: list[slice], joined: list[bool]) -> tuple[list[list[int]], list[slice]]:
    """The pass's model rows (datum indices, in order) and each part's span of them: a joined part's rows by
    first-fit-decreasing, any other part's datums a row each."""
    rows: list[list[int]] = []
    part_rows = []
    for span, join in zip(spans, joined):
        start = len(rows)
        own = list(range(span.start, span.stop))
        if join and own:
            rows += [[own[i] for i in row] for row in first_fit_decreasing([lengths[d] for d in own])]
        else:
            rows += [[d] for d in own]
        part_rows.append(slice(start, len(rows)))
    # a rank's padding row (past every part) stays a row of its own
    rows += [[d] for d in range(spans[-1].stop if spans else 0, len(lengths))]
    return rows, part_rows


def build(rows: list[list[int]], lengths: list[int], input_ids: torch.Tensor, targets: torch.Tensor,
          soft_targets: torch.Tensor | None, soft_weights: torch.Tensor | None) -> JoinedRows:
    """The joined tensors from the padded ones (device gathers), their indices built on the host and copied once."""
    batch, padded_width = input_ids.shape
    width = max(sum(lengths[d] for d in row) for row in rows)
    cells = len(rows) * width
    # one int64 buffer: source cell, position, block (each [R*W]), then where each padded cell went ([B*T])
    host = np.zeros(3 * cells + batch * padded_width, dtype=np.int64)
    source, positions, blocks = host[:cells], host[cells:2 * cells], host[2 * cells:3 * cells]
    to_padded = host[3 * cells:].reshape(batch, padded_width)
    for r, row in enumerate(rows):
        at = r * width
        for k, d in enumerate(row):
            n = lengths[d]
            source[at:at + n] = d * padded_width + np.arange(n)
            positions[at:at + n] = np.arange(n)
            blocks[at:at + n] = k
            to_padded[d, :n] = at + np.arange(n)
            to_padded[d, n:] = at + n - 1  # padding: a real cell's value, weighed 0
            at += n
        end = (r + 1) * width
        if at < end:  # the row's padding continues its last datum (positions go on; real cells never see it)
            last = row[-1]
            source[at:end] = last * padded_width + lengths[last] - 1
            positions[at:end] = lengths[last] + np.arange(end - at)
            blocks[at:end] = len(row) - 1
    index = host_to_device(torch.from_numpy(host), input_ids.device)
    source_d = index[:cells]
    shape = (len(rows), width)

    def gathered(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch * padded_width, *t.shape[2:]).index_select(0, source_d).view(*shape, *t.shape[2:])

    return JoinedRows(gathered(input_ids), index[cells:2 * cells].view(shape), index[2 * cells:3 * cells].view(shape),
                      gathered(targets), index[3 * cells:], (batch, padded_width),
                      None if soft_targets is None else gathered(soft_targets),
                      None if soft_weights is None else gathered(soft_weights))
