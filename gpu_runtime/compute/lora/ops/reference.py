"""The torch reference of every kernel: its specification, and the CPU and fp32 path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.compute.lora.ops.tables import LoraTable, RowsTable

# ---------------------------------------------------------------------------------------------------------------------
# Torch references: the spec of each kernel, and the path off CUDA. They read the table's host copy only.


def reference_shrink(x: torch.Tensor, A_slots: torch.Tensor, table: LoraTable,
                     dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    xm = x if dropout_mask is None else x * dropout_mask
    h = x.new_zeros(x.shape[0], table.max_rank)
    for seg in table.segments:
        h[seg.row_start : seg.row_end, : seg.rank] = F.linear(xm[seg.row_start : seg.row_end], A_slots[seg.slot, : seg.rank])
    return h


def reference_expand(h: torch.Tensor, B_slots: torch.Tensor, table: LoraTable, out: torch.Tensor | None = None) -> torch.Tensor:
    delta = h.new_zeros(h.shape[0], B_slots.shape[1])
    for seg in table.segments:
        rows = slice(seg.row_start, seg.row_end)
        delta[rows] = F.linear(h[rows, : seg.rank], B_slots[seg.slot, :, : seg.rank]) * seg.scaling
    if out is None:
        return delta
    return out.add_(delta.to(out.dtype))


# One F.linear per segment, not a bmm per group of equal segments: a segment's bits are then its own whatever shares
# its pass, and the same as every journal written before (replay is bitwise; a bmm rounds otherwise).


def reference_segmented_lora(x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: LoraTable,
                             dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The delta [T, out] through autograd: the spec that SegmentedLora's gradients are checked against."""
    return reference_expand(reference_shrink(x, A_slots, table, dropout_mask), B_slots, table)


def reference_backward(grad: torch.Tensor, x: torch.Tensor, h: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor,
                       table: LoraTable, dropout_mask: torch.Tensor | None,
                       grad_into: tuple[torch.Tensor, torch.Tensor] | None = None, b_table: LoraTable | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_x, grad_A_slots, grad_B_slots of the delta, written segment by segment (a slot seen twice sums). With
    `grad_into` the weight gradients are added into those buffers (in their dtype) and returned. `b_table`: B's slot
    of each segment where it is not A's (the expert layout, ops/__init__.py)."""
    xm = x if dropout_mask is None else x * dropout_mask
    grad_x = torch.zeros_like(x)
    grad_A, grad_B = grad_into if grad_into is not None else (torch.zeros_like(A_slots), torch.zeros_like(B_slots))
    for seg, b_slot in zip(table.segments, [s.slot for s in (b_table or table).segments]):
        rows, r = slice(seg.row_start, seg.row_end), seg.rank
        grad_h = grad[rows] @ B_slots[b_slot, :, :r] * seg.scaling  # [rows, r]
        grad_x[rows] = grad_h @ A_slots[seg.slot, :r]
        grad_A[seg.slot, :r] += (grad_h.t() @ xm[rows]).to(grad_A.dtype)
        grad_B[b_slot, :, :r] += (grad[rows].t() @ h[rows, :r] * seg.scaling).to(grad_B.dtype)
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
