"""The slotted optimizer tick (the "slots" kernel): AdamW for every run stepping on a base over the base's slot
buffers (compute/lora/slots.py), a fixed handful of multi-tensor ops a tick however many runs step.

A run's parameters, gradients and moments are rows of one buffer per layer and matrix ([slots, R, width]), so a tick
divides, measures, clips and steps the rows of all the runs stepping at once, each run's settings (normaliser, clip
norm, learning rate, betas, eps, weight decay, bias corrections) a per-slot fp32 column broadcast over its rows. Every
op is elementwise within a slot but the norm, summed per row over the width and then in order over (layer, row), the
layers sorted by path (a cumsum: the zero rows past a run's rank add nothing), so a run's bits depend on nothing else
in the buffers: not the runs beside it, their ranks (R) or the slot count. Live and replay agree bit for bit on the
CPU (whose cumsum is sequential); on CUDA while R is the same (its cumsum is a parallel scan).

Not torch's fused AdamW bit for bit (that is the "fused" kernel, which old journal records replay with): the norm is
summed per row and buffer rather than per tensor then stacked, and the second moment is a lerp; both agree within
fp32 rounding (tests/gpu_runtime/test_optim_slots.py).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from gpu_runtime.compute.lora.ops.tables import to_device
from gpu_runtime.compute.lora.slots import BaseSlots, LayerSlots, Occupant

CLIP_EPS = 1e-6  # torch's clip_grad_norm_ adds it to the norm


@dataclass
class SlotStep:
    """One run's optim_step in a slotted tick: where its rows are, its AdamW (whose state becomes views of them), its
    gradients' normaliser and the call's settings; `at`: its place in the tick's orders."""

    at: int
    occupant: Occupant
    optimizer: torch.optim.Optimizer
    normaliser: float
    settings: dict[str, float]


@dataclass
class _Link:
    """A run's moments as linked into its slot rows: valid while its optimizer state still holds these tensors."""

    occupant: Occupant
    first: torch.Tensor  # the first parameter's exp_avg view: a load_state_dict or state.clear() replaces it
    step: torch.Tensor  # the one step count every parameter's state shares (a device fp32 scalar, as fused keeps)
    count: int  # its value on the host: bias corrections need no device read


_links: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Link] = weakref.WeakKeyDictionary()


def slot_place(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, slots: BaseSlots | None,
               key: str) -> Occupant | None:
    """The run's slot when every parameter it steps lives in the base's slot buffers; None otherwise (expert LoRA,
    a sharded base, an AdamW with amsgrad or maximize): that run steps through torch's kernels."""
    occupant = None if slots is None else slots.occupants.get(key)
    if occupant is None or not occupant.trainable or 2 * len(occupant.weights) != len(params):
        return None
    if any(group.get("amsgrad") or group.get("maximize") for group in optimizer.param_groups):
        return None
    return occupant


def unlink(optimizer: torch.optim.Optimizer) -> None:
    """Before torch's kernels step a linked run: its state gets storage (and step counts) of its own again."""
    if _links.pop(optimizer, None) is None:
        return
    for state in optimizer.state.values():
        for name, value in list(state.items()):
            if torch.is_tensor(value):
                state[name] = value.clone()


