"""The multi-LoRA layer: one frozen base Linear, many runs' A/B matrices, each batch row routed to its run's.

PEFT's mixed-batch `adapter_names` is inference-only, so this is our own (prior art: SkyRL's
`tx/layers/lora.py`, prime-rl's `multi_linear.py`, punica's and vLLM's segmented ops). A forward pass
carries a `Routing`: contiguous row segments, each naming a run (training, prefill), or one slot per row
(`row_slots`, decoding). Every row gets its own run's `B(A(dropout(x))) * scaling` added to the shared base
output, so gradients reach only that run's matrices and each run's loss stays its own, as if it had trained alone.

The runs' matrices live in the base's slot buffers (compute/lora/slots.py). A pass builds one table of
(rows, slot, rank, scaling) the first time a layer asks, and every layer reads it (one more per distinct set of
targeted layers); the layer hands its buffers to `ops.segmented_lora` or `ops.rows_lora`: nothing is stacked per
layer. Where the base computes in bf16 (CUDA) so does LoRA, from bf16 copies of the buffers made once a pass; the
weight gradients are added into the fp32 masters' gradient buffers, whose rows are the runs' `.grad`.

Dropout masks come from a generator seeded by (run seed, step, call, module) and are drawn at the
shape of the run's whole call, then sliced to the rows in this pass, so co-batching, splitting a
call across passes, replay and recompute all draw the same mask.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.compute.lora import ops
from gpu_runtime.compute.lora.slots import BaseSlots, LayerSlots, Occupant

LOW_PRECISION = (torch.bfloat16, torch.float16)  # base dtypes LoRA computes in too; anything else computes in fp32


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


class Routing:
    """Where a pass's rows go, the base's slots, and what the pass builds once for all its layers."""

    def __init__(self, slots: BaseSlots | None = None) -> None:
        self.slots = slots if slots is not None else BaseSlots()
        self._segments: list[Segment] = []
        # Decoding: one slot per batch row (`slot_of(key)`, -1: the base alone); no autograd.
        self.row_slots: list[int] | None = None
        # …and each row's routing key ("" for none): what reads adapters by key (compute/lora/experts.py) routes by.
        self.row_keys: list[str] | None = None
        self.tables: dict[Any, Any] = {}  # this routing's tables, dropped when its rows change
        self.copies: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}  # this pass's compute copies
        self.kernel: ops.Impl | None = None  # the segmented kernel this pass runs (a journal names it); None: ops' choice

    @property
    def segments(self) -> list[Segment]:
        return self._segments

    @segments.setter
    def segments(self, segments: list[Segment]) -> None:
        self._segments = segments
        self.tables.clear()

    def clear(self) -> None:
        """After a pass: a stray pass computes the plain base, and nothing of this one is kept."""
        self._segments, self.row_slots, self.row_keys, self.kernel = [], None, None, None
        self.tables.clear()
        self.copies.clear()

    def slot_of(self, key: str | None) -> int:
        """A key's slot for `row_slots`: -1 for none (the base alone) or a key not attached to this base."""
        slot = None if key is None else self.slots.slot_of(key)
        return -1 if slot is None else slot

    def placed(self) -> list[tuple[Segment, Occupant]]:
        """This pass's segments whose keys hold a slot here (others' rows are the base alone)."""
        if "placed" not in self.tables:
            occupants = self.slots.occupants
            self.tables["placed"] = [(s, occupants[s.key]) for s in self.segments if s.key in occupants and s.end > s.start]
        placed: list[tuple[Segment, Occupant]] = self.tables["placed"]
        return placed

    def table(self, lora: LayerSlots, rows: int, per_row: int
              ) -> tuple[ops.LoraTable, list[tuple[Segment, Occupant]]] | None:
        """The pass's table for a layer of `rows` rows (counted in tokens), with the segments it covers; None: no row
        here. Built once per pass and set of slots the layer holds (every layer, where runs target the same)."""
        placed = [(s, o) for s, o in self.placed() if lora.holds(o.slot)]
        if not placed:
            return None
        key = ("table", rows, per_row, tuple(o.slot for _, o in placed))
        if key not in self.tables:
            self.tables[key] = ops.build_table([(s.start * per_row, s.end * per_row, o.slot, o.rank, o.scaling)
                                                for s, o in placed], lora.device, total_rows=rows * per_row)
        table: ops.LoraTable = self.tables[key]
        return table, placed

    def rows_table(self, lora: LayerSlots, per_row: int) -> ops.RowsTable | None:
        """The per-row table for a layer: each row's slot repeated over its tokens, -1 where this layer has none."""
        assert self.row_slots is not None
        held = tuple(slot for slot in sorted(set(self.row_slots)) if slot >= 0 and lora.holds(slot))
        if not held:
            return None
        key = ("rows", per_row, tuple(self.row_slots))
        if key not in self.tables:
            ranks, scalings = [0] * lora.capacity, [0.0] * lora.capacity
            for occupant in self.slots.occupants.values():
                if occupant.slot in held:
                    ranks[occupant.slot], scalings[occupant.slot] = occupant.rank, occupant.scaling
            rows = [slot if slot in held else -1 for slot in self.row_slots for _ in range(per_row)]
            self.tables[key] = ops.build_rows_table(rows, ranks, scalings, lora.device)
        table: ops.RowsTable = self.tables[key]
        return table

    def weights(self, lora: LayerSlots, dtype: torch.dtype, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's A and B slot buffers in the pass's compute dtype: the fp32 masters themselves, or bf16 copies
        made once a pass. Leaves: their gradients go to the masters' buffers (`grad_into`), never to them."""
        key = ("weights", id(lora), dtype, grad)
        if key not in self.copies:
            with torch.no_grad():
                A, Bt = lora.A.detach(), lora.Bt.detach()
                if dtype != A.dtype:
                    A, Bt = A.to(dtype), Bt.to(dtype)
            self.copies[key] = A.requires_grad_(grad), Bt.transpose(1, 2).requires_grad_(grad)
        weights = self.copies[key]
        return weights


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """LoRA computes in the base's dtype where that is bf16 or fp16, else in fp32 (the masters' own)."""
    return x.dtype if x.dtype in LOW_PRECISION else torch.float32


class MultiLoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, name: str, routing: Routing) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.name = name
        self.routing = routing
        self.name_seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
        # A plain attribute, not a module or buffer: the runs' matrices are the base's slots, not the model's state.
        self.lora: LayerSlots | None = None

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
        if self.lora is None or not (self.routing.segments or self.routing.row_slots):
            return out
        if self.routing.row_slots is not None:
            return self._rows(out, x, self.lora)
        return self._segments(out, x, self.lora)

    def _segments(self, out: torch.Tensor, x: torch.Tensor, lora: LayerSlots) -> torch.Tensor:
        per_row = math.prod(x.shape[1:-1])  # tokens per row: the kernels see [rows × tokens, features]
        found = self.routing.table(lora, x.shape[0], per_row)
        if found is None:
            return out
        table, placed = found
        dtype, grad = compute_dtype(x), torch.is_grad_enabled()
        A, B = self.routing.weights(lora, dtype, grad)
        mask = self._mask(x, placed, dtype)
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        delta = ops.segmented_lora(flat, A, B, table, mask, self.routing.kernel, grad_into=lora.grads() if grad else None)
        if delta.requires_grad:  # the runs' .grad become their rows of the gradient buffers as gradients arrive
            slots = [o.slot for _, o in placed if o.trainable]
            delta.register_hook(lambda _: lora.link_grads(slots))
        return (out + delta.view(*out.shape)).to(out.dtype)

    def _rows(self, out: torch.Tensor, x: torch.Tensor, lora: LayerSlots) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or out.requires_grad):
            raise RuntimeError("per-row routing (row_slots) serves decoding, without autograd")
        table = self.routing.rows_table(lora, math.prod(x.shape[1:-1]))
        if table is None:
            return out
        dtype = compute_dtype(x)
        A, B = self.routing.weights(lora, dtype, False)
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        if out.dtype == dtype and out.is_contiguous():  # added in place into the base's output
            ops.rows_lora(flat, A, B, table, out.view(-1, out.shape[-1]))
            return out
        return (out + ops.rows_lora(flat, A, B, table).view(*out.shape)).to(out.dtype)

    def _mask(self, x: torch.Tensor, placed: list[tuple[Segment, Occupant]], dtype: torch.dtype) -> torch.Tensor | None:
        """The pass's dropout mask [rows × tokens, in] (1 on rows without dropout), or None when no row drops out."""
        drops = [(s, o.dropout) for s, o in placed if o.dropout > 0 and s.dropout_seed is not None]
        if not drops:
            return None
        mask = torch.ones(x.shape, dtype=dtype, device=x.device)
        for segment, p in drops:
            mask[segment.start : segment.end] = self._dropout_mask(x[segment.start : segment.end], segment, p, dtype)
        return mask.view(-1, x.shape[-1])

    def _dropout_mask(self, x: torch.Tensor, segment: Segment, p: float, dtype: torch.dtype) -> torch.Tensor:
        assert segment.dropout_seed is not None
        generator = torch.Generator(device=x.device).manual_seed((segment.dropout_seed ^ self.name_seed) & (2**63 - 1))
        rows = max(segment.call_rows, segment.row_offset + x.shape[0])
        width = max(segment.call_width, 1) if x.dim() == 3 else 1
        shape = (rows, width, x.shape[-1]) if x.dim() == 3 else (rows, x.shape[-1])
        keep = torch.rand(shape, generator=generator, device=x.device, dtype=torch.float32) >= p
        mask = keep[segment.row_offset : segment.row_offset + x.shape[0]].to(dtype) / (1 - p)
        if x.dim() == 3:  # this pass may be wider (padding, whose values never reach a real token) or narrower
            t = x.shape[1]
            mask = mask[:, :t] if mask.shape[1] >= t else F.pad(mask, (0, 0, 0, t - mask.shape[1]), value=1.0)
        return mask


@contextmanager
def routed(routing: Routing, segments: list[Segment], kernel: ops.Impl | None = None) -> Iterator[None]:
    """Route one forward pass by segments (with `kernel`, the segmented kernel a journal names); the routing is
    cleared after, so a stray pass computes the plain base."""
    routing.clear()
    routing.segments = segments
    routing.kernel = kernel
    try:
        yield
    finally:
        routing.clear()


@contextmanager
def routed_rows(routing: Routing, row_slots: list[int], row_keys: list[str] | None = None) -> Iterator[None]:
    """Route one decode step: batch row i takes slot `row_slots[i]` (`routing.slot_of(key)`; -1: the base alone), and
    key `row_keys[i]` where given (an expert-only run holds no slot)."""
    routing.clear()
    routing.row_slots = list(row_slots)
    routing.row_keys = None if row_keys is None else list(row_keys)
    try:
        yield
    finally:
        routing.clear()
