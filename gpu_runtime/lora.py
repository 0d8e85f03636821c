"""LoRA settings: validation against the base architecture, defaults, and the PEFT config."""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig
from transformers import PreTrainedModel

from gpu_runtime.errors import BadInput

# Attention projections by architecture family; the default targets are whichever the model has.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "out_proj")
LORA_KEYS = {"r", "alpha", "dropout", "target_modules"}
DEFAULT_R = 8
DEFAULT_ALPHA = 16.0
DEFAULT_DROPOUT = 0.0


def linear_module_names(model: PreTrainedModel) -> set[str]:
    """Leaf names of the layers LoRA can wrap (q_proj, up_proj, …)."""
    names = set()
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            names.add(path.rsplit(".", 1)[-1])
    return names


def default_target_modules(available: set[str]) -> list[str]:
    return [name for name in ATTENTION_PROJECTIONS if name in available]


def lora_settings(lora: Any, available: set[str]) -> dict[str, Any]:
    """Validate the user's LoRA dict and fill defaults; errors name the field (`lora.r`)."""
    lora = {} if lora is None else lora
    if not isinstance(lora, dict):
        raise BadInput(f"lora must be an object with r, alpha, dropout, target_modules, got {type(lora).__name__}", field="lora")
    for key in lora:
        if key not in LORA_KEYS:
            raise BadInput(f"unknown LoRA setting {key!r}; known: {sorted(LORA_KEYS)}", field=f"lora.{key}")
    r = lora.get("r", DEFAULT_R)
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 512:
        raise BadInput(f"lora.r must be an integer in 1..512, got {r!r}", field="lora.r")
    alpha = lora.get("alpha", DEFAULT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0 or alpha != alpha or alpha == float("inf"):
        raise BadInput(f"lora.alpha must be a number > 0, got {alpha!r}", field="lora.alpha")
    dropout = lora.get("dropout", DEFAULT_DROPOUT)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise BadInput(f"lora.dropout must be a number in [0, 1), got {dropout!r}", field="lora.dropout")
    targets = lora.get("target_modules")
    if targets is None:
        targets = default_target_modules(available)
        if not targets:
            raise BadInput("this architecture has no known attention projections; name lora.target_modules", field="lora.target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise BadInput("lora.target_modules must be a non-empty list of module names", field="lora.target_modules")
    missing = [t for t in targets if t not in available]
    if missing:
        raise BadInput(
            f"lora.target_modules {missing} not in this model; it has {sorted(available)}", field="lora.target_modules"
        )
    return {"r": r, "alpha": float(alpha), "dropout": float(dropout), "target_modules": sorted(set(targets))}


def lora_config(settings: dict[str, Any]) -> LoraConfig:
    return LoraConfig(
        r=settings["r"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=settings["target_modules"],
        bias="none",
        task_type="CAUSAL_LM",
    )
