"""The torch reference of every kernel: its specification, and the CPU and fp32 path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.compute.lora.ops.tables import LoraTable, RowsTable, SegmentGroup

# ---------------------------------------------------------------------------------------------------------------------
# Torch references: the spec of each kernel, and the path off CUDA. They read the table's host copy only.


def reference_shrink(x: torch.Tensor, A_slots: torch.Tensor, table: LoraTable,
                     dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    xm = x if dropout_mask is None else x * dropout_mask
    h = x.new_zeros(x.shape[0], table.max_rank)
    for group in table.groups:
        r = group.rank
        _put_rows(h[:, :r], group, torch.bmm(_rows(xm, group, table), _slots(A_slots, group, table)[:, :r].transpose(1, 2)),
                  table)
    return h


def reference_expand(h: torch.Tensor, B_slots: torch.Tensor, table: LoraTable, out: torch.Tensor | None = None) -> torch.Tensor:
    delta = h.new_zeros(h.shape[0], B_slots.shape[1])
    for group in table.groups:
        r = group.rank
        B = _slots(B_slots, group, table)[:, :, :r]
        _put_rows(delta, group, torch.bmm(_rows(h[:, :r], group, table), B.transpose(1, 2)) * _scalings(group, h, table),
                  table)
    if out is None:
        return delta
    return out.add_(delta.to(out.dtype))


# The torch path batches each group of segments of equal rows and rank into one bmm (a row's values are those of a
# bmm of its segment alone: tests/gpu_runtime/test_lora_ops.py), so its Python is per group, not per run.


def _index(group: SegmentGroup, table: LoraTable, device: torch.device, what: str) -> torch.Tensor:
    """The group's slot or row index on `device`, made once per table."""
    key = (id(group), device, what)
    if key not in table.cache:
        if what == "slots":
            values = [seg.slot for seg in group.segments]
        else:
            values = [row for seg in group.segments for row in range(seg.row_start, seg.row_end)]
        table.cache[key] = torch.tensor(values, dtype=torch.long, device=device)
    index: torch.Tensor = table.cache[key]
    return index


def _scalings(group: SegmentGroup, like: torch.Tensor, table: LoraTable) -> torch.Tensor:
    """[segments, 1, 1] in like's dtype: each segment's scaling, multiplying its rows."""
    key = (id(group), like.device, like.dtype, "scalings")
    if key not in table.cache:
        table.cache[key] = torch.tensor([seg.scaling for seg in group.segments], dtype=torch.float32,
                                        device=like.device).to(like.dtype).view(-1, 1, 1)
    scalings: torch.Tensor = table.cache[key]
    return scalings


def _slots(buffer: torch.Tensor, group: SegmentGroup, table: LoraTable) -> torch.Tensor:
    """The group's slots of a slot buffer, [segments, …]."""
    return buffer.index_select(0, _index(group, table, buffer.device, "slots"))


def _rows(t: torch.Tensor, group: SegmentGroup, table: LoraTable) -> torch.Tensor:
    """The group's rows of t [T, F] as [segments, rows, F]."""
    if group.consecutive:
        first = group.segments[0].row_start
        return t[first : first + len(group.segments) * group.rows].reshape(len(group.segments), group.rows, t.shape[1])
    return t.index_select(0, _index(group, table, t.device, "rows")).view(len(group.segments), group.rows, t.shape[1])


def _put_rows(out: torch.Tensor, group: SegmentGroup, values: torch.Tensor, table: LoraTable) -> None:
    """out's rows of the group (out [T, F], perhaps a column slice) become values [segments, rows, F]."""
    flat = values.reshape(-1, values.shape[-1])
    if group.consecutive:
        first = group.segments[0].row_start
        out[first : first + flat.shape[0]] = flat
    else:
        out.index_copy_(0, _index(group, table, out.device, "rows"), flat)


def reference_segmented_lora(x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: LoraTable,
                             dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The delta [T, out] through autograd: the spec that SegmentedLora's gradients are checked against."""
    return reference_expand(reference_shrink(x, A_slots, table, dropout_mask), B_slots, table)


def reference_backward(grad: torch.Tensor, x: torch.Tensor, h: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor,
                       table: LoraTable, dropout_mask: torch.Tensor | None,
                       grad_into: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_x, grad_A_slots, grad_B_slots of the delta, written segment by segment (a slot seen twice sums). With
    `grad_into` the weight gradients are added into those buffers (in their dtype) and returned."""
    xm = x if dropout_mask is None else x * dropout_mask
    grad_x = torch.zeros_like(x)
    grad_A, grad_B = grad_into if grad_into is not None else (torch.zeros_like(A_slots), torch.zeros_like(B_slots))
    for group in table.groups:
        r, scalings = group.rank, _scalings(group, grad, table)
        slots = _index(group, table, grad_A.device, "slots")
        rows_grad = _rows(grad, group, table)  # [segments, rows, out]
        grad_h = torch.bmm(rows_grad, _slots(B_slots, group, table)[:, :, :r]) * scalings  # [segments, rows, r]
        _put_rows(grad_x, group, torch.bmm(grad_h, _slots(A_slots, group, table)[:, :r]), table)
        # index_add_: a run twice in the pass sums its segments' gradients, in segment order
        grad_A[:, :r].index_add_(0, slots, torch.bmm(grad_h.transpose(1, 2), _rows(xm, group, table)).to(grad_A.dtype))
        grad_B[:, :, :r].index_add_(
            0, slots, (torch.bmm(rows_grad.transpose(1, 2), _rows(h[:, :r], group, table)) * scalings).to(grad_B.dtype))
    if dropout_mask is not None:
        grad_x = grad_x * dropout_mask
    return grad_x, grad_A, grad_B


def reference_shrink_rows(x: torch.Tensor, A_slots: torch.Tensor, table: RowsTable) -> torch.Tensor:
    h = x.new_zeros(x.shape[0], table.max_rank)
    for slot, rows in table.slot_rows:
        r = table.host_slot_ranks[slot]
        h[rows, :r] = F.linear(x[rows], A_slots[slot, :r])
    return h


def reference_expand_rows(h: torch.Tensor, B_slots: torch.Tensor, table: RowsTable, out: torch.Tensor | None = None) -> torch.Tensor:
    delta = h.new_zeros(h.shape[0], B_slots.shape[1])
    for slot, rows in table.slot_rows:
        r = table.host_slot_ranks[slot]
        delta[rows] = F.linear(h[rows, :r], B_slots[slot, :, :r]) * table.host_slot_scalings[slot]
    if out is None:
        return delta
    return out.add_(delta.to(out.dtype))


def reference_rows_lora(x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: RowsTable,
                        out: torch.Tensor) -> torch.Tensor:
    """shrink then expand per slot, added into `out` in place: a slot's contiguous rows as views (one adapter's
    rows are one slice: two matmuls and an add, no zero-fill, gather or scatter), scattered rows by index."""
    for slot, rows in table.slot_rows:
        r, scaling = table.host_slot_ranks[slot], table.host_slot_scalings[slot]
        delta = F.linear(F.linear(x[rows], A_slots[slot, :r]), B_slots[slot, :, :r]).mul_(scaling).to(out.dtype)
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)
    return out
