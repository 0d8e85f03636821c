"""The Triton kernels (SGMV shrink and expand, the segmented outer product of the backward, BGMV for decoding)
and their launches; jit-wrapped on the first call, so nothing here imports triton at import time."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    import triton.language as tl  # at run time bound by _kernels(), on the first kernel call

from gpu_runtime.compute.lora.ops.tables import LoraTable

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

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
