"""Per-base slot buffers: where every resident run's (and sampler snapshot's) LoRA matrices live.

Each wrapped layer of a base keeps A [slots, R, in] and B [slots, out, R] fp32 masters (`LayerSlots`); an adapter
attached to the base takes one slot index, the same in every layer (`BaseSlots`), so one per-pass table serves every
layer (compute/lora/layer.py). The adapter's own A and B tensors become views of its slot's rows (A[s, :r],
B[s, :, :r]): the optimizer, snapshots, checkpoints and PEFT exports keep seeing per-run parameters, and the kernels
(compute/lora/ops.py) read every run from one buffer, nothing stacked. Rows and columns past a slot's rank are zero,
so runs of different ranks share a buffer.

B is stored as Bᵀ rows ([slots, R, out], B its transposed view): a run's B [out, r] is then a dense (transposed)
view whose strides depend on neither R nor the slot count, so growing the buffers never changes a parameter's
layout, and its AdamW moments (`zeros_like`, layout preserved) keep matching it (the fused kernel walks raw memory).

Gradients: one fp32 buffer per master (allocated at the first backward); the kernels add each pass's weight
gradients there (`ops.segmented_lora(grad_into=…)`), and `link_grads` makes a run's `.grad` the view of its rows as
the gradient arrives, so it accumulates in place across calls until the optimizer clears it.

Expert targets (3-D MoE parameters, compute/lora/experts.py) keep their runs in buffers of the same kind, one per
target, whose rank rows are `rows_per_rank` (the expert count) times R: a run's PEFT-shaped A [E·r, in] and
B [out, r·E] are then views of its slot exactly as a Linear run's are. They index slots of their own
(`BaseSlots.experts`), apart from the Linear layers', so the slotted optimizer tick never sees them.

AdamW moments: four more buffers of the masters' shapes (`moments`, made at a run's first slotted step,
compute/slot_adamw.py); a run's exp_avg and exp_avg_sq become views of its rows, moved and released as its A and B are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch

from gpu_runtime.compute.lora.ops.tables import to_device

GROWTH_MIN = 4  # slots added at least when a buffer is full; else half again its size (not doubling: 8B-sized slots)


class Wrappable(Protocol):
    """What BaseSlots needs of a wrapped layer (MultiLoraLinear): its sizes and where its buffers hang."""

    name: str
    lora: LayerSlots | None

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...


@dataclass
class Occupant:
    """An adapter in a slot: its rank, scaling and dropout, and its per-layer (A, B) tensors (views of the slot)."""

    key: str
    slot: int
    rank: int
    scaling: float
    dropout: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    trainable: bool


def adopt(tensor: torch.Tensor, view: torch.Tensor) -> None:
    """`tensor` becomes `view` (same values), keeping its identity: the optimizer's state stays keyed by it."""
    with torch.no_grad():
        view.copy_(tensor)
    tensor.data = view


def release(tensor: torch.Tensor) -> None:
    """Give a tensor that was a view of a slot its own storage (same layout), so the slot can be reused."""
    tensor.data = tensor.data.clone()
    if tensor.grad is not None:
        tensor.grad = tensor.grad.clone()


