"""Multi-LoRA kernels over per-base slot buffers: each co-batched run's `B(A(dropout(x))) * scaling`, without stacking.

Every run's matrices live in slot buffers shared by training and decoding, and a pass carries one small table read
by every layer (DESIGN.md, "On the GPU"). Prior art: punica's SGMV/BGMV and vLLM's `lora_shrink`/`lora_expand`
Triton ops; the kernels here are written for this layout, with a backward of their own.

Layout (the caller's contract; nothing here checks the zeros):
- `A_slots [slots, R, in]`, `B_slots [slots, out, R]`: slot s's rank r_s occupies `A[s, :r_s]` and `B[s, :, :r_s]`;
  the rest is zero. One dtype for x, A and B: fp32, bf16 or fp16.
- `LoraTable`: per segment `(row_start, row_end, slot, rank, scaling)` on the device (int32, scalings fp32), the
  distinct slots with their ranks (the weight-gradient kernels' grid), and host ints (max rank, segment count,
  pass rows, longest segment) that size every grid without reading the device. Built once a pass, one copy.
  Segments never overlap; rows in no segment are base-only (delta 0). A slot may appear in several segments (a
  run twice in one pass) with one rank; its weight gradients are summed.
- `x [T, in]` is 2-D: a caller with `[rows, tokens, in]` flattens it and multiplies its row ranges by tokens.
- A dropout mask is `[T, in]` in x's dtype, already scaled by 1/(1-p) (1 on rows without dropout), drawn by the
  caller as today; the kernels multiply x by it and the backward multiplies by it again.

What each computes (the `reference_*` function beside each is its spec, and the CPU/fp32 path):
- `lora_shrink`: `h[t, :r] = (x[t] * mask[t]) @ A[slot(t), :r]ᵀ`, h `[T, max_rank]`, zero outside segments/ranks:
  the low-rank projection, once for every run's rows in one launch.
- `lora_expand`: `out[t] += scaling(t) * h[t, :r] @ B[slot(t), :, :r]ᵀ`, in place: the delta added to the base output.
- `SegmentedLora` / `segmented_lora`: the delta `[T, out]` with autograd; its backward is a shrink with Bᵀ (grad_h),
  an expand with Aᵀ (grad_x) and two segmented row reductions (grad_A, grad_B) written into one buffer of each slot
  buffer's shape, so each run's `.grad` can be a view of its slot; with `grad_into` they are added into persistent
  (fp32) buffers instead, only the pass's slots touched (the layer's path: compute/lora/slots.py).
- `lora_shrink_rows` / `lora_expand_rows` / `rows_lora` (BGMV, decoding): one adapter per row given by a per-row slot
  index, -1 for base-only rows, ranks and scalings per slot: the table a decode step changes is one int per row.
- `grouped_expert_lora`: mixture-of-experts layers over the expert slot buffers `A [slots, E·R, in]` and
  `Bt [slots, R·E, out]`, each slot holding its run's matrices in PEFT's own layout (A's rows e·r…e·r+r are expert e's,
  Bᵀ's rows j·E+e its rank j) so the run's parameters are views of it (compute/lora/experts.py). Expert e of the run
  in slot s is then a strided [r, in] / [out, r] window at a row offset, so the kernels read the buffers through
  overlapping `as_strided` views indexed by that offset: s·E·R + e·r in A, s·E·R + e in B (`build_expert_tables`:
  one table per side, same segments). A window past its rank reads the next expert's rows, not zeros: every kernel
  reads a segment's first `rank` only. The same kernels, forward and backward, with no code of their own.

Which path (`choose`): Triton on CUDA; elsewhere the segmented calls take the grouped torch kernel (ops/grouped.py: a
bmm per group of equal segments) and the per-row ones the reference; `SIGNAL_LORA_KERNELS=triton|torch|grouped`
forces one. A forward_backward's journal record names the segmented kernel its passes ran (`pass_kernel`), and replay
runs that one: the kernels round differently, and replay is bitwise. A record naming none was written when the
per-segment reference was the torch path (`LEGACY`).
Triton is imported, and the kernels jit-wrapped, on the first kernel call, so this module imports and runs its
torch paths with no triton installed. `TRITON_INTERPRET=1` (triton's interpreter, how the CPU tests run the kernels)
must be in the environment before anything in the process imports triton: triton wraps its own library functions
(`tl.zeros`, `tl.sum`) when it is imported, and torch, transformers and peft import it early, so setting the variable
later fails inside a kernel ("Cannot call @triton.jit'd outside of the scope of a kernel"). The tests therefore run
the kernels in a spawned process started with the variable set. The interpreter computes bf16 arithmetic wrongly (triton 3.9: `tl.dot`
and `*` on bf16 operands), so there the kernels upcast their dot operands to fp32 (exact: a product of two bf16
values fits fp32) and multiply masks in fp32 always (rounding back as a bf16 multiply would); every kernel
accumulates in fp32 and rounds once when it stores.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

from gpu_runtime.compute.lora.ops.grouped import grouped_backward, grouped_expand, grouped_shrink
from gpu_runtime.compute.lora.ops.reference import (
    reference_backward,
    reference_expand,
    reference_expand_rows,
    reference_rows_lora,
    reference_segmented_lora,
    reference_shrink,
    reference_shrink_rows,
)
from gpu_runtime.compute.lora.ops.tables import (
    IMPLS,
    KERNEL_DTYPES,
    ExpertTables,
    Impl,
    LoraTable,
    RowsTable,
    TableSegment,
    build_expert_tables,
    build_rows_table,
    build_table,
)
from gpu_runtime.compute.lora.ops.triton_kernels import (
    LAUNCH,
    _block,
    _cdiv,
    _check,
    _expand_launch,
    _kernels,
    _outer_launch,
    _shrink_launch,
)

__all__ = [
    "IMPLS", "KERNEL_DTYPES", "LAUNCH", "LEGACY", "ExpertTables", "Impl", "LoraTable", "RowsTable", "SegmentedLora", "TableSegment",
    "build_expert_tables", "build_rows_table", "build_table", "choose", "expert_views", "grouped_expert_lora", "lora_expand", "lora_expand_rows",
    "lora_shrink", "lora_shrink_rows", "pass_kernel", "reference_backward", "reference_expand", "reference_expand_rows",
    "reference_rows_lora", "reference_segmented_lora", "reference_shrink", "reference_shrink_rows", "rows_lora", "segmented_lora",
    "triton_installed",
]

# ---------------------------------------------------------------------------------------------------------------------
# Choosing a path


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose(device: torch.device | str, dtype: torch.dtype) -> Impl:
    """Triton on CUDA for the kernels' dtypes, the grouped torch kernel elsewhere; SIGNAL_LORA_KERNELS forces one."""
    forced = os.environ.get("SIGNAL_LORA_KERNELS", "").lower()
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"SIGNAL_LORA_KERNELS={forced!r}: expected one of {', '.join(map(repr, IMPLS))}")
        return forced
    if torch.device(device).type == "cuda" and dtype in KERNEL_DTYPES and triton_installed():
        return "triton"
    return "grouped"


