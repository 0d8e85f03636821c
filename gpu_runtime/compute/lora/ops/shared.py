"""One shrink for layers that read the same input (q, k and v; gate and up), then an expand per layer: torch path.

`shared_shrink(x, [A_q, A_k, A_v], table)` multiplies each segment group's rows once by its slots' A's concatenated
along the rank axis (per slot `[r + r + r, in]`) and splits h into one `[T, max_rank]` per layer; `segmented_expand`
is each layer's `scaling × h @ B[slot]ᵀ`. Together they equal `segmented_lora` per layer (the same dot products; x's
gradient is one matmul against the concatenated A's rather than a sum of three), with autograd of their own: the
expand's backward gives h's gradient and adds B's; the shrink's gives x's and adds every layer's A's. No dropout here:
each layer draws its own mask (compute/lora/layer.py), so a pass with dropout keeps one `segmented_lora` per layer.
The Triton path keeps a launch per layer (ops/__init__.py): the shrink kernel reads one buffer's slot rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gpu_runtime.compute.lora.ops.reference import _index, _put_rows, _rows, _scalings, _slots, reference_expand
from gpu_runtime.compute.lora.ops.tables import LoraTable

GradInto = torch.Tensor | None  # a persistent fp32 gradient buffer of the slot buffer's shape, or None: returned


def _concatenated(buffers: Sequence[torch.Tensor], group: Any, table: LoraTable) -> torch.Tensor:
    """The group's slots of each A buffer, first `rank` rows, concatenated along the rank: [segments, P × rank, in]."""
    r = group.rank
    return torch.cat([_slots(A, group, table)[:, :r] for A in buffers], dim=1)


class SharedShrink(torch.autograd.Function):
    """`apply(x, table, grads_into, *A_slots)` → one h [T, max_rank] per A buffer; grads_into: a tuple of a buffer or
    None per A (None: that A's gradient is returned as a whole-buffer tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, table: LoraTable, grads_into: tuple[GradInto, ...],
                *A_slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hs = [x.new_zeros(x.shape[0], table.max_rank) for _ in A_slots]
        concatenated = [_concatenated(A_slots, group, table) for group in table.groups]  # kept for the backward
        for group, A in zip(table.groups, concatenated):
            r = group.rank
            h = torch.bmm(_rows(x, group, table), A.transpose(1, 2))
            for p, h_p in enumerate(hs):
                _put_rows(h_p[:, :r], group, h[..., p * r : (p + 1) * r], table)
        ctx.save_for_backward(x, *A_slots, *concatenated)
        ctx.table, ctx.grads_into = table, grads_into
        return tuple(hs)

    @staticmethod
    def backward(ctx: Any, *grad_hs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        table: LoraTable = ctx.table
        x, *saved = ctx.saved_tensors
        A_slots, concatenated = saved[: len(saved) - len(table.groups)], saved[len(saved) - len(table.groups) :]
        grads_into: tuple[GradInto, ...] = ctx.grads_into
        grad_x = torch.zeros_like(x)
        grad_A = [g if g is not None else torch.zeros_like(A) for g, A in zip(grads_into, A_slots)]
        for group, A in zip(table.groups, concatenated):
            r = group.rank
            grad_h = torch.cat([_rows(g.to(x.dtype)[:, :r], group, table) for g in grad_hs], dim=2)  # [segs, rows, P×r]
            _put_rows(grad_x, group, torch.bmm(grad_h, A), table)
            outer = torch.bmm(grad_h.transpose(1, 2), _rows(x, group, table))  # [segs, P×r, in]
            slots = _index(group, table, x.device, "slots")
            for p, into in enumerate(grad_A):  # index_add_: a run twice in the pass sums its segments, in order
                into[:, :r].index_add_(0, slots, outer[:, p * r : (p + 1) * r].to(into.dtype))
        returned = tuple(None if into is not None else g for into, g in zip(grads_into, grad_A))
        return (grad_x if ctx.needs_input_grad[0] else None, None, None, *returned)


class SegmentedExpand(torch.autograd.Function):
    """`apply(h, B_slots, table, grad_into)` → delta [T, out] = scaling × h[:, :r] @ B[slot, :, :r]ᵀ per segment."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, B_slots: torch.Tensor, table: LoraTable, grad_into: GradInto) -> torch.Tensor:
        ctx.save_for_backward(h, B_slots)
        ctx.table, ctx.grad_into = table, grad_into
        return reference_expand(h, B_slots, table)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, B_slots = ctx.saved_tensors
        table: LoraTable = ctx.table
        grad = grad.contiguous().to(h.dtype)
        grad_h = torch.zeros_like(h)
        grad_B = ctx.grad_into if ctx.grad_into is not None else torch.zeros_like(B_slots)
        for group in table.groups:
            r, scalings = group.rank, _scalings(group, grad, table)
            rows_grad = _rows(grad, group, table)  # [segments, rows, out]
            _put_rows(grad_h[:, :r], group, torch.bmm(rows_grad, _slots(B_slots, group, table)[:, :, :r]) * scalings,
                      table)
            grad_B[:, :, :r].index_add_(0, _index(group, table, grad_B.device, "slots"),
                                        (torch.bmm(rows_grad.transpose(1, 2), _rows(h[:, :r], group, table))
                                         * scalings).to(grad_B.dtype))
        return grad_h, None if ctx.grad_into is not None else grad_B, None, None


def shared_shrink(x: torch.Tensor, A_slots: Sequence[torch.Tensor], table: LoraTable,
                  grads_into: Sequence[GradInto] | None = None) -> tuple[torch.Tensor, ...]:
    """One h [T, max_rank] per A buffer (same shapes, x's dtype), from one matmul per segment group."""
    if len({tuple(A.shape) for A in A_slots}) != 1 or any(A.dtype != x.dtype for A in A_slots):
        raise ValueError("shared_shrink takes A buffers of one shape, in x's dtype")
    into = tuple(grads_into) if grads_into is not None else (None,) * len(A_slots)
    # torch leaves Function.apply untyped
    hs: tuple[torch.Tensor, ...] = SharedShrink.apply(x, table, into, *A_slots)  # type: ignore[no-untyped-call]
    return hs


def segmented_expand(h: torch.Tensor, B_slots: torch.Tensor, table: LoraTable, grad_into: GradInto = None) -> torch.Tensor:
    """One layer's delta [T, out] from its h (shared_shrink's), with autograd; B's gradient added into `grad_into`."""
    # torch leaves Function.apply untyped
    delta: torch.Tensor = SegmentedExpand.apply(h, B_slots, table, grad_into)  # type: ignore[no-untyped-call]
    return delta
