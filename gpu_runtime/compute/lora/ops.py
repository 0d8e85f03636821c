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
- `grouped_expert_lora`: mixture-of-experts layers, slot buffers `[slots, experts, R, in]` / `[slots, experts, out, R]`
  flattened to `[slots × experts, …]`, each segment's "slot" being `slot × experts + expert` (`build_expert_table`):
  the same kernels, forward and backward, with no code of their own.

Which path (`choose`): Triton on CUDA, the torch reference elsewhere; `SIGNAL_LORA_KERNELS=triton|torch` forces one.
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    import triton.language as tl  # at run time bound by _kernels(), on the first kernel call

Impl = Literal["triton", "torch"]
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------------------------------
# Tables


class TableSegment(NamedTuple):
    """Rows [row_start, row_end) of the pass take slot `slot`'s first `rank` rows of A (columns of B), times scaling."""

    row_start: int
    row_end: int
    slot: int
    rank: int
    scaling: float


@dataclass(frozen=True)
class LoraTable:
    """A pass's segments on the device (read by kernels) and on the host (grid sizes and the torch path)."""

    seg_starts: torch.Tensor  # int32 [S]
    seg_ends: torch.Tensor  # int32 [S]
    seg_slots: torch.Tensor  # int32 [S]
    seg_ranks: torch.Tensor  # int32 [S]
    seg_scalings: torch.Tensor  # fp32 [S]
    slot_ids: torch.Tensor  # int32 [U]: the distinct slots, the weight-gradient kernels' grid
    slot_ranks: torch.Tensor  # int32 [U]
    max_rank: int  # h's width: the largest rank in this pass
    num_segments: int
    total_rows: int  # T: the pass's rows, base-only ones included
    max_segment_rows: int  # the longest segment: the row-block grid
    segments: tuple[TableSegment, ...]  # host copy: the torch path never reads the device

    @property
    def num_slots(self) -> int:
        return len(self.slot_ids)


def _validate(segments: Sequence[TableSegment], total_rows: int) -> None:
    ranks: dict[int, int] = {}
    for seg in segments:
        if not 0 <= seg.row_start < seg.row_end <= total_rows:
            raise ValueError(f"segment rows [{seg.row_start}, {seg.row_end}) not inside the pass's {total_rows} rows")
        if seg.rank < 1 or seg.slot < 0:
            raise ValueError(f"segment {seg}: rank must be at least 1 and slot non-negative")
        if ranks.setdefault(seg.slot, seg.rank) != seg.rank:
            raise ValueError(f"slot {seg.slot} appears with ranks {ranks[seg.slot]} and {seg.rank}")
    ordered = sorted(segments, key=lambda s: s.row_start)
    for a, b in zip(ordered, ordered[1:]):
        if b.row_start < a.row_end:
            raise ValueError(f"segments {a} and {b} overlap")


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host-to-device copy: pinned and non-blocking on CUDA (the caching host allocator keeps the pinned block
    alive until the copy is done), a plain reference elsewhere."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def build_table(segments: Iterable[tuple[int, int, int, int, float]], device: torch.device | str,
                total_rows: int | None = None) -> LoraTable:
    """The pass's table from (row_start, row_end, slot, rank, scaling) tuples; total_rows defaults to the last end.
    Everything goes to the device in one int32 buffer (scalings bit-cast), sliced into views there."""
    segs = tuple(TableSegment(*s) for s in segments)
    rows = total_rows if total_rows is not None else max((s.row_end for s in segs), default=0)
    _validate(segs, rows)
    slot_rank = dict.fromkeys(s.slot for s in segs)
    for s in segs:
        slot_rank[s.slot] = s.rank
    n, u = len(segs), len(slot_rank)
    host = torch.tensor([s.row_start for s in segs] + [s.row_end for s in segs] + [s.slot for s in segs]
                        + [s.rank for s in segs] + [0] * n + list(slot_rank) + list(slot_rank.values()), dtype=torch.int32)
    host[4 * n : 5 * n] = torch.tensor([s.scaling for s in segs], dtype=torch.float32).view(torch.int32)
    packed = _to_device(host, torch.device(device))
    return LoraTable(
        seg_starts=packed[0:n], seg_ends=packed[n : 2 * n], seg_slots=packed[2 * n : 3 * n], seg_ranks=packed[3 * n : 4 * n],
        seg_scalings=packed[4 * n : 5 * n].view(torch.float32), slot_ids=packed[5 * n : 5 * n + u],
        slot_ranks=packed[5 * n + u :], max_rank=max((s.rank for s in segs), default=0), num_segments=n, total_rows=rows,
        max_segment_rows=max((s.row_end - s.row_start for s in segs), default=0), segments=segs)


