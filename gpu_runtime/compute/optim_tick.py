"""One optimizer tick for every run stepping: their gradients divided, measured and clipped together, one host copy
of their norms, then their AdamW.

Runs whose LoRA lives in a base's slot buffers step by the slotted kernel ("slots", slot_adamw.py): a fixed handful
of ops over the buffers, whatever the number of runs. The rest (expert LoRA, a multi-GPU pool, records naming an
older kernel) step through torch's kernels as follows, one multi-tensor fused AdamW per distinct setting.

A run's step here is bit for bit the step its own `optimizer.step()` takes with torch's fused kernel: every op is
per tensor (a division by the run's normaliser, a norm, a multiply by the run's clip coefficient, the fused
kernel's update), so grouping runs changes no bit of any one run, and a journal's "fused" records replay alike
whether they stepped alone or beside others. Records naming another kernel ("portable": written before fused
AdamW) step through `optimizer.step()` under that kernel (`optimizer.kernel`).

torch's fused kernel takes one learning rate, one pair of betas and one found-inf flag per call, so the runs are
grouped by their settings (a shared default: one call), and a run whose norm is not finite is left out of the
call on the host, after the tick's one device-to-host copy (its gradients are dropped, as before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw

from gpu_runtime.compute.lora.ops.tables import to_device
from gpu_runtime.compute.lora.slots import BaseSlots, Occupant
from gpu_runtime.compute.optimizer import FUSED, SLOTS, kernel, kernel_of
from gpu_runtime.compute.slot_adamw import SETTING_KEYS, SlotStep, SlotTick, slot_place, unlink


@dataclass
class StepOrder:
    """One run's optim_step in a tick: its parameters and AdamW, its gradients' normaliser and the call's settings."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    normaliser: float
    settings: dict[str, float]
    kernel: str | None = None  # what a replayed journal record names; None: the optimizer's own
    slots: BaseSlots | None = None  # the base's slot buffers, where the run's rows may live (slot_adamw.py)
    key: str = ""  # the run's key there

    @property
    def grads(self) -> list[torch.Tensor]:
        return [param.grad for param in self.params if param.grad is not None]


def grad_norms(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each group's 2-norm over its tensors, on the device: one `_foreach_norm` over every tensor of every group,
    then torch's `clip_grad_norm_` reduction per group (its stack and vector_norm, so the bits are torch's)."""
    flat = [g for group in grads for g in group]
    per_tensor = list(torch._foreach_norm(flat, 2.0)) if flat else []
    totals, at = [], 0
    for group in grads:
        own = per_tensor[at:at + len(group)]
        at += len(group)
        totals.append(torch.linalg.vector_norm(torch.stack(own), 2.0) if own else torch.zeros(()))
    return totals


def clip_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """torch's clip coefficient, applied on the device whatever it is: a multiply by exactly 1.0 changes no bit, and
    deciding to skip it would cost a host sync."""
    if grads:
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)  # float / tensor: torch's own expression
        torch._foreach_mul_(grads, coefficient)


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` bit for bit, with no host sync: the norm stays a device tensor."""
    (total,) = grad_norms([grads])
    clip_(grads, total, max_norm)
    return total


def optimizer_tick(orders: list[StepOrder]) -> list[float]:
    """AdamW for every order on its summed gradients over its normaliser, clipped; clears their gradients. Returns
    each order's gradient norm; a non-finite one skips that run's step (its gradients are dropped all the same).
    Runs whose parameters live in slot buffers step by the slotted kernel (slot_adamw.py), the others as before."""
    slotted: list[tuple[SlotStep, BaseSlots]] = []
    legacy: list[StepOrder] = []
    legacy_at: list[int] = []
    for at, order in enumerate(orders):
        occupant = own_place(order)
        if occupant is not None and order.slots is not None:
            slotted.append((SlotStep(at, occupant, order.optimizer, order.normaliser, order.settings), order.slots))
        else:
            legacy.append(order)
            legacy_at.append(at)
    tick = SlotTick.of(slotted)
    device_norms = [_legacy_begin(legacy)] if legacy else []
    device_norms += [group.begin() for group in tick.groups]
    # the tick's one device-to-host copy
    flat: list[float] = torch.cat(device_norms).tolist() if device_norms else []
    norms = [0.0] * len(orders)
    legacy_norms, at = flat[:len(legacy)], len(legacy)
    for at, norm in zip(legacy_at, legacy_norms):
        norms[at] = norm
    for group in tick.groups:
        own = flat[at:at + len(group.steps)]
        at += len(group.steps)
        for step, norm in zip(group.steps, own):
            norms[step.at] = norm
        group.step([math.isfinite(norm) for norm in own])
    _legacy_step(legacy, legacy_norms)
    for order in orders:  # what `zero_grad(set_to_none=True)` does, without its per-call profiler scope
        for param in order.params:
            param.grad = None
    return norms


