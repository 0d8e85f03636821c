"""Every run's AdamW, built in one place: live steps, replay, restore and every rank step alike, so restores are bitwise.

torch's fused kernel is about 3x faster than its foreach one for a run's ~240 small LoRA tensors
(bench/cobatch.py). Its bits differ from the unfused kernels', so the choice is made here, once per
device, and made again after `load_state_dict` (which puts back the saved group's `fused`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache

import torch

LEARNING_RATE = 1e-4  # a placeholder: every optim_step sets the call's own settings on the groups


@cache
def fused_on(device_type: str) -> bool:
    """Whether torch has a fused AdamW kernel for this device type (the CPU has one since torch 2.4)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a private helper: a torch without it gets the portable kernel
        return False
    return device_type in _get_fused_kernels_supported_devices()


def new_adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    """A run's AdamW over its fp32 LoRA matrices: fused where the device has the kernel."""
    params = list(params)
    fused = bool(params) and fused_on(params[0].device.type)
    return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=fused or None)


def restore_fused(optimizer: torch.optim.Optimizer) -> None:
    """After `load_state_dict`: set `fused` again as `new_adamw` chose it (the saved groups may say otherwise, e.g.
    a snapshot written before this module), and keep each `step` where the fused kernel wants it."""
    for group in optimizer.param_groups:
        params = group["params"]
        fused = bool(params) and fused_on(params[0].device.type)
        group["fused"] = fused or None
        group["foreach"] = None  # torch refuses fused and foreach together
        if not fused:
            continue
        for param in params:
            state = optimizer.state.get(param)
            if state and torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


FUSED, PORTABLE, SLOTS = "fused", "portable", "slots"  # the kernels a journal's optim_step records name


def state_to_save(optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """`state_dict()` with tensors of their own: a slotted run's moments are views of a base's buffers, whose whole
    storage torch.save would write."""
    saved = optimizer.state_dict()
    saved["state"] = {i: {name: value.clone() if torch.is_tensor(value) else value for name, value in state.items()}
                      for i, state in saved["state"].items()}
    return saved


def kernel_of(optimizer: torch.optim.Optimizer) -> str:
    return FUSED if any(group.get("fused") for group in optimizer.param_groups) else PORTABLE


@contextmanager
def kernel(optimizer: torch.optim.Optimizer, name: str | None) -> Iterator[None]:
    """Step with the kernel a journal record names: records written before the fused kernel (none named) replay
    with torch's default one, so a restored run's weights equal the live run's bit for bit."""
    if name is None or name == kernel_of(optimizer):
        yield
        return
    saved = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = (True, None) if name == FUSED else (None, None)
    try:
        yield
    finally:
        for group, (fused, foreach) in zip(optimizer.param_groups, saved):
            group["fused"], group["foreach"] = fused, foreach