def build_expert_table(segments: Iterable[tuple[int, int, int, int, int, float]], num_experts: int,
                       device: torch.device | str, total_rows: int | None = None) -> LoraTable:
    """A grouped (expert, run) table from (row_start, row_end, slot, expert, rank, scaling): rows already sorted
    into one segment per (expert, slot), each segment's slot becoming `slot × num_experts + expert` on the flattened
    `[slots × experts, …]` buffers."""
    flat = []
    for start, end, slot, expert, rank, scaling in segments:
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} outside 0..{num_experts - 1}")
        flat.append((start, end, slot * num_experts + expert, rank, scaling))
    return build_table(flat, device, total_rows)


@dataclass(frozen=True)
class RowsTable:
    """A decode step's table (BGMV): one slot per row (-1: base only), ranks and scalings per slot."""

    row_slots: torch.Tensor  # int32 [T]
    slot_ranks: torch.Tensor  # int32 [slots]
    slot_scalings: torch.Tensor  # fp32 [slots]
    max_rank: int
    host_row_slots: tuple[int, ...]
    host_slot_ranks: tuple[int, ...]
    host_slot_scalings: tuple[float, ...]

    @property
    def total_rows(self) -> int:
        return len(self.host_row_slots)


def build_rows_table(row_slots: Sequence[int], slot_ranks: Sequence[int], slot_scalings: Sequence[float],
                     device: torch.device | str) -> RowsTable:
    """The per-row table, in one host-to-device copy like build_table's."""
    if len(slot_ranks) != len(slot_scalings):
        raise ValueError("one rank and one scaling per slot")
    if any(not -1 <= s < len(slot_ranks) for s in row_slots):
        raise ValueError(f"row slots must be -1 or below {len(slot_ranks)}")
    t, n = len(row_slots), len(slot_ranks)
    host = torch.tensor(list(row_slots) + list(slot_ranks) + [0] * n, dtype=torch.int32)
    host[t + n :] = torch.tensor(list(slot_scalings), dtype=torch.float32).view(torch.int32)
    packed = _to_device(host, torch.device(device))
    return RowsTable(row_slots=packed[:t], slot_ranks=packed[t : t + n], slot_scalings=packed[t + n :].view(torch.float32),
                     max_rank=max(slot_ranks, default=0), host_row_slots=tuple(row_slots),
                     host_slot_ranks=tuple(slot_ranks), host_slot_scalings=tuple(float(s) for s in slot_scalings))


# ---------------------------------------------------------------------------------------------------------------------
# Choosing a path


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose(device: torch.device | str, dtype: torch.dtype) -> Impl:
    """Triton on CUDA for the kernels' dtypes, the torch reference elsewhere; SIGNAL_LORA_KERNELS forces either."""
    forced = os.environ.get("SIGNAL_LORA_KERNELS", "").lower()
    if forced in ("triton", "torch"):
        return "triton" if forced == "triton" else "torch"
    if forced:
        raise ValueError(f"SIGNAL_LORA_KERNELS={forced!r}: expected 'triton' or 'torch'")
    if torch.device(device).type == "cuda" and dtype in KERNEL_DTYPES and triton_installed():
        return "triton"
    return "torch"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


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
    for seg in table.segments:
        rows, r = slice(seg.row_start, seg.row_end), seg.rank
        grad_h = grad[rows] @ B_slots[seg.slot, :, :r] * seg.scaling  # [rows, r]
        grad_x[rows] = grad_h @ A_slots[seg.slot, :r]
        grad_A[seg.slot, :r] += (grad_h.t() @ xm[rows]).to(grad_A.dtype)
        grad_B[seg.slot, :, :r] += (grad[rows].t() @ h[rows, :r] * seg.scaling).to(grad_B.dtype)
    if dropout_mask is not None:
        grad_x = grad_x * dropout_mask
    return grad_x, grad_A, grad_B