def in_layout_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` in `param`'s memory layout: what may be its `.grad` or AdamW moment (fused AdamW walks raw memory, so
    a tensor laid out otherwise than its parameter would be misread)."""
    if value.stride() == param.stride():
        return value
    return torch.empty_like(param).copy_(value)


class LayerSlots:
    """One wrapped layer's buffers: fp32 masters, their gradients, and which slot holds whose tensors."""

    def __init__(self, in_features: int, out_features: int, capacity: int, rank: int, device: torch.device,
                 rows_per_rank: int = 1) -> None:
        self.in_features, self.out_features, self.device = in_features, out_features, device
        self.rows_per_rank = rows_per_rank  # an expert target's E: its slot rows are E·R, a run's E·r
        self.A = torch.zeros(capacity, rank * rows_per_rank, in_features, device=device)
        self.Bt = torch.zeros(capacity, rank * rows_per_rank, out_features, device=device)
        self.grad_A: torch.Tensor | None = None
        self.grad_Bt: torch.Tensor | None = None
        self.owners: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # slot → (A, B, rank)
        # slot → its owner's gradient views, made once: `link_grads` runs per layer and pass, and an identity check
        # is what tells it that a `.grad` is linked already
        self._grad_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.moments: list[torch.Tensor] | None = None  # exp_avg A, exp_avg_sq A, exp_avg Bᵀ, exp_avg_sq Bᵀ
        self.moment_owners: dict[int, tuple[torch.Tensor, ...]] = {}  # slot → its run's four moment views, as linked
        self._ranges: dict[tuple[int, int], list[torch.Tensor]] = {}  # (first slot, count) → `slot_range`'s views

    @property
    def B(self) -> torch.Tensor:
        """[slots, out, R], a transposed view of the Bᵀ rows: what the kernels take as B."""
        return self.Bt.transpose(1, 2)

    @property
    def capacity(self) -> int:
        return self.A.shape[0]

    def holds(self, slot: int) -> bool:
        return slot in self.owners

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient buffers, (grad_A, grad_B) in A's and B's shapes; made at the first backward."""
        if self.grad_A is None or self.grad_Bt is None:
            self.grad_A, self.grad_Bt = torch.zeros_like(self.A), torch.zeros_like(self.Bt)
            self._grad_views.clear()
            self._ranges.clear()
        return self.grad_A, self.grad_Bt.transpose(1, 2)

    def moment_views(self, slot: int, rank: int) -> tuple[torch.Tensor, ...]:
        """The slot's (exp_avg A, exp_avg_sq A, exp_avg B, exp_avg_sq B) rows in A's and B's layouts."""
        if self.moments is None:
            self.moments = self._new_moments()
            self._ranges.clear()
        mA, vA, mBt, vBt = self.moments
        return mA[slot, :rank], vA[slot, :rank], mBt[slot, :rank].t(), vBt[slot, :rank].t()

    def slot_range(self, lo: int, count: int) -> list[torch.Tensor]:
        """Slots lo..lo+count-1 of A, Bᵀ, their gradients and moments (8 views), made once for an optimizer tick's
        runs of consecutive slots (a narrow is a dispatch; a tick would make 8 per layer)."""
        views = self._ranges.get((lo, count))
        if views is None:
            gA, gBt = self.grad_A, self.grad_Bt
            assert gA is not None and gBt is not None and self.moments is not None, "linked before a step"
            views = self._ranges[lo, count] = [b.narrow(0, lo, count) for b in (self.A, self.Bt, gA, gBt, *self.moments)]
        return views

    def views(self, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A[slot, :rank], self.Bt[slot, :rank].t()

    def put(self, slot: int, A: torch.Tensor, B: torch.Tensor) -> None:
        """The adapter's A [r, in] and B [out, r] become views of `slot`; a gradient they carry moves in too."""
        rank = A.shape[0]
        if A.shape != (rank, self.in_features) or B.shape != (self.out_features, rank):
            raise ValueError(f"A {list(A.shape)} and B {list(B.shape)} do not fit a [{self.out_features} x {self.in_features}] layer")
        self.clear(slot)
        grads = (A.grad, B.grad)
        A_view, B_view = self.views(slot, rank)
        adopt(A, A_view)
        adopt(B, B_view)
        self.owners[slot] = (A, B, rank)
        if any(g is not None for g in grads):
            gA, gB = self.grads()
            for tensor, grad, view in ((A, grads[0], gA[slot, :rank]), (B, grads[1], gB[slot, :, :rank])):
                if grad is not None:
                    view.copy_(grad)
                    tensor.grad = view

    def clear(self, slot: int) -> None:
        """Free `slot`: its tensors get storage of their own again, and its rows are zero for the next adapter."""
        owner = self.owners.pop(slot, None)
        self._grad_views.pop(slot, None)
        if owner is not None:
            release(owner[0])
            release(owner[1])
        for moment in self.moment_owners.pop(slot, ()):
            release(moment)
        with torch.no_grad():
            for buffer in (self.A, self.Bt, self.grad_A, self.grad_Bt, *(self.moments or ())):
                if buffer is not None:
                    buffer[slot].zero_()

    def link_grads(self, slots: Iterable[int]) -> None:
        """Before a backward adds into these slots' gradient rows: each trainable owner's `.grad` becomes the view of
        its rows, holding what it held (nothing: zero, after the optimizer cleared it; a tensor put there by a
        restore or a rank's all-reduce: its values)."""
        cleared: tuple[list[int], list[int]] = ([], [])  # slots whose A or B gradient starts from zero
        with torch.no_grad():
            for slot in slots:
                owner = self.owners.get(slot)
                if owner is None:
                    continue
                A, B, rank = owner
                for tensor, view, zeroed in zip((A, B), self._grad_view(slot, rank), cleared):
                    grad = tensor.grad
                    if grad is view or not tensor.requires_grad:
                        continue  # linked already (the usual case): the kernel adds in place
                    if grad is None:
                        zeroed.append(slot)
                    elif grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride():
                        view.copy_(grad)
                    tensor.grad = view
            # after an optimizer step every stepped run's rows start from zero: one fill per buffer, not one per run
            # (whole slot rows: past a slot's rank they are zero already)
            for buffer, zeroed in zip((self.grad_A, self.grad_Bt), cleared):
                if zeroed and buffer is not None:
                    index = to_device(torch.tensor(zeroed, dtype=torch.long), buffer.device)  # pinned, no sync
                    buffer.index_fill_(0, index, 0.0)

    def _grad_view(self, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        views = self._grad_views.get(slot)
        if views is None:
            gA, gB = self.grads()
            views = self._grad_views[slot] = (gA[slot, :rank], gB[slot, :, :rank])
        return views

    def resize(self, capacity: int, rank: int) -> None:
        """Grow to `capacity` slots of rank `rank`, the owners' tensors (and linked gradients) moved along."""
        old_A, old_Bt, old_gA, old_gBt = self.A, self.Bt, self.grad_A, self.grad_Bt
        slots, ranks, rank = old_A.shape[0], old_A.shape[1], rank * self.rows_per_rank
        self.A = torch.zeros(capacity, rank, self.in_features, device=self.device)
        self.Bt = torch.zeros(capacity, rank, self.out_features, device=self.device)
        self.A[:slots, :ranks] = old_A
        self.Bt[:slots, :ranks] = old_Bt
        self.grad_A = self.grad_Bt = None
        self._grad_views.clear()
        self._ranges.clear()
        if old_gA is not None and old_gBt is not None:
            gA, gBt = torch.zeros_like(self.A), torch.zeros_like(self.Bt)
            gA[:slots, :ranks] = old_gA
            gBt[:slots, :ranks] = old_gBt
            self.grad_A, self.grad_Bt = gA, gBt
        if self.moments is not None:  # the moments' rows move along, and their owners' views with them
            old_moments, self.moments = self.moments, self._new_moments()
            for old, new in zip(old_moments, self.moments):
                new[:slots, :ranks] = old
            for slot, owned in self.moment_owners.items():
                for tensor, view in zip(owned, self.moment_views(slot, owned[0].shape[0])):
                    tensor.data = view
        for slot, (A, B, r) in self.owners.items():
            A_view, B_view = self.views(slot, r)
            for tensor, view, grad_view in ((A, A_view, None if self.grad_A is None else self.grad_A[slot, :r]),
                                            (B, B_view, None if self.grad_Bt is None else self.grad_Bt[slot, :r].t())):
                old_grad = tensor.grad
                tensor.data = view
                if old_grad is not None and grad_view is not None and _shares(old_grad, old_gA, old_gBt):
                    tensor.grad = grad_view  # its values came with the rows


    def _new_moments(self) -> list[torch.Tensor]:
        return [torch.zeros_like(self.A), torch.zeros_like(self.A), torch.zeros_like(self.Bt), torch.zeros_like(self.Bt)]

def _shares(grad: torch.Tensor, *buffers: torch.Tensor | None) -> bool:
    """Whether `grad` is a view into one of these buffers."""
    return any(b is not None and grad.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in buffers)


@dataclass
class BaseSlots:
    """The slot indices of one base: which adapter holds which slot, shared by every wrapped layer."""

    capacity: int = 0
    rank: int = 0  # R: the largest rank any buffer holds
    occupants: dict[str, Occupant] = field(default_factory=dict)
    layers: dict[str, LayerSlots] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    experts: BaseSlots | None = None  # the expert targets' own slots (`expert_slots`), made when a run first has some

    def slot_of(self, key: str) -> int | None:
        occupant = self.occupants.get(key)
        return None if occupant is None else occupant.slot

    def attach(self, key: str, layers: Mapping[str, object], weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
               rank: int, scaling: float, dropout: float, trainable: bool) -> Occupant:
        """Give `key` a slot and make its tensors views of it (its values kept). Again for a key attached already:
        its new tensors take its slot."""
        if key in self.occupants:
            self.detach(key)
        if not weights:
            raise ValueError(f"{key}: no LoRA matrices to attach")
        device = next(iter(weights.values()))[0].device
        slot = self._take(rank)
        for path, (A, B) in weights.items():
            layer = cast(Wrappable, layers[path])  # a Linear target's wrapper, or an expert target in `experts`'
            if layer.lora is None:
                layer.lora = LayerSlots(layer.in_features, layer.out_features, self.capacity, self.rank, device,
                                        getattr(layer, "rows_per_rank", 1))
                self.layers[path] = layer.lora
            layer.lora.put(slot, A, B)
        occupant = Occupant(key, slot, rank, scaling, dropout, dict(weights), trainable)
        self.occupants[key] = occupant
        return occupant

    def expert_slots(self) -> BaseSlots:
        """The slots of this base's expert targets, made on first use."""
        if self.experts is None:
            self.experts = BaseSlots()
        return self.experts

    def grads_linked(self, occupant: Occupant) -> bool:
        """Whether the occupant's `.grad` are the views of its gradient rows (`LayerSlots.link_grads` made them so in
        its last pass): then an optimizer tick need not link them again. A run's gradients are put whole or not at
        all (a pass links all, a restore or a split call's backup puts all back, a step or a drop clears all), so its
        first matrix speaks for the rest: a tick touches one parameter's `.grad` a run, whose objects a pass has
        pushed out of the CPU's caches (~1 us a parameter)."""
        path, (A, B) = next(iter(occupant.weights.items()))
        views = self.layers[path]._grad_views.get(occupant.slot)
        return views is not None and A.grad is views[0] and B.grad is views[1]

    def detach(self, key: str) -> None:
        """Free `key`'s slot; its tensors keep their values in storage of their own."""
        occupant = self.occupants.pop(key, None)
        if occupant is None:
            return
        for path in occupant.weights:
            layer = self.layers.get(path)
            if layer is not None:
                layer.clear(occupant.slot)
        self.free.append(occupant.slot)

    def _take(self, rank: int) -> int:
        """A free slot, the buffers grown first when none is free or `rank` is past R."""
        if not self.free or rank > self.rank:
            capacity = self.capacity if self.free else self.capacity + max(GROWTH_MIN, self.capacity // 2)
            new_rank = max(self.rank, rank)
            for layer in self.layers.values():
                layer.resize(capacity, new_rank)
            self.free.extend(range(self.capacity, capacity))
            self.capacity, self.rank = capacity, new_rank
        self.free.sort()
        return self.free.pop(0)
