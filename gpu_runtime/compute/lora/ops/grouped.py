"""The "grouped" torch kernel: the segmented LoRA with one bmm per group of segments of equal (rows, rank), so a
pass's Python is per group, not per run (issue 30: host work of 8 co-batched runs near one run's).

Its bits are not the per-segment reference's (a bmm rounds otherwise than F.linear), so a journal names the kernel
each forward_backward ran with and replay runs that one (compute/lora/ops/__init__.py, `pass_kernel`). Replay runs a
record's call alone, so a segment's bits must not depend on what shares its group: a bmm of one matrix takes
another path than a bmm of several (threaded, it rounds otherwise), while a bmm of two or more gives each matrix the
same bits whatever the others (tests/gpu_runtime/test_lora_grouped.py), so a group of one segment runs as a bmm of
that segment twice and keeps the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from gpu_runtime.compute.lora.ops.tables import LoraTable, TableSegment


@dataclass(frozen=True)
class SegmentGroup:
    """Segments of equal rows and rank: one batched matmul each way for all of them, whatever runs they are."""

    rows: int
    rank: int
    segments: tuple[TableSegment, ...]

    @cached_property
    def batched(self) -> tuple[TableSegment, ...]:
        """The bmm's batch: the segments, or a lone segment twice (see the module's docstring)."""
        return self.segments if len(self.segments) > 1 else self.segments * 2

    @cached_property
    def consecutive(self) -> bool:
        """Whether the batch's segments follow each other with no gap: their rows are then a view [segments, rows, …]."""
        return all(b.row_start == a.row_end for a, b in zip(self.batched, self.batched[1:]))


def groups(table: LoraTable) -> tuple[SegmentGroup, ...]:
    """The table's segments grouped by (rows, rank), in order of first appearance; made once per table."""
    found: tuple[SegmentGroup, ...] | None = table.cache.get("groups")
    if found is None:
        grouped: dict[tuple[int, int], list[TableSegment]] = {}
        for seg in table.segments:
            grouped.setdefault((seg.row_end - seg.row_start, seg.rank), []).append(seg)
        found = table.cache["groups"] = tuple(SegmentGroup(rows, rank, tuple(segs)) for (rows, rank), segs in grouped.items())
    return found


def _index(group: SegmentGroup, table: LoraTable, device: torch.device, what: str) -> torch.Tensor:
    """The batch's slot or row index on `device`, made once per table."""
    key = (id(group), device, what)
    if key not in table.cache:
        if what == "slots":
            values = [seg.slot for seg in group.batched]
        else:
            values = [row for seg in group.batched for row in range(seg.row_start, seg.row_end)]
        table.cache[key] = torch.tensor(values, dtype=torch.long, device=device)
    index: torch.Tensor = table.cache[key]
    return index


def _scalings(group: SegmentGroup, like: torch.Tensor, table: LoraTable) -> torch.Tensor:
    """[batch, 1, 1] in like's dtype: each segment's scaling, multiplying its rows."""
    key = (id(group), like.device, like.dtype, "scalings")
    if key not in table.cache:
        table.cache[key] = torch.tensor([seg.scaling for seg in group.batched], dtype=torch.float32,
                                        device=like.device).to(like.dtype).view(-1, 1, 1)
    scalings: torch.Tensor = table.cache[key]
    return scalings


def _slots(buffer: torch.Tensor, group: SegmentGroup, table: LoraTable) -> torch.Tensor:
    """The batch's slots of a slot buffer (already cut to the group's rank), [batch, …], contiguous."""
    return buffer.index_select(0, _index(group, table, buffer.device, "slots"))


def _rows(t: torch.Tensor, group: SegmentGroup, table: LoraTable) -> torch.Tensor:
    """The batch's rows of t [T, F] as [batch, rows, F], contiguous (a view where they follow each other)."""
    n = len(group.batched)
    if group.consecutive and t.is_contiguous():
        first = group.batched[0].row_start
        return t[first : first + n * group.rows].view(n, group.rows, t.shape[1])
    return t.index_select(0, _index(group, table, t.device, "rows")).view(n, group.rows, t.shape[1])


def _put_rows(out: torch.Tensor, group: SegmentGroup, values: torch.Tensor, table: LoraTable) -> None:
    """out's rows of the group's segments (out [T, F], perhaps a column slice) become values [batch, rows, F] (a lone
    segment's second copy dropped)."""
    n = len(group.segments)
    if n == 1:
        seg = group.segments[0]
        out[seg.row_start : seg.row_end] = values[0]
    elif group.consecutive:
        first = group.segments[0].row_start
        out[first : first + n * group.rows] = values.reshape(-1, values.shape[-1])
    else:
        out.index_copy_(0, _index(group, table, out.device, "rows"), values.reshape(-1, values.shape[-1]))