def reference_shrink_rows(x: torch.Tensor, A_slots: torch.Tensor, table: RowsTable) -> torch.Tensor:
    h = x.new_zeros(x.shape[0], table.max_rank)
    for slot, rows in _rows_by_slot(table, x.device).items():
        r = table.host_slot_ranks[slot]
        h[rows, :r] = F.linear(x[rows], A_slots[slot, :r])
    return h


def reference_expand_rows(h: torch.Tensor, B_slots: torch.Tensor, table: RowsTable, out: torch.Tensor | None = None) -> torch.Tensor:
    delta = h.new_zeros(h.shape[0], B_slots.shape[1])
    for slot, rows in _rows_by_slot(table, h.device).items():
        r = table.host_slot_ranks[slot]
        delta[rows] = F.linear(h[rows, :r], B_slots[slot, :, :r]) * table.host_slot_scalings[slot]
    if out is None:
        return delta
    return out.add_(delta.to(out.dtype))


def _rows_by_slot(table: RowsTable, device: torch.device) -> dict[int, torch.Tensor]:
    """Each slot's rows, as an index built on the host (no device read)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(table.host_row_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    return {slot: torch.tensor(rows, device=device) for slot, rows in by_slot.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels. Plain functions here, jit-wrapped by _kernels() on first use (see the module docstring); `tl` is
# this module's global from then on. Parameters typed tl.tensor are pointers or runtime ints (compiled triton
# resolves annotations as globals, so typing.Any would not do).


def _sgmv_shrink_kernel(
    x_ptr: tl.tensor, w_ptr: tl.tensor, mask_ptr: tl.tensor, h_ptr: tl.tensor,
    starts_ptr: tl.tensor, ends_ptr: tl.tensor, slots_ptr: tl.tensor, ranks_ptr: tl.tensor, scalings_ptr: tl.tensor,
    K: tl.tensor,
    sx_t: tl.tensor, sx_k: tl.tensor, sw_s: tl.tensor, sw_r: tl.tensor, sw_k: tl.tensor,
    sm_t: tl.tensor, sm_k: tl.tensor, sh_t: tl.tensor, sh_r: tl.tensor,
    HAS_MASK: tl.constexpr, SCALE: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
) -> None:
    """h[t, j] = (scaling ×) Σ_k x[t, k] (× mask[t, k]) W[slot, j, k] for j < rank: one (row block, segment, rank
    block) tile. W is A (forward) or Bᵀ by strides (the backward's grad_h)."""
    pid_t, seg, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, rank = tl.load(starts_ptr + seg), tl.load(ends_ptr + seg), tl.load(ranks_ptr + seg)
    if start + pid_t * BLOCK_T >= end:  # a shorter segment than the longest: nothing here
        return
    if pid_r * BLOCK_R >= rank:
        return
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = (start + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok, col_ok = rows < end, cols < rank
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xb = tl.load(x_ptr + rows[:, None] * sx_t + ks[None, :] * sx_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_MASK:
            keep = tl.load(mask_ptr + rows[:, None] * sm_t + ks[None, :] * sm_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            xb = (xb.to(tl.float32) * keep.to(tl.float32)).to(xb.dtype)  # as a bf16 multiply rounds; see _dot_f32
        wb = tl.load(w_ptr + slot * sw_s + ks[:, None] * sw_k + cols[None, :] * sw_r, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(xb.to(tl.float32), wb.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xb, wb)
    if SCALE:
        acc = acc * tl.load(scalings_ptr + seg)
    tl.store(h_ptr + rows[:, None] * sh_t + cols[None, :] * sh_r, acc.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _sgmv_expand_kernel(
    h_ptr: tl.tensor, w_ptr: tl.tensor, out_ptr: tl.tensor,
    starts_ptr: tl.tensor, ends_ptr: tl.tensor, slots_ptr: tl.tensor, ranks_ptr: tl.tensor, scalings_ptr: tl.tensor,
    N: tl.tensor,
    sh_t: tl.tensor, sh_r: tl.tensor, sw_s: tl.tensor, sw_n: tl.tensor, sw_r: tl.tensor, so_t: tl.tensor, so_n: tl.tensor,
    SCALE: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
) -> None:
    """out[t, n] += (scaling ×) Σ_{j<rank} h[t, j] W[slot, n, j]: one (row block, segment, output block) tile, the
    rank loop cut at this segment's rank. W is B (forward) or Aᵀ by strides (the backward's grad_x)."""
    pid_t, seg, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, rank = tl.load(starts_ptr + seg), tl.load(ends_ptr + seg), tl.load(ranks_ptr + seg)
    if start + pid_t * BLOCK_T >= end:
        return
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rows = (start + pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, n_ok = rows < end, ns < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        hb = tl.load(h_ptr + rows[:, None] * sh_t + rs[None, :] * sh_r, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        wb = tl.load(w_ptr + slot * sw_s + rs[:, None] * sw_r + ns[None, :] * sw_n, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(hb.to(tl.float32), wb.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(hb, wb)
    if SCALE:
        acc = acc * tl.load(scalings_ptr + seg)
    out_ptrs = out_ptr + rows[:, None] * so_t + ns[None, :] * so_n
    ok = row_ok[:, None] & n_ok[None, :]
    current = tl.load(out_ptrs, mask=ok, other=0.0)  # segments never overlap: each element has one writer
    tl.store(out_ptrs, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=ok)


def _segmented_outer_kernel(
    p_ptr: tl.tensor, q_ptr: tl.tensor, mask_ptr: tl.tensor, g_ptr: tl.tensor,
    starts_ptr: tl.tensor, ends_ptr: tl.tensor, slots_ptr: tl.tensor, scalings_ptr: tl.tensor, slot_ids_ptr: tl.tensor, slot_ranks_ptr: tl.tensor,
    S: tl.tensor, M: tl.tensor, N: tl.tensor,
    sp_t: tl.tensor, sp_m: tl.tensor, sq_t: tl.tensor, sq_n: tl.tensor, sm_t: tl.tensor, sm_n: tl.tensor,
    sg_s: tl.tensor, sg_m: tl.tensor, sg_n: tl.tensor,
    RANK_ON_M: tl.constexpr, HAS_MASK: tl.constexpr, SCALE: tl.constexpr, DOT_F32: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
) -> None:
    """G[slot, m, n] = Σ_{segments of slot} (scaling ×) Σ_{t in segment} P[t, m] Q[t, n] (× mask[t, n]): the weight
    gradients, a segmented reduction over rows. One program owns a (m block, n block) tile of one distinct slot and
    walks every segment of that slot, so a run twice in the pass sums without atomics and in a fixed order.
    grad_A: P = grad_h, Q = x (masked), rank on m. grad_B: P = grad, Q = h, rank on n, scaled. ACCUMULATE: G +=
    instead of G = (a persistent gradient buffer; each tile has one program, so no atomics)."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ids_ptr + pid_s)
    rank = tl.load(slot_ranks_ptr + pid_s)
    if RANK_ON_M:
        m_lim = rank
        n_lim = N
    else:
        m_lim = M
        n_lim = rank
    if pid_m * BLOCK_M >= m_lim:  # past the slot's rank: the zero-filled buffer is already right
        return
    if pid_n * BLOCK_N >= n_lim:
        return
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = ms < m_lim, ns < n_lim
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, S):
        if tl.load(slots_ptr + s) == slot:
            start, end = tl.load(starts_ptr + s), tl.load(ends_ptr + s)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for t0 in range(start, end, BLOCK_T):
                ts = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
                t_ok = ts < end
                pb = tl.load(p_ptr + ts[None, :] * sp_t + ms[:, None] * sp_m, mask=m_ok[:, None] & t_ok[None, :], other=0.0)
                qb = tl.load(q_ptr + ts[:, None] * sq_t + ns[None, :] * sq_n, mask=t_ok[:, None] & n_ok[None, :], other=0.0)
                if HAS_MASK:
                    keep = tl.load(mask_ptr + ts[:, None] * sm_t + ns[None, :] * sm_n, mask=t_ok[:, None] & n_ok[None, :], other=0.0)
                    qb = (qb.to(tl.float32) * keep.to(tl.float32)).to(qb.dtype)
                if DOT_F32:
                    part += tl.dot(pb.to(tl.float32), qb.to(tl.float32), input_precision="ieee")
                else:
                    part += tl.dot(pb, qb)
            if SCALE:
                part = part * tl.load(scalings_ptr + s)
            acc += part
    g_ptrs = g_ptr + slot.to(tl.int64) * sg_s + ms[:, None] * sg_m + ns[None, :] * sg_n
    if ACCUMULATE:
        acc += tl.load(g_ptrs, mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    tl.store(g_ptrs, acc.to(g_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _bgmv_shrink_kernel(
    x_ptr: tl.tensor, w_ptr: tl.tensor, h_ptr: tl.tensor, row_slots_ptr: tl.tensor, slot_ranks_ptr: tl.tensor,
    K: tl.tensor, sx_t: tl.tensor, sx_k: tl.tensor, sw_s: tl.tensor, sw_r: tl.tensor, sw_k: tl.tensor, sh_t: tl.tensor, sh_r: tl.tensor,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
) -> None:
    """h[t, j] = Σ_k x[t, k] A[slot(t), j, k] for j < rank(slot(t)); rows with slot -1 left as they are (zero).
    A matrix-vector product per row: too few rows for tl.dot's 16, so a multiply and a row sum."""
    row, pid_r = tl.program_id(0), tl.program_id(1)
    slot = tl.load(row_slots_ptr + row)
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    if pid_r * BLOCK_R >= rank:
        return
    rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rs < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xb = tl.load(x_ptr + row.to(tl.int64) * sx_t + ks * sx_k, mask=k_ok, other=0.0).to(tl.float32)
        wb = tl.load(w_ptr + slot.to(tl.int64) * sw_s + rs[:, None] * sw_r + ks[None, :] * sw_k,
                     mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wb * xb[None, :], axis=1)
    tl.store(h_ptr + row.to(tl.int64) * sh_t + rs * sh_r, acc.to(h_ptr.dtype.element_ty), mask=r_ok)


def _bgmv_expand_kernel(
    h_ptr: tl.tensor, w_ptr: tl.tensor, out_ptr: tl.tensor, row_slots_ptr: tl.tensor, slot_ranks_ptr: tl.tensor, slot_scalings_ptr: tl.tensor,
    N: tl.tensor, sh_t: tl.tensor, sh_r: tl.tensor, sw_s: tl.tensor, sw_n: tl.tensor, sw_r: tl.tensor, so_t: tl.tensor, so_n: tl.tensor,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
) -> None:
    """out[t, n] += scaling(slot) Σ_{j<rank} h[t, j] B[slot(t), n, j]; rows with slot -1 untouched."""
    row, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(row_slots_ptr + row)
    if slot < 0:
        return
    rank = tl.load(slot_ranks_ptr + slot)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        hb = tl.load(h_ptr + row.to(tl.int64) * sh_t + rs * sh_r, mask=r_ok, other=0.0).to(tl.float32)
        wb = tl.load(w_ptr + slot.to(tl.int64) * sw_s + ns[:, None] * sw_n + rs[None, :] * sw_r,
                     mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wb * hb[None, :], axis=1)
    acc = acc * tl.load(slot_scalings_ptr + slot)
    out_ptrs = out_ptr + row.to(tl.int64) * so_t + ns * so_n
    current = tl.load(out_ptrs, mask=n_ok, other=0.0)
    tl.store(out_ptrs, (current.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=n_ok)


class _Kernels(NamedTuple):
    shrink: Any
    expand: Any
    outer: Any
    shrink_rows: Any
    expand_rows: Any
    interpret: bool


@functools.cache
def _kernels() -> _Kernels:
    """The kernels, jit-wrapped on first use: compiled, or interpreted when TRITON_INTERPRET was set (see above)."""
    try:
        import triton
        import triton.language as language
    except ImportError as error:
        raise RuntimeError("the LoRA Triton kernels need triton (SIGNAL_LORA_KERNELS=torch uses the torch path)") from error
    globals()["tl"] = language  # the kernels' bodies name `tl`: triton resolves it in this module's globals
    return _Kernels(triton.jit(_sgmv_shrink_kernel), triton.jit(_sgmv_expand_kernel), triton.jit(_segmented_outer_kernel),
                    triton.jit(_bgmv_shrink_kernel), triton.jit(_bgmv_expand_kernel), _interpreting())


# Triton 3.9 warns on every compile unless fp fusion is chosen (its default flips in 3.10): fused multiply-adds, one
# rounding each, as cuBLAS does.
LAUNCH = {"enable_fp_fusion": True}


def _block(n: int, low: int = 16, high: int = 64) -> int:
    """A power of two covering n, within [low, high]: tl.dot wants at least 16 a side."""
    size = low
    while size < n and size < high:
        size *= 2
    return size


def _dot_f32(kernels: _Kernels, dtype: torch.dtype) -> bool:
    """fp32 data dots in full fp32 (not TF32), and everything does under the interpreter: its bf16 arithmetic is
    wrong (triton 3.9), so the kernels also multiply by a mask in fp32 and round back, which is what a bf16 multiply
    does anyway."""
    return kernels.interpret or dtype == torch.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(x: torch.Tensor, weights: torch.Tensor, table: LoraTable) -> None:
    if x.dim() != 2 or x.shape[0] != table.total_rows:
        raise ValueError(f"x must be [{table.total_rows}, features] (the table's rows), not {list(x.shape)}")
    if x.dtype != weights.dtype:
        raise ValueError(f"x is {x.dtype} and the slots {weights.dtype}: one dtype for both")
    if weights.shape[0] <= max((s.slot for s in table.segments), default=-1):
        raise ValueError(f"the table names slots past the buffer's {weights.shape[0]}")


def _shrink_launch(x: torch.Tensor, W: torch.Tensor, w_strides: tuple[int, int, int], W_rows: int,
                   mask: torch.Tensor | None, table: LoraTable, scale: bool) -> torch.Tensor:
    """h [T, table.max_rank] = segmented x @ W[slot]ᵀ, W addressed as [slot, j, k] by w_strides (W_rows: its j size)."""
    if W_rows < table.max_rank:
        raise ValueError(f"the slots hold rank {W_rows}, the table asks for {table.max_rank}")
    h = x.new_zeros(x.shape[0], table.max_rank)
    if table.num_segments == 0:
        return h
    kernels = _kernels()
    K = x.shape[1]
    # fp32 tiles at 64 deep want 112 KiB of shared memory (sm_90, 3 stages): past consumer cards' ~100 KiB
    block_t, block_r, block_k = _block(table.max_segment_rows), _block(table.max_rank), _block(K, 32, 32 if x.dtype == torch.float32 else 64)
    grid = (_cdiv(table.max_segment_rows, block_t), table.num_segments, _cdiv(table.max_rank, block_r))
    m = mask if mask is not None else x  # never read without HAS_MASK
    kernels.shrink[grid](
        x, W, m, h, table.seg_starts, table.seg_ends, table.seg_slots, table.seg_ranks, table.seg_scalings, K,
        x.stride(0), x.stride(1), *w_strides, m.stride(0), m.stride(1), h.stride(0), h.stride(1),
        HAS_MASK=mask is not None, SCALE=scale, DOT_F32=_dot_f32(kernels, x.dtype),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k, **LAUNCH)
    return h


def _expand_launch(h: torch.Tensor, W: torch.Tensor, w_strides: tuple[int, int, int], N: int, out: torch.Tensor,
                   table: LoraTable, scale: bool) -> torch.Tensor:
    """out += segmented h @ W[slot]ᵀ (× scaling), W addressed as [slot, n, j] by w_strides."""
    if table.num_segments == 0:
        return out
    kernels = _kernels()
    block_t, block_n, block_r = _block(table.max_segment_rows), _block(N, 32, 64), _block(table.max_rank, 16, 32)
    grid = (_cdiv(table.max_segment_rows, block_t), table.num_segments, _cdiv(N, block_n))
    kernels.expand[grid](
        h, W, out, table.seg_starts, table.seg_ends, table.seg_slots, table.seg_ranks, table.seg_scalings, N,
        h.stride(0), h.stride(1), *w_strides, out.stride(0), out.stride(1),
        SCALE=scale, DOT_F32=_dot_f32(kernels, h.dtype), BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r, **LAUNCH)
    return out


def _outer_launch(P: torch.Tensor, Q: torch.Tensor, mask: torch.Tensor | None, G: torch.Tensor, g_strides: tuple[int, int, int],
                  M: int, N: int, table: LoraTable, rank_on_m: bool, scale: bool, accumulate: bool = False) -> None:
    """G[slot] (addressed [slot, m, n] by g_strides) = Σ over the slot's segments of (scaling ×) Pᵀ Q on their rows."""
    if table.num_segments == 0:
        return
    kernels = _kernels()
    block_m, block_n = (_block(M, 16, 64), _block(N, 16, 64))
    block_t = _block(table.max_segment_rows, 16, 32)
    grid = (_cdiv(M, block_m), _cdiv(N, block_n), table.num_slots)
    m = mask if mask is not None else Q
    kernels.outer[grid](
        P, Q, m, G, table.seg_starts, table.seg_ends, table.seg_slots, table.seg_scalings, table.slot_ids, table.slot_ranks,
        table.num_segments, M, N, P.stride(0), P.stride(1), Q.stride(0), Q.stride(1), m.stride(0), m.stride(1), *g_strides,
        RANK_ON_M=rank_on_m, HAS_MASK=mask is not None, SCALE=scale, DOT_F32=_dot_f32(kernels, P.dtype), ACCUMULATE=accumulate,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t, **LAUNCH)


# ---------------------------------------------------------------------------------------------------------------------
# Segmented (SGMV): shrink, expand, and the delta with its backward


def lora_shrink(x: torch.Tensor, A_slots: torch.Tensor, table: LoraTable, dropout_mask: torch.Tensor | None = None,
                impl: Impl | None = None) -> torch.Tensor:
    """h [T, table.max_rank]: each segment's rows times its slot's A (first `rank` rows), zero elsewhere. No autograd."""
    _check(x, A_slots, table)
    if (impl or choose(x.device, x.dtype)) == "torch":
        return reference_shrink(x, A_slots, table, dropout_mask)
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
    if (impl or choose(h.device, h.dtype)) == "torch":
        return reference_expand(h, B_slots, table, out)
    return _expand_launch(h, B_slots, (B_slots.stride(0), B_slots.stride(1), B_slots.stride(2)), B_slots.shape[1], out,
                          table, scale=True)


class SegmentedLora(torch.autograd.Function):
    """delta = segmented `B(A(x × mask)) × scaling` [T, out]; gradients for x, A_slots and B_slots.

    `apply(x, A_slots, B_slots, table, dropout_mask_or_None, impl_or_None, grad_into_or_None)`. The weight gradients
    come back as one tensor of each slot buffer's shape (zero for slots not in the pass), in the slots' dtype: each
    run's `.grad` can be a view of its slot. With `grad_into` (persistent buffers of the slot buffers' shapes, fp32
    masters' gradients under bf16 compute) they are added there instead, only the pass's slots' rows touched, and
    autograd gets None for A and B: no whole-buffer gradient per layer and pass. h is kept from the forward
    (x.dtype, [T, max_rank]): cheaper than recomputing it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: LoraTable,
                dropout_mask: torch.Tensor | None = None, impl: Impl | None = None,
                grad_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        impl = impl or choose(x.device, x.dtype)
        mask = None if dropout_mask is None else dropout_mask.to(x.dtype)
        h = lora_shrink(x, A_slots, table, mask, impl)
        delta = lora_expand(h, B_slots, table, None, impl)
        ctx.save_for_backward(x, A_slots, B_slots, h, mask)
        ctx.table, ctx.impl, ctx.grad_into = table, impl, grad_into
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
        if ctx.impl == "torch":
            grad_x, grad_A, grad_B = reference_backward(grad, x, h, A_slots, B_slots, table, mask, grad_into)
        else:
            grad_x, grad_A, grad_B = _triton_backward(grad, x, h, A_slots, B_slots, table, mask, needs, grad_into)
        if grad_into is not None:  # already added where they belong
            grad_A = grad_B = None
        return (grad_x if needs[0] else None, grad_A if needs[1] else None, grad_B if needs[2] else None, None, None, None,
                None)


def _triton_backward(grad: torch.Tensor, x: torch.Tensor, h: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor,
                     table: LoraTable, mask: torch.Tensor | None, needs: tuple[bool, ...],
                     grad_into: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    grad_x = grad_A = grad_B = None
    accumulate = grad_into is not None
    if needs[0] or needs[1]:  # grad_h = scaling × grad @ B[slot][:, :r]: a shrink with Bᵀ as its weight
        grad_h = _shrink_launch(grad, B_slots, (B_slots.stride(0), B_slots.stride(2), B_slots.stride(1)), B_slots.shape[2],
                                None, table, scale=True)
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
                      grad.shape[1], table.max_rank, table, rank_on_m=False, scale=True, accumulate=accumulate)
    return grad_x, grad_A, grad_B


def segmented_lora(x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: LoraTable,
                   dropout_mask: torch.Tensor | None = None, impl: Impl | None = None,
                   grad_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The co-batched LoRA delta [T, out] with autograd: Triton on CUDA, the torch reference elsewhere (`choose`).
    `grad_into`: add the weight gradients into these buffers (see SegmentedLora) rather than return them."""
    _check(x, A_slots, table)
    if grad_into is not None and (grad_into[0].shape != A_slots.shape or grad_into[1].shape != B_slots.shape):
        raise ValueError("grad_into must be two buffers of the slot buffers' shapes")
    # torch leaves Function.apply untyped
    result: torch.Tensor = SegmentedLora.apply(x, A_slots, B_slots, table, dropout_mask, impl, grad_into)  # type: ignore[no-untyped-call]
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
    if (impl or choose(x.device, x.dtype)) == "torch":
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
    if (impl or choose(h.device, h.dtype)) == "torch":
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
    return lora_expand_rows(lora_shrink_rows(x, A_slots, table, impl), B_slots, table, out, impl)


# ---------------------------------------------------------------------------------------------------------------------
# Grouped (expert, run), for mixture-of-experts layers


def grouped_expert_lora(x: torch.Tensor, A_slots: torch.Tensor, B_slots: torch.Tensor, table: LoraTable,
                        dropout_mask: torch.Tensor | None = None, impl: Impl | None = None) -> torch.Tensor:
    """The delta [T, out] for rows sorted into (expert, slot) segments (build_expert_table), A_slots
    [slots, experts, R, in] and B_slots [slots, experts, out, R]: the segmented kernels on the buffers flattened to
    [slots × experts, …] (views when contiguous), so gradients reach the 4-D buffers through the reshape."""
    if A_slots.dim() != 4 or B_slots.dim() != 4 or A_slots.shape[:2] != B_slots.shape[:2]:
        raise ValueError("expert slot buffers are [slots, experts, R, in] and [slots, experts, out, R]")
    return segmented_lora(x, A_slots.flatten(0, 1), B_slots.flatten(0, 1), table, dropout_mask, impl)
