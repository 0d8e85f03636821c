"""The engine contract's plain constants, shared by the engine and the server (no torch here)."""

from __future__ import annotations

ADAM_DEFAULTS: dict[str, float] = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 1.0,  # 0 turns clipping off
}

SAVE_MODES = ("adapter", "merged", "state")