class SlotGroup:
    """The runs stepping on one base with the same targeted layers: one pass of ops over those layers' buffers."""

    def __init__(self, base: BaseSlots, paths: list[str], steps: list[SlotStep]) -> None:
        self.base, self.steps = base, sorted(steps, key=lambda s: s.occupant.slot)
        self.layers: list[LayerSlots] = [base.layers[path] for path in sorted(paths)]
        slots = [s.occupant.slot for s in self.steps]
        self.lo, self.k = slots[0], len(slots)
        self.device = self.layers[0].A.device
        # the runs' rows: a narrow view when their slots are consecutive (in place), else gathered and put back
        self.index = None if slots == list(range(self.lo, self.lo + self.k)) else to_device(torch.tensor(slots), self.device)
        self.grads: list[torch.Tensor] = []
        self.links: list[_Link] = []

    def _rows(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.narrow(0, self.lo, self.k) if self.index is None else buffer.index_select(0, self.index)

    def _columns(self, rows: list[list[float]]) -> torch.Tensor:
        """Per-slot settings as [len(rows), k, 1, 1] fp32 on the device, in one host-to-device copy."""
        return to_device(torch.tensor(rows, dtype=torch.float32), self.device).view(len(rows), self.k, 1, 1)

    @torch.no_grad()
    def begin(self) -> torch.Tensor:
        """Link the runs' gradients and moments into their rows, divide the gradients by their normalisers, clip them;
        returns the runs' norms (in `steps` order) on the device."""
        slots = [s.occupant.slot for s in self.steps]
        for layer in self.layers:  # gradients put back by a restore (or none yet) move into the rows
            layer.link_grads(slots)
        self.links = [_link(step, self.base) for step in self.steps]
        self.grads = [self._rows(g) for layer in self.layers for g in (layer.grad_A, layer.grad_Bt) if g is not None]
        columns = self._columns([[s.normaliser for s in self.steps],
                                 [s.settings["grad_clip_norm"] or math.inf for s in self.steps]])
        n = len(self.grads)
        torch._foreach_div_(self.grads, [columns[0]] * n)
        norms = row_norms(self.grads)
        coefficients = torch.clamp((norms + CLIP_EPS).reciprocal() * columns[1].view(-1), max=1.0)
        torch._foreach_mul_(self.grads, [coefficients.view(-1, 1, 1)] * n)
        return norms

    @torch.no_grad()
    def step(self, finite: list[bool]) -> None:
        """AdamW on the rows of the runs whose norm is finite; the others' rows are left as they were."""
        columns: list[list[float]] = [[] for _ in range(6)]
        for i, (step, link, ok) in enumerate(zip(self.steps, self.links, finite)):
            if not ok:  # a no-op column: every op below leaves its rows' bits as they are
                for grad in self.grads:
                    grad[i].zero_()
                for column, noop in zip(columns, (1.0, 0.0, 0.0, 0.0, 1.0, 1.0)):
                    column.append(noop)
                continue
            s, count = step.settings, link.count + 1
            lr = s["learning_rate"]
            values = (1.0 - lr * s["weight_decay"], 1.0 - s["beta1"], 1.0 - s["beta2"],
                      lr / (1.0 - s["beta1"] ** count), math.sqrt(1.0 - s["beta2"] ** count), s["eps"])
            for column, setting in zip(columns, values):
                column.append(setting)
        decay, w1, w2, step_size, bc2_sqrt, eps = self._columns(columns)
        buffers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for layer in self.layers:  # in the gradients' order: A then Bᵀ, layer by layer
            assert layer.moments is not None, "linking made them"
            mA, vA, mBt, vBt = layer.moments
            buffers += [(layer.A, mA, vA), (layer.Bt, mBt, vBt)]
        params = [self._rows(b[0]) for b in buffers]
        m = [self._rows(b[1]) for b in buffers]
        v = [self._rows(b[2]) for b in buffers]
        n, g = len(params), self.grads
        torch._foreach_mul_(params, [decay] * n)  # AdamW's decoupled weight decay, first (torch's order)
        torch._foreach_lerp_(m, g, [w1] * n)
        torch._foreach_mul_(g, g)
        torch._foreach_lerp_(v, g, [w2] * n)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [bc2_sqrt] * n)
        torch._foreach_add_(denom, [eps] * n)
        update = torch._foreach_div(m, denom)
        torch._foreach_mul_(update, [step_size] * n)
        torch._foreach_sub_(params, update)
        if self.index is not None:
            for (p, mb, vb), rows in zip(buffers, zip(params, m, v)):
                for buffer, value in zip((p, mb, vb), rows):
                    buffer.index_copy_(0, self.index, value)
        for link, ok in zip(self.links, finite):
            if ok:
                link.count += 1
                link.step.fill_(float(link.count))
        self.grads = []


def row_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each slot's 2-norm over its rows of every buffer ([k, R, width] each): summed per row, then in order over
    (buffer, row) by a cumsum, so that neither R nor the other slots change a bit of it."""
    squares = torch._foreach_mul(grads, grads)
    rows = torch.stack([square.sum(-1) for square in squares], 1).flatten(1)  # [k, buffers * R]
    return rows.cumsum(1)[:, -1].sqrt()


def _link(step: SlotStep, base: BaseSlots) -> _Link:
    """The run's exp_avg and exp_avg_sq as views of its slot rows (their values moved in), every parameter's step
    one shared count; done once, again only after its state or its slot changed."""
    optimizer, occupant = step.optimizer, step.occupant
    first = optimizer.param_groups[0]["params"][0]
    link = _links.get(optimizer)
    state0 = optimizer.state.get(first)
    if link is not None and link.occupant is occupant and state0 is not None and state0.get("exp_avg") is link.first:
        return link
    held = None if state0 is None else state0.get("step")
    count = int(held.item()) if torch.is_tensor(held) else int(held or 0)  # a restore's count: read once, when linking
    shared = torch.tensor(float(count), dtype=torch.float32, device=first.device)
    for path, (A, B) in occupant.weights.items():
        layer = base.layers[path]
        views = layer.moment_views(occupant.slot, occupant.rank)
        for param, pair in ((A, views[:2]), (B, views[2:])):
            state = optimizer.state[param]
            for name, view in zip(("exp_avg", "exp_avg_sq"), pair):
                old = state.get(name)
                if old is None:
                    view.zero_()
                elif old is not view:
                    view.copy_(old)
                state[name] = view
            state["step"] = shared
        layer.moment_owners[occupant.slot] = views
    link = _links[optimizer] = _Link(occupant, optimizer.state[first]["exp_avg"], shared, count)
    return link


@dataclass
class SlotTick:
    """The slotted part of a tick: its runs grouped by base and targeted layers."""

    groups: list[SlotGroup] = field(default_factory=list)

    @classmethod
    def of(cls, steps: list[tuple[SlotStep, BaseSlots]]) -> SlotTick:
        grouped: dict[tuple[int, tuple[str, ...]], tuple[BaseSlots, list[SlotStep]]] = {}
        for step, base in steps:
            paths = tuple(sorted(step.occupant.weights))
            grouped.setdefault((id(base), paths), (base, []))[1].append(step)
        return cls([SlotGroup(base, list(paths), members) for (_, paths), (base, members) in grouped.items()])