LEGACY = "legacy"  # what a pass is told to run for a journal record naming no kernel: what ran when it was written


def pass_kernel(device: torch.device | str, named: str | None = None) -> Impl:
    """The segmented kernel a pass runs: `named` (a journal record's, replayed), else today's choice. LEGACY: Triton
    where it would run today (it ran then too), the per-segment reference elsewhere. The kernels serve fp32, bf16 and
    fp16 alike, so the device decides; the dtype is the layer's, within those."""
    if named is None:
        return choose(device, torch.float32)
    if named == LEGACY:
        return "triton" if choose(device, torch.float32) == "triton" else "torch"
    if named not in IMPLS:
        raise ValueError(f"a journal record names the LoRA kernel {named!r}; this runtime has {', '.join(IMPLS)}")
    return named


# ---------------------------------------------------------------------------------------------------------------------
# Segmented (SGMV): shrink, expand, and the delta with its backward


def lora_shrink(x: torch.Tensor, A_slots: torch.Tensor, table: LoraTable, dropout_mask: torch.Tensor | None = None,
                impl: Impl | None = None) -> torch.Tensor:
    """h [T, table.max_rank]: each segment's rows times its slot's A (first `rank` rows), zero elsewhere. No autograd."""
    _check(x, A_slots, table)
    impl = impl or choose(x.device, x.dtype)
    if impl == "torch":
        return reference_shrink(x, A_slots, table, dropout_mask)
    if impl == "grouped":
        return grouped_shrink(x, A_slots, table, dropout_mask)
    mask = None if dropout_mask is None else dropout_mask.to(x.dtype)
    return _shrink_launch(x, A_slots, (A_slots.stride(0), A_slots.stride(1), A_slots.stride(2)), A_slots.shape[1], mask,
                          table, scale=False)


