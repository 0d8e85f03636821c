"""Model surgery: which Linear layers a base has for LoRA to target, wrapping them in `MultiLoraLinear` (the layer,
gpu_runtime/compute/lora/layer.py), and a run's fresh A and B for each, as PEFT initialises them."""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu_runtime.compute.lora.experts import ExpertTarget, expert_parameter_names, wrap_experts
from gpu_runtime.compute.lora.layer import MultiLoraLinear, Routing

LoraTarget = MultiLoraLinear | ExpertTarget  # what a run's matrices hang off: a Linear layer or a 3-D expert parameter


def linear_module_names(model: nn.Module, unembedding: bool = False) -> set[str]:
    """Leaf names of the Linear layers in the model (q_proj, up_proj, …); the output projection (lm_head) among
    them only with `unembedding` (what LoRA may target in the runtime: a switch of its own, train_unembed)."""
    names = set()
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, MultiLoraLinear)) and (unembedding or not _is_unembedding(model, path)):
            names.add(path.rsplit(".", 1)[-1])
    return names | expert_parameter_names(model)  # mixture-of-experts weights (gate_up_proj, down_proj), not Linear


def _is_unembedding(model: nn.Module, path: str) -> bool:
    output = getattr(model, "get_output_embeddings", lambda: None)()
    return path.endswith("lm_head") or (output is not None and model.get_submodule(path) is output)


def wrap_targets(model: nn.Module, targets: list[str], routing: Routing) -> dict[str, LoraTarget]:
    """Replace every Linear whose leaf name is in `targets` by a MultiLoraLinear (idempotent); return all wrapped.

    The unembedding (lm_head) is wrapped like any Linear. Where the base ties it to the input embedding (SmolLM2
    does), the wrapper keeps the one shared weight as its base layer and adds the delta to its output alone: the
    input embedding stays the base's, as if the two were untied (merging.py unties them when it folds the delta in).
    """
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(module, nn.Linear):
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
            setattr(parent, leaf, MultiLoraLinear(module, path, routing))
    layers: dict[str, LoraTarget] = {path: m for path, m in model.named_modules() if isinstance(m, MultiLoraLinear)}
    layers.update(wrap_experts(model, targets, routing))  # expert parameters: experts.py
    return layers


def init_lora(layers: dict[str, LoraTarget], targets: list[str], r: int, alpha: float, seed: int,
              device: torch.device) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """Fresh fp32 A/B per targeted layer, as PEFT initialises them (A Kaiming-uniform, B zero), from `seed` alone."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights = {}
    for path in sorted(layers):
        layer = layers[path]
        if path.rsplit(".", 1)[-1] not in targets:
            continue
        rows = r * getattr(layer, "num_experts", 1)  # an expert target: PEFT's [experts·r, in] and [out, r·experts]
        A = torch.empty(rows, layer.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        B = torch.zeros(layer.out_features, rows, dtype=torch.float32)
        weights[path] = (nn.Parameter(A.to(device)), nn.Parameter(B.to(device)))
    return weights
