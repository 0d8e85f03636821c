"""AdamW settings: defaults, validation, and applying them to a run's optimizer."""

from __future__ import annotations

import math
from typing import Any

import torch

from gpu_runtime.contract import ADAM_DEFAULTS
from gpu_runtime.errors import BadInput


# (lowest, highest, lowest allowed itself?) per setting.
_RANGES: dict[str, tuple[float, float, bool]] = {
    "learning_rate": (0.0, 10.0, False),
    "beta1": (0.0, 1.0, True),
    "beta2": (0.0, 1.0, True),
    "eps": (0.0, 1.0, False),
    "weight_decay": (0.0, 10.0, True),
    "grad_clip_norm": (0.0, math.inf, True),
}


def adam_settings(adam: Any) -> dict[str, float]:
    adam = {} if adam is None else adam
    if not isinstance(adam, dict):
        raise BadInput("adam must be an object of AdamW settings", field="adam")
    settings = dict(ADAM_DEFAULTS)
    for key, value in adam.items():
        if key not in ADAM_DEFAULTS:
            raise BadInput(f"unknown AdamW setting {key!r}; known: {sorted(ADAM_DEFAULTS)}", field=f"adam.{key}")
        if value is None:
            continue
        low, high, low_ok = _RANGES[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value >= low if low_ok else value > low) and (value < high if key.startswith("beta") else value <= high)
        if not ok:
            bound = f"{'[' if low_ok else '('}{low}, {high}{')' if key.startswith('beta') else ']'}"
            raise BadInput(f"adam.{key} must be a number in {bound}, got {value!r}", field=f"adam.{key}")
        settings[key] = float(value)
    return settings


def new_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    d = ADAM_DEFAULTS
    return torch.optim.AdamW(params, lr=d["learning_rate"], betas=(d["beta1"], d["beta2"]), eps=d["eps"], weight_decay=d["weight_decay"])


def apply_settings(optimizer: torch.optim.AdamW, settings: dict[str, float]) -> None:
    # Settings may change per call (learning-rate schedules live in the user's loop).
    for group in optimizer.param_groups:
        group["lr"] = settings["learning_rate"]
        group["betas"] = (settings["beta1"], settings["beta2"])
        group["eps"] = settings["eps"]
        group["weight_decay"] = settings["weight_decay"]