def lora_expand(h: torch.Tensor, B_slots: torch.Tensor, table: LoraTable, out: torch.Tensor | None = None,
                impl: Impl | None = None) -> torch.Tensor:
    """out + scaling × h @ B[slot]ᵀ per segment, added into `out` in place (returned), or a new delta when out is None.
    Rows in no segment are left as they are. No autograd."""
    _check(h, B_slots, table)
    if out is None:
        out = h.new_zeros(h.shape[0], B_slots.shape[1])
    impl = impl or choose(h.device, h.dtype)
    if impl == "torch":
        return reference_expand(h, B_slots, table, out)
    if impl == "grouped":
        return grouped_expand(h, B_slots, table, out)
    return _expand_launch(h, B_slots, (B_slots.stride(0), B_slots.stride(1), B_slots.stride(2)), B_slots.shape[1], out,
                          table, scale=True)


class SegmentedLora(torch.autograd.Function):
    """delta = segmented `B(A(x × mask)) × scaling` [T, out]; gradients for x, A_slots and B_slots.

    `apply(x, A_slots, B_slots, table, dropout_mask_or_None, impl_or_None, grad_into_or_None, b_table_or_None)`;
    `b_table`: B's slot per segment where it differs from A's (the expert layout), else None. The weight gradients
    come back as one tensor of each slot buffer's shape (zero for slots not in the pass), in the slots' dtype: each
    run's `.grad` can be a view of its slot. With `grad_into` (persistent buffers of the slot buffers' shapes, fp32
    masters' gradients under bf16 compute) they are added there instead, only the pass's slots' rows touched, and
    autograd gets None for A and B: no whole-buffer gradient per layer and pass. h is kept from the forward
    (x.dtype, [T, max_rank]): cheaper than recomputing it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: LoraTable,
                dropout_mask: torch.Tensor | None = None, impl: Impl | None = None,
                grad_into: tuple[torch.Tensor, torch.Tensor] | None = None, b_table: LoraTable | None = None) -> torch.Tensor:
        impl = impl or choose(x.device, x.dtype)
        mask = None if dropout_mask is None else dropout_mask.to(x.dtype)
        h = lora_shrink(x, A_slots, table, mask, impl)
        delta = lora_expand(h, B_slots, b_table or table, None, impl)
        ctx.save_for_backward(x, A_slots, B_slots, h, mask)
        ctx.table, ctx.impl, ctx.grad_into, ctx.b_table = table, impl, grad_into, b_table
        return delta

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, A_slots, B_slots, h, mask = ctx.saved_tensors
        table: LoraTable = ctx.table
        grad_into = ctx.grad_into
        grad = grad.contiguous().to(x.dtype)
        grad_x: torch.Tensor | None
        grad_A: torch.Tensor | None
        grad_B: torch.Tensor | None
        needs = ctx.needs_input_grad
        b_table: LoraTable | None = ctx.b_table
        if ctx.impl == "torch":
            grad_x, grad_A, grad_B = reference_backward(grad, x, h, A_slots, B_slots, table, mask, grad_into, b_table)
        elif ctx.impl == "grouped":
            grad_x, grad_A, grad_B = grouped_backward(grad, x, h, A_slots, B_slots, table, mask, grad_into, b_table)
        else:
            grad_x, grad_A, grad_B = _triton_backward(grad, x, h, A_slots, B_slots, table, mask, needs, grad_into,
                                                      b_table or table)
        if grad_into is not None:  # already added where they belong
            grad_A = grad_B = None
        return (grad_x if needs[0] else None, grad_A if needs[1] else None, grad_B if needs[2] else None, None, None, None,
                None, None)


def _triton_backward(grad: torch.Tensor, x: torch.Tensor, h: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor,
                     table: LoraTable, mask: torch.Tensor | None, needs: tuple[bool, ...],
                     grad_into: tuple[torch.Tensor, torch.Tensor] | None = None, b_table: LoraTable | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    b_table = b_table or table
    grad_x = grad_A = grad_B = None
    accumulate = grad_into is not None
    if needs[0] or needs[1]:  # grad_h = scaling × grad @ B[slot][:, :r]: a shrink with Bᵀ as its weight
        grad_h = _shrink_launch(grad, B_slots, (B_slots.stride(0), B_slots.stride(2), B_slots.stride(1)), B_slots.shape[2],
                                None, b_table, scale=True)
        if needs[0]:  # grad_x = (grad_h @ A[slot][:r]) × mask: an expand with Aᵀ as its weight
            grad_x = _expand_launch(grad_h, A_slots, (A_slots.stride(0), A_slots.stride(2), A_slots.stride(1)), A_slots.shape[2],
                                    torch.zeros_like(x), table, scale=False)
            if mask is not None:
                grad_x = grad_x * mask
        if needs[1]:  # grad_A[slot][:r] = Σ grad_hᵀ (x × mask)
            grad_A = grad_into[0] if grad_into is not None else torch.zeros_like(A_slots)
            _outer_launch(grad_h, x, mask, grad_A, (grad_A.stride(0), grad_A.stride(1), grad_A.stride(2)),
                          table.max_rank, x.shape[1], table, rank_on_m=True, scale=False, accumulate=accumulate)
    if needs[2]:  # grad_B[slot][:, :r] = Σ scaling × gradᵀ h
        grad_B = grad_into[1] if grad_into is not None else torch.zeros_like(B_slots)
        _outer_launch(grad, h, None, grad_B, (grad_B.stride(0), grad_B.stride(1), grad_B.stride(2)),
                      grad.shape[1], table.max_rank, b_table, rank_on_m=False, scale=True, accumulate=accumulate)
    return grad_x, grad_A, grad_B


def segmented_lora(x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: LoraTable,
                   dropout_mask: torch.Tensor | None = None, impl: Impl | None = None,
                   grad_into: tuple[torch.Tensor, torch.Tensor] | None = None, b_table: LoraTable | None = None
                   ) -> torch.Tensor:
    """The co-batched LoRA delta [T, out] with autograd: Triton on CUDA, the torch reference elsewhere (`choose`).
    `grad_into`: add the weight gradients into these buffers (see SegmentedLora) rather than return them."""
    _check(x, A_slots, table)
    if b_table is not None:
        _check(x, B_slots, b_table)
    if grad_into is not None and (grad_into[0].shape != A_slots.shape or grad_into[1].shape != B_slots.shape):
        raise ValueError("grad_into must be two buffers of the slot buffers' shapes")
    # torch leaves Function.apply untyped
    result: torch.Tensor = SegmentedLora.apply(x, A_slots, B_slots, table, dropout_mask, impl, grad_into, b_table)  # type: ignore[no-untyped-call]
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Per-row (BGMV), for decoding: no autograd


def _check_rows(x: torch.Tensor, weights: torch.Tensor, table: RowsTable) -> None:
    if x.dim() != 2 or x.shape[0] != table.total_rows:
        raise ValueError(f"x must be [{table.total_rows}, features] (one row per table entry), not {list(x.shape)}")
    if x.dtype != weights.dtype:
        raise ValueError(f"x is {x.dtype} and the slots {weights.dtype}: one dtype for both")
    if weights.shape[0] != len(table.host_slot_ranks):
        raise ValueError(f"the table has {len(table.host_slot_ranks)} slots, the buffer {weights.shape[0]}")


def lora_shrink_rows(x: torch.Tensor, A_slots: torch.Tensor, table: RowsTable, impl: Impl | None = None) -> torch.Tensor:
    """h [T, table.max_rank]: row t times A[slot(t), :rank]ᵀ, zero for base-only rows (slot -1)."""
    _check_rows(x, A_slots, table)
    if (impl or choose(x.device, x.dtype)) != "triton":  # one adapter per row: nothing to group
        return reference_shrink_rows(x, A_slots, table)
    h = x.new_zeros(x.shape[0], table.max_rank)
    if x.shape[0] == 0 or table.max_rank == 0:
        return h
    K = x.shape[1]
    block_r, block_k = _block(table.max_rank, 16, 64), _block(K, 32, 128)
    _kernels().shrink_rows[(x.shape[0], _cdiv(table.max_rank, block_r))](
        x, A_slots, h, table.row_slots, table.slot_ranks, K, x.stride(0), x.stride(1),
        A_slots.stride(0), A_slots.stride(1), A_slots.stride(2), h.stride(0), h.stride(1), BLOCK_R=block_r, BLOCK_K=block_k, **LAUNCH)
    return h


def lora_expand_rows(h: torch.Tensor, B_slots: torch.Tensor, table: RowsTable, out: torch.Tensor | None = None,
                     impl: Impl | None = None) -> torch.Tensor:
    """out + scaling(slot) × h[t, :rank] @ B[slot(t), :, :rank]ᵀ, in place when `out` is given; base-only rows untouched."""
    _check_rows(h, B_slots, table)
    if out is None:
        out = h.new_zeros(h.shape[0], B_slots.shape[1])
    if (impl or choose(h.device, h.dtype)) != "triton":
        return reference_expand_rows(h, B_slots, table, out)
    if h.shape[0] == 0 or table.max_rank == 0:
        return out
    N = B_slots.shape[1]
    block_n, block_r = _block(N, 32, 128), _block(table.max_rank, 16, 32)
    _kernels().expand_rows[(h.shape[0], _cdiv(N, block_n))](
        h, B_slots, out, table.row_slots, table.slot_ranks, table.slot_scalings, N, h.stride(0), h.stride(1),
        B_slots.stride(0), B_slots.stride(1), B_slots.stride(2), out.stride(0), out.stride(1), BLOCK_N=block_n, BLOCK_R=block_r, **LAUNCH)
    return out


def rows_lora(x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: RowsTable, out: torch.Tensor | None = None,
              impl: Impl | None = None) -> torch.Tensor:
    """A decode step's LoRA: `out` (the base output, updated in place) plus each row's own adapter delta."""
    impl = impl or choose(x.device, x.dtype)
    if impl != "triton" and out is not None:
        _check_rows(x, A_slots, table)
        return reference_rows_lora(x, A_slots, B_slots, table, out)
    return lora_expand_rows(lora_shrink_rows(x, A_slots, table, impl), B_slots, table, out, impl)


# ---------------------------------------------------------------------------------------------------------------------
# Grouped (expert, run), for mixture-of-experts layers


def expert_views(A: torch.Tensor, Bt: torch.Tensor, rank: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' [index, R, in] and [index, out, R] views of expert slot buffers A [slots, E·R, in] and
    Bt [slots, R·E, out] (contiguous): index s·E·R + e·r reads expert e of a rank-r run in slot s from A, index
    s·E·R + e from B (rank j at Bᵀ row j·E + e). Overlapping windows: each (slot, expert) reads only its own."""
    if A.dim() != 3 or Bt.dim() != 3 or A.shape[:2] != Bt.shape[:2] or A.shape[1] != rank * experts:
        raise ValueError(f"expert slot buffers are [slots, {experts}·{rank}, in] and [slots, {rank}·{experts}, out]")
    if not (A.is_contiguous() and Bt.is_contiguous()):
        raise ValueError("expert slot buffers must be contiguous")
    rows = A.shape[0] * A.shape[1]
    A_view = A.as_strided((rows - rank + 1, rank, A.shape[2]), (A.shape[2], A.shape[2], 1))
    out = Bt.shape[2]
    B_view = Bt.as_strided((rows - (rank - 1) * experts, out, rank), (out, 1, experts * out))
    return A_view, B_view


def grouped_expert_lora(x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor, tables: ExpertTables,
                        dropout_mask: torch.Tensor | None = None, impl: Impl | None = None,
                        grad_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The delta [T, out] for rows sorted into (expert, slot) segments (`build_expert_tables`), read from the expert
    slot buffers A [slots, E·R, in] and Bt [slots, R·E, out] in place (`expert_views`): nothing gathered per run.
    The weight gradients are added into `grad_into` (buffers of A's and Bt's shapes); without it A and Bt get none."""
    A_view, B_view = expert_views(A, Bt, tables.rank, tables.experts)
    into = None if grad_into is None else expert_views(*grad_into, tables.rank, tables.experts)
    # leaves, so the backward runs and adds into `into`: the buffers themselves never take a gradient
    grad = into is not None and torch.is_grad_enabled()
    A_view, B_view = A_view.detach().requires_grad_(grad), B_view.detach().requires_grad_(grad)
    return segmented_lora(x, A_view, B_view, tables.a, dropout_mask, impl, into, tables.b)
