"""The multi-LoRA layer: one frozen base Linear, many runs' A/B matrices, each batch row routed to its run's.

PEFT's mixed-batch `adapter_names` is inference-only, so this is our own (prior art: SkyRL's
`tx/layers/lora.py`, prime-rl's `multi_linear.py`, vLLM's torch reference ops). A forward pass
carries a `Routing`: contiguous row segments, each naming a run. Every row gets its own run's
`B(A(dropout(x))) * scaling` added to the shared base output, so gradients reach only that run's
matrices and each run's loss stays its own, as if it had trained alone.

A decode pass's rows are slots, interleaved across runs, so it routes per row instead (`RowRouting`, the BGMV
form: each row an adapter index, -1 the base alone): the layer stacks the adapters present once (cached until their
weights change) and computes every row's delta in one call of `per_row_delta`, the seam a kernel replaces.

Dropout masks come from a generator seeded by (run seed, step, call, module) and are drawn at the
shape of the run's whole call, then sliced to the rows in this pass, so co-batching, splitting a
call across passes, replay and recompute all draw the same mask.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Segment:
    """Rows [start, end) of this pass belong to run `key`."""

    key: str
    start: int
    end: int
    dropout_seed: int | None = None  # None: no dropout (sampling, or a run without it)
    call_rows: int = 0  # the whole call's rows and width, for drawing masks at the call's own shape
    call_width: int = 0
    row_offset: int = 0  # where this pass's rows start within the call


@dataclass
class RowRouting:
    """Per-row routing (inference only): row i reads adapter `index[i]` (-1: the base alone), adapter j being the one
    registered under `keys[j]` (a key with no adapter in a layer adds nothing there)."""

    index: torch.Tensor  # [rows] int64, on the pass's device
    keys: tuple[str, ...]
    epoch: int = 0  # changes whenever the adapters' weights may have (the layers stack them again)


@dataclass
class Routing:
    segments: list[Segment] = field(default_factory=list)
    grouped: bool | None = None  # False: the per-segment loop (the reference); else grouped matmuls where torch has them
    rows: RowRouting | None = None  # set: a decode pass, routed row by row (segments unused)


@dataclass
class LoraWeights:
    A: torch.nn.Parameter  # [r, in]
    B: torch.nn.Parameter  # [out, r]
    scaling: float
    dropout: float


class MultiLoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, name: str, routing: Routing) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.name = name
        self.routing = routing
        self.name_seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
        # Plain dict, not a ModuleDict: the runs' matrices are owned by their RunState, not the base model.
        self.adapters: dict[str, LoraWeights] = {}
        self._stacked: tuple[tuple[Any, ...], tuple[torch.Tensor, ...] | None] | None = None  # per-row stacks, by their key

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base_layer(x)
        if self.routing.rows is not None:
            return self._per_row(out, x, self.routing.rows)
        segments = [s for s in self.routing.segments if s.key in self.adapters]
        if not segments:
            return out
        if len(self.routing.segments) == 1:  # the whole pass is one run: no slicing
            return self._add(out, x, segments[0])
        if self.routing.grouped is not False:
            return self._grouped(out, x, segments)
        pieces = []
        for segment in self.routing.segments:
            piece = out[segment.start : segment.end]
            if segment.key in self.adapters:
                piece = self._add(piece, x[segment.start : segment.end], segment)
            pieces.append(piece)
        return torch.cat(pieces)

    def _per_row(self, out: torch.Tensor, x: torch.Tensor, rows: RowRouting) -> torch.Tensor:
        stacks = self._stacks(rows.keys, rows.epoch)
        if stacks is None:
            return out  # no row's adapter targets this layer
        A, B, scaling, lookup = stacks
        delta = per_row_delta(x, A, B, scaling, lookup[rows.index + 1])
        return (out + delta).to(out.dtype)

    def _stacks(self, keys: tuple[str, ...], epoch: int) -> tuple[torch.Tensor, ...] | None:
        """The adapters `keys` name that this layer holds, as A [n, width, in] and B [n, out, width] (ranks zero-padded
        to one width), their scalings [n], and `lookup` [len(keys) + 1]: adapter index + 1 -> position in the stack
        (-1: none). Made once per epoch (the caller's: a run may have trained between two of its samples)."""
        present = [(j, self.adapters[key]) for j, key in enumerate(keys) if key in self.adapters]
        signature = (keys, epoch, tuple((id(w.A), id(w.B)) for _, w in present))
        if self._stacked is not None and self._stacked[0] == signature:
            return self._stacked[1]
        stacks: tuple[torch.Tensor, ...] | None = None
        if present:
            width = max(w.A.shape[0] for _, w in present)
            with torch.no_grad():
                A = torch.stack([_pad_to(w.A.detach(), width, dim=0) for _, w in present])
                B = torch.stack([_pad_to(w.B.detach(), width, dim=1) for _, w in present])
            device = A.device
            scaling = torch.tensor([w.scaling for _, w in present], dtype=A.dtype, device=device)
            lookup = torch.full((len(keys) + 1,), -1, dtype=torch.int64)
            for position, (j, _) in enumerate(present):
                lookup[j + 1] = position
            stacks = (A, B, scaling, lookup.to(device))
        self._stacked = (signature, stacks)
        return stacks

    def _input(self, x: torch.Tensor, segment: Segment) -> torch.Tensor:
        """The rows' input to their run's A: in the adapter's dtype, with the run's own dropout mask."""
        lora = self.adapters[segment.key]
        x = x.to(lora.A.dtype)  # fp32 adapters on a bf16 base, as PEFT does
        if lora.dropout > 0 and segment.dropout_seed is not None:
            x = x * self._dropout_mask(x, segment, lora.dropout)
        return x

    def _add(self, out: torch.Tensor, x: torch.Tensor, segment: Segment) -> torch.Tensor:
        lora = self.adapters[segment.key]
        delta = F.linear(F.linear(self._input(x, segment), lora.A), lora.B) * lora.scaling
        return (out + delta).to(out.dtype)

    def _dropout_mask(self, x: torch.Tensor, segment: Segment, p: float) -> torch.Tensor:
        assert segment.dropout_seed is not None
        generator = torch.Generator(device=x.device).manual_seed((segment.dropout_seed ^ self.name_seed) & (2**63 - 1))
        rows = max(segment.call_rows, segment.row_offset + x.shape[0])
        width = max(segment.call_width, 1) if x.dim() == 3 else 1
        shape = (rows, width, x.shape[-1]) if x.dim() == 3 else (rows, x.shape[-1])
        keep = torch.rand(shape, generator=generator, device=x.device, dtype=torch.float32) >= p
        mask = keep[segment.row_offset : segment.row_offset + x.shape[0]].to(x.dtype) / (1 - p)
        if x.dim() == 3:  # this pass may be wider (padding, whose values never reach a real token) or narrower
            t = x.shape[1]
            mask = mask[:, :t] if mask.shape[1] >= t else F.pad(mask, (0, 0, 0, t - mask.shape[1]), value=1.0)
        return mask

    def _grouped(self, out: torch.Tensor, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Every run's rows in two grouped matmuls per width: runs whose ranks pad to one width share them."""
        per_row = math.prod(x.shape[1:-1])  # tokens per row: the matmuls see [rows × tokens, features]
        groups: dict[tuple[int, torch.dtype], list[Segment]] = {}
        for segment in segments:
            A = self.adapters[segment.key].A
            groups.setdefault((group_width(A.shape[0]), A.dtype), []).append(segment)
        ordered = all(a.end == b.start for a, b in zip(segments, segments[1:]))
        if len(groups) == 1 and ordered and segments[0].start == 0 and segments[-1].end == x.shape[0]:
            (width, _), = groups
            delta = self._group_delta(x, segments, width, per_row)  # already in row order: no scatter
            return (out + delta.view(*out.shape[:-1], -1)).to(out.dtype)
        pieces: dict[int, torch.Tensor] = {}
        for (width, _), group in groups.items():
            delta = self._group_delta(x, group, width, per_row)
            for segment, piece in zip(group, delta.split([(s.end - s.start) * per_row for s in group])):
                pieces[segment.start] = piece
        rows, cursor = [], 0  # the deltas back in row order; rows of no run here get zero
        for segment in sorted(segments, key=lambda s: s.start):
            if segment.start > cursor:
                rows.append(out.new_zeros(((segment.start - cursor) * per_row, out.shape[-1]), dtype=pieces[segment.start].dtype))
            rows.append(pieces[segment.start])
            cursor = segment.end
        if cursor < x.shape[0]:
            rows.append(out.new_zeros(((x.shape[0] - cursor) * per_row, out.shape[-1]), dtype=rows[-1].dtype))
        return (out + torch.cat(rows).view(*out.shape[:-1], -1)).to(out.dtype)

    def _group_input(self, x: torch.Tensor, group: list[Segment], dtype: torch.dtype) -> torch.Tensor:
        """The group's rows, in its order, as [rows × tokens, in], each run's dropout mask applied. One gather (none
        when the group is every row in order), not a slice per run: each slice's backward would fill a whole-x
        gradient."""
        whole = group[0].start == 0 and group[-1].end == x.shape[0] and all(
            a.end == b.start for a, b in zip(group, group[1:]))
        if whole:
            xs = x.to(dtype)
        else:
            index = torch.cat([torch.arange(s.start, s.end) for s in group]).to(x.device)
            xs = x.to(dtype).index_select(0, index)
        masks = [self._mask_or_none(x[s.start : s.end], s, dtype) for s in group]
        if any(mask is not None for mask in masks):  # ×1 where a run has no dropout: the bits of no mask
            xs = xs * torch.cat([torch.ones(x[s.start : s.end].shape, dtype=dtype, device=x.device) if mask is None
                                 else mask for s, mask in zip(group, masks)])
        return xs.reshape(-1, x.shape[-1])

    def _mask_or_none(self, x: torch.Tensor, segment: Segment, dtype: torch.dtype) -> torch.Tensor | None:
        p = self.adapters[segment.key].dropout
        if p > 0 and segment.dropout_seed is not None:
            return self._dropout_mask(x.detach().to(dtype), segment, p)
        return None

    def _group_delta(self, x: torch.Tensor, group: list[Segment], width: int, per_row: int) -> torch.Tensor:
        """`B(A(x)) * scaling` for the rows of runs of one padded width, as [rows × tokens, out]."""
        loras = [self.adapters[s.key] for s in group]
        xs = self._group_input(x, group, loras[0].A.dtype)
        counts = tuple((s.end - s.start) * per_row for s in group)
        # Zero rows of A and columns of B up to the run's own width: its numbers never depend on who else is here.
        A = torch.stack([_pad_to(lora.A, width, dim=0) for lora in loras])  # [runs, width, in]
        B = torch.stack([_pad_to(lora.B, width, dim=1) for lora in loras])  # [runs, out, width]
        if len(set(counts)) == 1:  # equal rows: one batched matmul each way, the gradients in A's and B's layout
            rows = xs.view(len(counts), counts[0], xs.shape[-1])
            delta: torch.Tensor = equal_rows_lora(rows, A, B).reshape(xs.shape[0], -1)
        else:
            # No dense-gradient guard: `delta` is scaled next, and a multiply's gradient is always dense.
            delta = grouped_matmul(grouped_matmul(xs, A.transpose(1, 2), counts, guard=False), B.transpose(1, 2),
                                   counts, guard=False)
        scalings = [lora.scaling for lora in loras]
        if len(set(scalings)) == 1:
            return delta * scalings[0]
        scaling = torch.tensor(scalings, dtype=delta.dtype).repeat_interleave(torch.tensor(counts)).to(x.device)
        return delta * scaling.unsqueeze(1)


def per_row_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: torch.Tensor, index: torch.Tensor
                  ) -> torch.Tensor:
    """The BGMV form of the multi-LoRA delta, and the seam for its kernels (compute/lora/ops.py): row i of x
    ([rows, ..., in]) gets `(x_i @ A[index[i]]ᵀ) @ B[index[i]]ᵀ * scaling[index[i]]`, zero where index[i] is -1.
    A [n, width, in], B [n, out, width]. This torch reference shrinks every row by all n adapters at once and masks
    the others' columns before one expand: two matmuls, no gather, no host sync (n small, as a decode batch's are)."""
    n, width, features = A.shape
    xs = x.to(A.dtype)
    h = xs @ A.reshape(n * width, features).T  # [rows, ..., n × width]
    owner = torch.arange(n, device=A.device).repeat_interleave(width)  # the adapter of each of h's columns
    keep = (index[:, None] == owner[None, :]).to(h.dtype)  # [rows, n × width]
    h = h * keep.view(keep.shape[0], *([1] * (h.dim() - 2)), keep.shape[1])
    expand = (B * scaling[:, None, None]).permute(0, 2, 1).reshape(n * width, -1)  # [n × width, out]
    return h @ expand


WIDTH_STEP = 16  # ranks pad up to a multiple of this: _grouped_mm's alignment, and fewer widths to group by


def group_width(rank: int) -> int:
    return -(-rank // WIDTH_STEP) * WIDTH_STEP


def _pad_to(matrix: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`matrix` with zeros appended along `dim` (the rank's) up to `width`; itself when it is that wide already."""
    missing = width - matrix.shape[dim]
    if not missing:
        return matrix
    return F.pad(matrix, (0, 0, 0, missing) if dim == 0 else (0, missing))


class EqualRowsLora(torch.autograd.Function):
    """`(x @ Aᵀ) @ Bᵀ` for groups of equal rows (x [groups, rows, in], A [groups, width, in], B [groups, out, width]),
    whose gradients come out contiguous in A's and B's own layout. The stack's backward then hands each run a
    contiguous slice, which becomes its .grad as it is. Autograd's own gradients here are transposed views: each
    slice was copied into a fresh .grad (1920 copies a pass for 8 runs of r=32 on SmolLM2, 33 of its 190 ms of
    co-batching overhead in bench/cobatch.py --profile). bmm, not `_grouped_mm`: its per-group loop runs inside one
    kernel, at SmolLM2's widths, 8 runs of 21 tokens, forward and backward, one thread: 372 against 420 µs for
    x @ A, 161 against 212 µs for k/v's h @ B."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        h = torch.bmm(x, A.transpose(1, 2))
        ctx.save_for_backward(x, A, B, h)
        return torch.bmm(h, B.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, A, B, h = ctx.saved_tensors
        grad_h = torch.bmm(grad, B)
        grad_x = torch.bmm(grad_h, A) if ctx.needs_input_grad[0] else None
        grad_A = torch.bmm(grad_h.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_B = torch.bmm(grad.transpose(1, 2), h) if ctx.needs_input_grad[2] else None
        return grad_x, grad_A, grad_B


def equal_rows_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = EqualRowsLora.apply(x, A, B)  # type: ignore[no-untyped-call]  # torch leaves Function.apply untyped
    return out


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """_grouped_mm's backward fails on a zero-stride gradient (what a `.sum()` sends back): make it dense first."""
    if t.requires_grad:
        t.register_hook(lambda grad: grad.contiguous())
    return t


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: tuple[int, ...], guard: bool = True) -> torch.Tensor:
    """`x[rows of group g] @ w[g]` for consecutive groups of `counts` rows: x [Σcounts, k], w [groups, k, n]. Torch's
    `_grouped_mm` where it has a kernel of its own for this device and dtype, else one batched matmul over the groups
    padded to the longest (equal rows take `EqualRowsLora` instead). On CUDA,
    `_grouped_mm` on fp32 (our adapters' dtype) runs a matmul per group inside: the H200 profile of 8 co-batched
    runs showed 3271 mm launches, device busy 52 ms of a 894 ms round. `guard`: make the output's gradient dense
    first, which `_grouped_mm`'s backward needs (a caller whose next op is a multiply needs no guard)."""
    if (x.device.type == "cpu" or x.dtype == torch.bfloat16) and grouped_mm_works(x.device, x.dtype):
        # On CPU its per-group loop is C++: 1.2 ms against padded bmm's 1.7 ms for 8 runs of 20 tokens (and 1.4
        # against 4.0 ms for uneven ones), forward and backward at SmolLM2's width, one thread.
        # Only the output gets the dense-gradient hook: a second call's input is the first's output, hooked already.
        out = torch._grouped_mm(x, w, offs=_offsets(counts, x.device))
        return _contiguous_grad(out) if guard else out
    return padded_bmm(x, w, counts)


def padded_bmm(x: torch.Tensor, w: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """`grouped_matmul` by `torch.bmm`: the rows scattered into [groups, longest, k] with zero rows after each
    group's own (rows, not the reduction dimension: a row's sums never see the padding), then gathered back."""
    longest = max(counts)
    index = _padded_rows(counts, x.device)
    padded = x.new_zeros(len(counts) * longest, x.shape[-1]).index_copy(0, index, x)
    out = torch.bmm(padded.view(len(counts), longest, -1), w)
    return out.view(len(counts) * longest, -1).index_select(0, index)


@functools.lru_cache(maxsize=256)
def _offsets(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """_grouped_mm's int32 end offsets, made once per shape of a pass (a host-to-device copy each time otherwise)."""
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


@functools.lru_cache(maxsize=256)
def _padded_rows(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Where each of x's rows sits in the padded [groups × longest] layout, made once per shape of a pass."""
    longest = max(counts)
    return torch.cat([torch.arange(count) + g * longest for g, count in enumerate(counts)]).to(device)


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's private `_grouped_mm` runs here, forward and backward, and agrees with plain matmuls;
    where it does not (an older torch, a GPU or dtype it lacks a kernel for), the per-segment loop serves."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(24, 32, generator=generator).to(device, dtype).requires_grad_()
        w = torch.randn(2, 32, 16, generator=generator).to(device, dtype).requires_grad_()
        offsets = torch.tensor([8, 24], dtype=torch.int32, device=device)
        got = _contiguous_grad(torch._grouped_mm(x, w, offs=offsets))
        got.sum().backward()
        expected = torch.cat([x[:8] @ w[0], x[8:] @ w[1]])
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        return (torch.allclose(got.detach().float(), expected.detach().float(), rtol=tolerance, atol=tolerance)
                and x.grad is not None and w.grad is not None)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@contextmanager
def routed(routing: Routing, segments: list[Segment], grouped: bool | None = None) -> Iterator[None]:
    """Route one forward pass; the routing is cleared after, so a stray pass computes the plain base."""
    routing.segments, routing.grouped = segments, grouped
    try:
        yield
    finally:
        routing.segments, routing.grouped = [], None


@contextmanager
def routed_rows(routing: Routing, index: torch.Tensor, keys: tuple[str, ...], epoch: int) -> Iterator[None]:
    """Route one decode pass row by row (`RowRouting`); cleared after, like `routed`."""
    routing.rows = RowRouting(index, keys, epoch)
    try:
        yield
    finally:
        routing.rows = None