def _repeats(table: LoraTable) -> bool:
    """Whether a slot has several segments (a run twice in the pass): its weight gradients then add in segment order."""
    found: bool | None = table.cache.get("repeats")
    if found is None:
        found = table.cache["repeats"] = len({seg.slot for seg in table.segments}) < len(table.segments)
    return found


def grouped_shrink(x: torch.Tensor, A_slots: torch.Tensor, table: LoraTable,
                   dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    xm = x if dropout_mask is None else x * dropout_mask
    h = x.new_zeros(x.shape[0], table.max_rank)
    for group in groups(table):
        r = group.rank
        _put_rows(h[:, :r], group, torch.bmm(_rows(xm, group, table), _slots(A_slots[:, :r], group, table).transpose(1, 2)),
                  table)
    return h


def grouped_expand(h: torch.Tensor, B_slots: torch.Tensor, table: LoraTable, out: torch.Tensor | None = None) -> torch.Tensor:
    delta = h.new_zeros(h.shape[0], B_slots.shape[1])
    for group in groups(table):
        r = group.rank
        B = _slots(B_slots[:, :, :r], group, table)  # [batch, out, r]
        hr = _rows(h[:, :r].contiguous() if r < h.shape[1] else h, group, table)
        _put_rows(delta, group, torch.bmm(hr, B.transpose(1, 2)) * _scalings(group, h, table), table)
    if out is None:
        return delta
    return out.add_(delta.to(out.dtype))


def grouped_backward(grad: torch.Tensor, x: torch.Tensor, h: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor,
                     table: LoraTable, dropout_mask: torch.Tensor | None,
                     grad_into: tuple[torch.Tensor, torch.Tensor] | None = None, b_table: LoraTable | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference_backward's results, a bmm per group; a slot seen twice sums its segments' gradients in order.
    `b_table`: B's slots where they are not A's (same segments otherwise, so its groups pair with table's)."""
    # the expert layout's windows overlap in memory: index_add_ may write a whole copy back over them (it does in
    # bf16 on the CPU), so its gradients are added segment by segment, each a plain view
    per_segment = _repeats(table) or b_table is not None
    b_table = b_table or table
    xm = x if dropout_mask is None else x * dropout_mask
    grad_x = torch.zeros_like(x)
    grad_A, grad_B = grad_into if grad_into is not None else (torch.zeros_like(A_slots), torch.zeros_like(B_slots))
    in_order: dict[TableSegment, tuple[torch.Tensor, torch.Tensor]] = {}  # a repeated slot's gradients, per segment
    for group, b_group in zip(groups(table), groups(b_table)):
        r, n, scalings = group.rank, len(group.segments), _scalings(group, grad, table)
        rows_grad = _rows(grad, group, table)  # [batch, rows, out]
        grad_h = torch.bmm(rows_grad, _slots(B_slots[:, :, :r], b_group, b_table)) * scalings  # [batch, rows, r]
        _put_rows(grad_x, group, torch.bmm(grad_h, _slots(A_slots[:, :r], group, table)), table)
        hr = _rows(h[:, :r].contiguous() if r < h.shape[1] else h, group, table)
        gA = torch.bmm(grad_h.transpose(1, 2), _rows(xm, group, table))[:n].to(grad_A.dtype)
        gB = (torch.bmm(rows_grad.transpose(1, 2), hr) * scalings)[:n].to(grad_B.dtype)
        if per_segment:
            in_order.update({seg: (a, b) for seg, a, b in zip(group.segments, gA, gB)})
            continue
        grad_A[:, :r].index_add_(0, _index(group, table, grad_A.device, "slots")[:n], gA)
        grad_B[:, :, :r].index_add_(0, _index(b_group, b_table, grad_B.device, "slots")[:n], gB)
    for seg, b_seg in zip(table.segments, b_table.segments) if in_order else ():  # segment order, as the reference
        a, b = in_order[seg]
        grad_A[seg.slot, : seg.rank] += a
        grad_B[b_seg.slot, :, : seg.rank] += b
    if dropout_mask is not None:
        grad_x = grad_x * dropout_mask
    return grad_x, grad_A, grad_B