def own_place(order: StepOrder) -> Occupant | None:
    """The order's slot where it steps by the slotted kernel: its record names it or none, and its rows are there."""
    if order.kernel not in (None, SLOTS):
        return None
    return slot_place(order.params, order.optimizer, order.slots, order.key)


def own_kernel(order: StepOrder) -> str:
    """The kernel this order steps with, as its journal record names it."""
    return SLOTS if own_place(order) is not None else (order.kernel or kernel_of(order.optimizer))


def _legacy_begin(orders: list[StepOrder]) -> torch.Tensor:
    """Torch's kernels' part before the host copy: each run divided, measured and clipped per tensor; their norms."""
    grads = [order.grads for order in orders]
    flat = [g for group in grads for g in group]
    # each run's normaliser and clip norm, in one host-to-device copy (pinned on CUDA: no sync)
    host = torch.tensor([order.normaliser for order in orders]
                        + [order.settings["grad_clip_norm"] or math.inf for order in orders], dtype=torch.float32)
    device = flat[0].device if flat else host.device
    per_run = to_device(host, device).view(2, -1)
    for i, group in enumerate(grads):
        if group:  # summed token losses → their mean over all calls; by an fp32 0-dim tensor: the scalar's bits, and
            torch._foreach_div_(group, per_run[0, i])  # a third of a Python scalar's per-tensor cost on the CPU
    stacked = torch.stack(grad_norms(grads))
    if flat:
        # every run's clip coefficient in one expression, torch's own (`float / tensor` is `reciprocal() * float`)
        coefficients = torch.clamp((stacked + 1e-6).reciprocal() * per_run[1], max=1.0)
        for i, group in enumerate(grads):
            if group:  # a multiply by exactly 1.0 changes no bit; skipping it would cost a host sync
                torch._foreach_mul_(group, coefficients[i])
    return stacked.to(torch.float32)


def _legacy_step(orders: list[StepOrder], norms: list[float]) -> None:
    fused: dict[tuple[float, ...], list[StepOrder]] = {}
    for order, norm in zip(orders, norms):
        if not math.isfinite(norm):
            continue
        unlink(order.optimizer)  # a run the slotted kernel stepped before: its state its own again
        _set_settings(order.optimizer, order.settings)
        # a "slots" record where the run's rows are not in slots (a multi-GPU pool): its update kernel, fused
        name = FUSED if order.kernel == SLOTS else order.kernel
        if (name or kernel_of(order.optimizer)) == FUSED:
            fused.setdefault(tuple(order.settings[k] for k in SETTING_KEYS), []).append(order)
        else:
            with kernel(order.optimizer, name):
                order.optimizer.step()
    for together in fused.values():
        _fused_adamw(together)


def _set_settings(optimizer: torch.optim.Optimizer, settings: dict[str, float]) -> None:
    for group in optimizer.param_groups:  # settings may change per call: schedules live in the user's loop
        group["lr"] = settings["learning_rate"]
        group["betas"] = (settings["beta1"], settings["beta2"])
        group["eps"] = settings["eps"]
        group["weight_decay"] = settings["weight_decay"]


@torch.no_grad()
def _fused_adamw(orders: list[StepOrder]) -> None:
    """torch's functional AdamW with the fused kernel over every order's parameters (their groups share settings):
    what each optimizer's `step()` does, state initialised the same way (`_init_group`), in one call."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    first = orders[0].optimizer.param_groups[0]
    for order in orders:
        for group in order.optimizer.param_groups:
            fused, group["fused"], group["foreach"] = group.get("fused"), True, None  # _init_group's state for fused
            try:
                order.optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs,  # type: ignore[attr-defined]  # torch's private helper: the state step() would make
                                            max_exp_avg_sqs, steps)
            finally:
                group["fused"] = fused
    if not params:
        return
    beta1, beta2 = first["betas"]
    adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=None, capturable=first["capturable"],
          differentiable=False, fused=True, amsgrad=first["amsgrad"], beta1=beta1, beta2=beta2, lr=first["lr"],
          weight_decay=first["weight_decay"], eps=first["eps"], maximize=first["maximize"])
