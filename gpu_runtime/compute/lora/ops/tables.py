"""The per-pass tables the kernels read: segments of rows (training, forward) or one slot per row (decoding),
built once a pass with one host-to-device copy (the layout: ops/__init__.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

# "torch": one F.linear per segment (the reference: every journal written before kernels were named); "grouped": a
# bmm per group of equal segments (ops/grouped.py); "triton": the CUDA kernels
Impl = Literal["triton", "torch", "grouped"]
IMPLS: tuple[Impl, ...] = ("triton", "torch", "grouped")
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
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)  # the grouped path's index tensors

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


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
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
    packed = to_device(host, torch.device(device))
    return LoraTable(
        seg_starts=packed[0:n], seg_ends=packed[n : 2 * n], seg_slots=packed[2 * n : 3 * n], seg_ranks=packed[3 * n : 4 * n],
        seg_scalings=packed[4 * n : 5 * n].view(torch.float32), slot_ids=packed[5 * n : 5 * n + u],
        slot_ranks=packed[5 * n + u :], max_rank=max((s.rank for s in segs), default=0), num_segments=n, total_rows=rows,
        max_segment_rows=max((s.row_end - s.row_start for s in segs), default=0), segments=segs)


@dataclass(frozen=True)
class ExpertTables:
    """A grouped (expert, run) pass over expert slot buffers (ops/__init__.py, `expert_views`): the same segments
    indexing A's windows (`a`) and B's (`b`), and the buffers' R and expert count that the windows are cut by."""

    a: LoraTable
    b: LoraTable
    rank: int  # R: the buffers' rank (A has E·R rows a slot)
    experts: int


def build_expert_tables(segments: Iterable[tuple[int, int, int, int, int, float]], num_experts: int, rank: int,
                        device: torch.device | str, total_rows: int | None = None) -> ExpertTables:
    """The tables for rows already sorted into one segment per (expert, slot), from (row_start, row_end, slot, expert,
    rank, scaling); `rank` is the buffers' R. Expert e of slot s's rank-r run: A's window s·E·R + e·r, B's s·E·R + e."""
    a, b = [], []
    for start, end, slot, expert, r, scaling in segments:
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} outside 0..{num_experts - 1}")
        if r > rank:
            raise ValueError(f"rank {r} past the buffers' {rank}")
        first = slot * num_experts * rank
        a.append((start, end, first + expert * r, r, scaling))
        b.append((start, end, first + expert, r, scaling))
    return ExpertTables(build_table(a, device, total_rows), build_table(b, device, total_rows), rank, num_experts)


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
    # Each used slot's rows for the torch path, found once a step rather than per layer: a slice where they are
    # contiguous (a view, no gather), else an index on the device (from the same one copy).
    slot_rows: tuple[tuple[int, slice | torch.Tensor], ...] = ()

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
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    scattered = [rows for rows in by_slot.values() if rows[-1] - rows[0] + 1 != len(rows)]
    host = torch.tensor(list(row_slots) + list(slot_ranks) + [0] * n + [r for rows in scattered for r in rows],
                        dtype=torch.int32)
    host[t + n : t + 2 * n] = torch.tensor(list(slot_scalings), dtype=torch.float32).view(torch.int32)
    packed = to_device(host, torch.device(device))
    groups: list[tuple[int, slice | torch.Tensor]] = []
    at = t + 2 * n
    for slot, rows in by_slot.items():
        if rows[-1] - rows[0] + 1 == len(rows):
            groups.append((slot, slice(rows[0], rows[-1] + 1)))
        else:
            groups.append((slot, packed[at : at + len(rows)]))
            at += len(rows)
    return RowsTable(row_slots=packed[:t], slot_ranks=packed[t : t + n],
                     slot_scalings=packed[t + n : t + 2 * n].view(torch.float32),
                     max_rank=max(slot_ranks, default=0), host_row_slots=tuple(row_slots),
                     host_slot_ranks=tuple(slot_ranks), host_slot_scalings=tuple(float(s) for s in slot_scalings),
                     slot_rows=tuple(groups))


