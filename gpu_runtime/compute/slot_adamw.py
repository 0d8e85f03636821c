"""The slotted optimizer tick (the "slots" kernel): AdamW for every run stepping on a base over the base's slot
buffers (compute/lora/slots.py), a fixed handful of ops a tick however many runs step.

A run's parameters, gradients and moments are rows of one buffer per layer and matrix ([slots, R, width]), so a tick
divides and clips the rows of all the runs stepping at once (each run's normaliser and clip norm a per-slot fp32
column broadcast over its rows), measures every run's norm in one reduction, and steps them with torch's fused AdamW
over the buffers' rows: one call per distinct setting (each tensor carries its run's step count), one view per buffer
where the runs' slots are consecutive and their step counts alike, else one per run and buffer. Rows past a run's
rank are zero and stay zero (zero gradient, zero moments). Runs sharing a setting step in one call whatever their
steps: a tick of runs that use the default setting dispatches as many torch ops for 8 runs as for one.

The norm is summed per row across the buffers, then over the rows in order (a cumsum: zero rows add nothing), so a
run's bits depend on nothing else in the buffers: not the runs beside it, their ranks (R) or the slot count, and
live and replay agree bit for bit on the CPU (whose cumsum is sequential); on CUDA while R is the same (its cumsum
is a parallel scan). The update is torch's fused kernel, elementwise; only the norm's summation order differs from
the "fused" kernel's (per tensor, then stacked), so the two agree within fp32 rounding of the clip coefficient
(tests/gpu_runtime/test_optim_slots.py), and journal records naming "fused" still replay through it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch

from gpu_runtime.compute.lora.ops.tables import to_device
from gpu_runtime.compute.lora.slots import BaseSlots, LayerSlots, Occupant

CLIP_EPS = 1e-6  # torch's clip_grad_norm_ adds it to the norm
SETTING_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay")  # in _fused_adamw_'s argument order below


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
        self.slots = [s.occupant.slot for s in self.steps]
        self.device = self.layers[0].A.device
        self.grads: list[torch.Tensor] = []  # the runs' gradient rows, A then Bᵀ, layer by layer: [k, R, width] each
        self.links: list[_Link] = []
        self.gathered = False  # whether `grads` are copies of the rows (the runs' slots not consecutive)

    @torch.no_grad()
    def begin(self) -> torch.Tensor:
        """Link the runs' gradients and moments into their rows, divide the gradients by their normalisers, clip them;
        returns the runs' norms (in `steps` order) on the device."""
        # gradients put back by a restore (or none yet) move into the rows; after a pass they are there already
        unlinked = [s.occupant.slot for s in self.steps if not self.base.grads_linked(s.occupant)]
        if unlinked:
            for layer in self.layers:
                layer.link_grads(unlinked)
        self.links = [_link(step, self.base) for step in self.steps]
        k = len(self.slots)
        self.gathered = not _consecutive(self.slots)
        if not self.gathered:  # in place, as views of the buffers
            self.grads = [view for layer in self.layers for view in layer.slot_range(self.slots[0], k)[2:4]]
        else:  # gathered: the fused step below reads them, and the buffers' rows are cleared after it anyway
            index = to_device(torch.tensor(self.slots), self.device)
            self.grads = [g.index_select(0, index) for layer in self.layers for g in _grads(layer)]
        host = torch.tensor([[s.normaliser for s in self.steps],
                             [s.settings["grad_clip_norm"] or math.inf for s in self.steps]], dtype=torch.float32)
        columns = to_device(host, self.device).view(2, k, 1, 1)
        n = len(self.grads)
        # a division or multiply by exactly 1.0 changes no bit: skipped where every run's is (decided on the host)
        if any(s.normaliser != 1.0 for s in self.steps):
            torch._foreach_div_(self.grads, [columns[0]] * n)
        norms = row_norms(self.grads)
        if any(s.settings["grad_clip_norm"] for s in self.steps):
            coefficients = torch.clamp((norms + CLIP_EPS).reciprocal() * columns[1].view(-1), max=1.0)
            torch._foreach_mul_(self.grads, [coefficients.view(-1, 1, 1)] * n)
        return norms

    @torch.no_grad()
    def step(self, finite: list[bool]) -> None:
        """torch's fused AdamW over the rows of the runs whose norm is finite, one call per distinct setting (each
        tensor with its run's step count): rows past a run's rank hold zeros, which AdamW keeps zero; other slots'
        rows are not touched."""
        together: dict[tuple[float, ...], list[int]] = {}
        for i, (step, ok) in enumerate(zip(self.steps, finite)):
            if ok:
                together.setdefault(tuple(step.settings[key] for key in SETTING_KEYS), []).append(i)
        stepped = [self.links[i] for members in together.values() for i in members]
        for link in stepped:
            link.count += 1
        if stepped:  # each run's count + 1 (exact in fp32), before the kernel reads it, as torch's adamw does
            torch._foreach_add_([link.step for link in stepped], 1.0)
        for (lr, beta1, beta2, eps, weight_decay), members in together.items():
            params, grads, exp_avgs, exp_avg_sqs, counts = self._rows(members)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], counts, amsgrad=False, lr=lr, beta1=beta1,
                                beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=False, grad_scale=None,
                                found_inf=None)
        self.grads = []

    def _rows(self, members: list[int]) -> tuple[list[torch.Tensor], ...]:
        """Parameters, gradients, exp_avg, exp_avg_sq and step counts of these runs (positions in `steps`), tensor for
        tensor: one view per buffer where their slots are consecutive and their counts alike, else one per run and
        buffer (each with its run's count: one call steps runs at different steps)."""
        slots = [self.slots[i] for i in members]
        links = [self.links[i] for i in members]
        if _consecutive(slots) and _consecutive(members) and all(link.count == links[0].count for link in links):
            ranges = [layer.slot_range(slots[0], len(slots)) for layer in self.layers]
            whole = len(members) == len(self.steps)  # every run of the group: its gradient rows as they are
            grads = self.grads if whole else [g.narrow(0, members[0], len(members)) for g in self.grads]
            counts = [links[0].step] * (2 * len(ranges))
        else:
            ranges = [layer.slot_range(slot, 1) for slot in slots for layer in self.layers]
            if self.gathered:  # the clipped gradients are the gathered copies' rows
                grads = [g.narrow(0, i, 1) for i in members for g in self.grads]
            else:  # in place: each run's rows of the buffers, views made once
                grads = [r[j] for r in ranges for j in (2, 3)]
            counts = [link.step for link in links for _ in range(2 * len(self.layers))]
        params = [r[j] for r in ranges for j in (0, 1)]
        exp_avgs = [r[j] for r in ranges for j in (4, 6)]
        exp_avg_sqs = [r[j] for r in ranges for j in (5, 7)]
        return params, grads, exp_avgs, exp_avg_sqs, counts


def _consecutive(values: list[int]) -> bool:
    return values == list(range(values[0], values[0] + len(values)))


def _grads(layer: LayerSlots) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.grad_A is not None and layer.grad_Bt is not None, "linked before a step"
    return layer.grad_A, layer.grad_Bt


def row_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Each slot's 2-norm over its rows of every buffer ([k, R, width] each): each row summed across the buffers (one
    cat), then the rows in order by a cumsum, so that neither R nor the other slots change a bit of it."""
    flat = torch.cat(grads, dim=2) if len(grads) > 1 else grads[0]
    return (flat * flat).sum(-1).cumsum(1)[:, -1].sqrt()


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
