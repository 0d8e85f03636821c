"""LoRA on mixture-of-experts layers: every expert's projections, each run with its own A and B per expert.

transformers 5.x keeps a MoE layer's experts as 3-D parameters (`experts.gate_up_proj` [experts, 2·intermediate,
hidden], `experts.down_proj`), not Linear layers, on a module that its `use_experts_implementation` decorator
describes (has_gate, has_bias, is_transposed, `_apply_gate`). `MultiLoraExperts` replaces such a module, keeps it as
its `base_layer`, and computes its forward with each targeted parameter's delta added: the (token, expert) pairs are
sorted into (expert, run) segments and each target's delta is `grouped_expert_lora` over them (ops.py).

A run's matrices for one target are PEFT's own (`target_parameters`, peft's ParamWrapper), so its files load in
`PeftModel.from_pretrained` as they are: A [experts·r, in] (expert e's rows e·r…e·r+r) and B [out, r·experts]
(expert e's columns e, e+experts, …). A parameter stored [experts, out, in] and one stored transposed
[experts, in, out] (GPT-OSS) take the same delta `x A_eᵀ B_eᵀ`.

The runs' matrices live in slot buffers, one per target (compute/lora/slots.py: A [slots, E·R, in], Bᵀ [slots, R·E,
out], the base's `expert_slots`): a run's A and B are views of its slot, the kernels read every run's experts from the
buffers in place, and weight gradients are added into the buffers' gradient rows, which are the runs' `.grad`, as
for Linear layers. A pass copies no run's matrices.

Dropout masks are drawn per token as `MultiLoraLinear._dropout_mask` draws them (keyed by the run's seed and the
target's path, at the call's shape), so co-batching, replay and resume draw the same ones; a token's routed copies
share its mask.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpu_runtime.compute.lora.layer import MultiLoraLinear, Routing, Segment
from gpu_runtime.compute.lora.ops import build_expert_tables, grouped_expert_lora
from gpu_runtime.compute.lora.slots import BaseSlots, LayerSlots, Occupant

# The expert parameters LoRA may target, in the order PEFT nests its wrappers for them (the first innermost).
EXPERT_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj")


def is_experts_module(module: nn.Module) -> bool:
    """A module transformers' `use_experts_implementation` describes, holding 3-D expert weights."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and any(
        isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3
        for name in EXPERT_PARAMETERS)


def expert_parameter_names(model: nn.Module) -> set[str]:
    """The expert parameters (gate_up_proj, down_proj, …) this model has, by name: what LoRA may target."""
    names: set[str] = set()
    for _, module in model.named_modules():
        experts = module.base_layer if isinstance(module, MultiLoraExperts) else module
        if is_experts_module(experts):
            names.update(n for n in EXPERT_PARAMETERS if isinstance(getattr(experts, n, None), nn.Parameter))
    return names


def attach_experts(slots: BaseSlots, key: str, layers: Mapping[str, Any],
                   weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]], rank: int, scaling: float, dropout: float,
                   trainable: bool) -> None:
    """A run's (or a snapshot's) expert matrices into a slot of the base's expert buffers (its tensors become views)."""
    if weights:
        slots.expert_slots().attach(key, layers, weights, rank, scaling, dropout, trainable)


def detach_experts(slots: BaseSlots, key: str) -> None:
    """Free the key's expert slot; its tensors keep their values in storage of their own."""
    if slots.experts is not None:
        slots.experts.detach(key)


class ExpertTarget:
    """One 3-D expert parameter as a LoRA target: the runs' A/B (PEFT's layout, above) by routing key."""

    def __init__(self, experts: nn.Module, parameter: str, path: str) -> None:
        self.parameter = parameter
        self.name = path  # the module's path and the parameter's name: keys the dropout masks
        self.name_seed = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little") >> 1
        self.lora: LayerSlots | None = None  # the runs' slot buffers (BaseSlots.experts), made at the first attach
        weight: torch.Tensor = getattr(experts, parameter)
        self.transposed = bool(experts.is_transposed)
        self.num_experts = int(weight.shape[0])
        self.rows_per_rank = self.num_experts  # a run of rank r holds E·r rows of A (and of Bᵀ)
        self.in_features, self.out_features = ((int(weight.shape[1]), int(weight.shape[2])) if self.transposed
                                               else (int(weight.shape[2]), int(weight.shape[1])))

    def delta_weight(self, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
        """scaling · B_e A_e for every expert, in the parameter's own layout: what merging folds in."""
        r = A.shape[0] // self.num_experts
        a = A.float().view(self.num_experts, r, self.in_features)
        b = B.float().view(self.out_features, r, self.num_experts).permute(2, 0, 1)
        delta = torch.bmm(b, a) * scaling  # [experts, out, in]
        return delta.transpose(1, 2) if self.transposed else delta


class MultiLoraExperts(nn.Module):
    """A MoE layer's experts module with the co-batched runs' LoRA on its targeted parameters."""

    def __init__(self, base_layer: nn.Module, path: str, routing: Routing) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.routing = routing
        self.targets = {name: ExpertTarget(base_layer, name, f"{path}.{name}") for name in EXPERT_PARAMETERS
                        if isinstance(getattr(base_layer, name, None), nn.Parameter)}
        self.rows = 0  # the batch rows of the current pass: set by a hook on the MoE block, which sees [rows, tokens, hidden]

    def remember_rows(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else next(iter(kwargs.values()))
        self.rows = int(hidden.shape[0]) if hidden.dim() == 3 else 0

    # A shared expert sees the block's flattened [tokens, hidden]; its Linear layers route by batch row, so it gets
    # [rows, tokens, hidden] back (and its output flattened again), exactly as a dense MLP's layers see it.
    def unflatten(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        hidden = args[0] if args else None
        if hidden is None or hidden.dim() != 2 or not self.rows or hidden.shape[0] % self.rows:
            return None
        return (hidden.view(self.rows, -1, hidden.shape[-1]), *args[1:])

    def flatten(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.dim() == 3 and args and args[0].dim() == 3:
            return output.reshape(-1, output.shape[-1])
        return None


    def _segments(self) -> list[Segment]:
        """The pass's segments; in a decode step (per-row routing) each run of rows of one key, read from row_keys."""
        routing = self.routing
        if routing.row_slots is None:
            return routing.segments
        segments: list[Segment] = []
        for i, key in enumerate(routing.row_keys or []):
            if not key:
                continue
            if segments and segments[-1].key == key and segments[-1].end == i:
                segments[-1].end = i + 1
            else:
                segments.append(Segment(key, i, i + 1))
        return segments

    def _occupants(self) -> dict[str, Occupant]:
        slots = self.routing.slots.experts
        return {} if slots is None else slots.occupants

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        occupants = self._occupants()
        runs = [s for s in self._segments() if s.key in occupants
                and any(t.lora is not None and t.lora.holds(occupants[s.key].slot) for t in self.targets.values())]
        if not runs:  # the plain base, exactly as transformers computes it
            out: torch.Tensor = self.base_layer(hidden, top_k_index, top_k_weights)
            return out
        return self._forward(hidden, top_k_index, top_k_weights, runs)

    def _forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 runs: list[Segment]) -> torch.Tensor:
        base: Any = self.base_layer  # transformers' experts module: has_gate, _apply_gate, act_fn are its own
        tokens, k = top_k_index.shape
        num_experts = next(iter(self.targets.values())).num_experts
        per_row = tokens // self.rows if self.rows and tokens % self.rows == 0 else 1
        # Each token's run (len(runs): none); the pairs sorted by (expert, run), counted on the host once per layer.
        run_of_row = torch.full((max(tokens // per_row, 1),), len(runs), dtype=torch.long)
        for i, segment in enumerate(runs):
            run_of_row[segment.start : segment.end] = i
        token_run = run_of_row.to(x.device).repeat_interleave(per_row)
        pair_token = torch.arange(tokens, device=x.device).repeat_interleave(k)
        pair_expert = top_k_index.reshape(-1).clamp(0, num_experts - 1)
        key = pair_expert * (len(runs) + 1) + token_run[pair_token]
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=num_experts * (len(runs) + 1)).tolist()
        sorted_tokens = pair_token[order]
        xs = x[sorted_tokens]
        spans = _spans(counts, num_experts, len(runs) + 1)
        up_name = "gate_up_proj" if base.has_gate else "up_proj"
        h = self._project(up_name, xs, spans, runs, sorted_tokens, per_row)
        h = base._apply_gate(h) if base.has_gate else base.act_fn(h)
        y = self._project("down_proj", h, spans, runs, sorted_tokens, per_row)
        if getattr(base, "has_post_expert_norm", False):
            y = base.post_expert_norm(y)
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = y.new_zeros(tokens * k, y.shape[-1]).index_copy(0, order, y)
        return out.view(tokens, k, -1).sum(dim=1).to(x.dtype)

    def _project(self, name: str, xs: torch.Tensor, spans: list[list[tuple[int, int]]], runs: list[Segment],
                 sorted_tokens: torch.Tensor, per_row: int) -> torch.Tensor:
        """The base projection of every expert's rows, plus the delta of each run that targets `name`."""
        base: Any = self.base_layer
        weight: torch.Tensor = getattr(base, name)
        bias: torch.Tensor | None = getattr(base, f"{name}_bias", None) if base.has_bias else None
        pieces = []
        for expert, expert_spans in enumerate(spans):
            start, end = expert_spans[0][0], expert_spans[-1][1]
            if end == start:
                continue
            w = weight[expert]
            piece = xs[start:end] @ w if base.is_transposed else F.linear(xs[start:end], w)
            pieces.append(piece if bias is None else piece + bias[expert])
        out = torch.cat(pieces)
        target = self.targets.get(name)
        lora = None if target is None else target.lora
        if target is None or lora is None:
            return out
        occupants = self._occupants()
        here = [(i, s, occupants[s.key]) for i, s in enumerate(runs) if lora.holds(occupants[s.key].slot)]
        if not here:
            return out
        tables = build_expert_tables(
            [(a, b, o.slot, expert, o.rank, o.scaling) for expert, expert_spans in enumerate(spans)
             for i, _, o in here for a, b in [expert_spans[i]] if b > a],  # in row order: expert, then run
            target.num_experts, lora.A.shape[1] // target.num_experts, xs.device, total_rows=xs.shape[0])
        x32 = xs.to(lora.A.dtype)
        mask = self._mask(target, x32, runs, here, sorted_tokens, per_row)
        into = None
        if torch.is_grad_enabled():
            grad_A, grad_B = lora.grads()
            into = (grad_A, grad_B.transpose(1, 2))  # the expert kernels read Bᵀ's own layout, [slots, R·E, out]
        delta = grouped_expert_lora(x32, lora.A, lora.Bt, tables, mask, self.routing.kernel, grad_into=into)
        if delta.requires_grad:  # the runs' .grad become their rows of the gradient buffers as gradients arrive
            trainable = [o.slot for _, _, o in here if o.trainable]
            delta.register_hook(lambda _: lora.link_grads(trainable))
        return (out + delta).to(out.dtype)

    def _mask(self, target: ExpertTarget, xs: torch.Tensor, runs: list[Segment],
              here: list[tuple[int, Segment, Occupant]], sorted_tokens: torch.Tensor, per_row: int) -> torch.Tensor | None:
        """Each pair's dropout mask: its token's, drawn at the run's call shape as the Linear layers draw theirs."""
        drawn = [(s, o.dropout) for _, s, o in here]
        if not any(p > 0 and s.dropout_seed is not None for s, p in drawn):
            return None
        rows = max(s.end for s in runs)
        token_mask = xs.new_ones(rows, per_row, xs.shape[-1])
        for segment, p in drawn:
            if p > 0 and segment.dropout_seed is not None:
                shape = xs.new_empty(segment.end - segment.start, per_row, xs.shape[-1])
                # The Linear layer's own drawing (one source for the keying); it reads only name_seed off its layer.
                token_mask[segment.start : segment.end] = MultiLoraLinear._dropout_mask(cast(Any, target), shape, segment, p, xs.dtype)
        return token_mask.view(-1, xs.shape[-1]).index_select(0, sorted_tokens.clamp(max=rows * per_row - 1))


def _is_shared_expert(module: nn.Module) -> bool:
    """A dense MLP beside the experts (Qwen3.5-MoE's `shared_expert`): Linear projections, which the router is not."""
    return any(isinstance(m, (nn.Linear, MultiLoraLinear)) and name.rsplit(".", 1)[-1] in ("gate_proj", "up_proj", "down_proj")
               for name, m in module.named_modules())


def _spans(counts: list[int], num_experts: int, groups: int) -> list[list[tuple[int, int]]]:
    """Per expert, the rows [start, end) of each run group (the last: rows of no run) in the sorted pairs."""
    spans, cursor = [], 0
    for expert in range(num_experts):
        row = []
        for group in range(groups):
            count = counts[expert * groups + group]
            row.append((cursor, cursor + count))
            cursor += count
        spans.append(row)
    return spans


def wrap_experts(model: nn.Module, targets: Iterable[str], routing: Routing) -> dict[str, ExpertTarget]:
    """Wrap every experts module (idempotent), whatever `targets` names: its block's shared expert needs the wrapper's
    row count even when only the shared expert is targeted. Every wrapped one's targets, by path."""
    inside = {id(m.base_layer) for m in model.modules() if isinstance(m, MultiLoraExperts)}  # wrapped already
    for path, module in list(model.named_modules()):
        if id(module) in inside or not is_experts_module(module) or "." not in path:
            continue
        parent_path, leaf = path.rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        wrapper = MultiLoraExperts(module, path, routing)
        setattr(parent, leaf, wrapper)
        parent.register_forward_pre_hook(wrapper.remember_rows, with_kwargs=True)
        for child in parent.children():
            if child is not wrapper and _is_shared_expert(child):
                child.register_forward_pre_hook(wrapper.unflatten)
                child.register_forward_hook(wrapper.flatten)
    return {f"{path}.{name}": target for path, module in model.named_modules()
            if isinstance(module, MultiLoraExperts) for name, target in module.targets.items()}


# ---- PEFT's names for parameter targets ------------------------------------------------------------------------------

def is_expert_path(path: str) -> bool:
    """A run's target path that names an expert parameter (`…mlp.experts.gate_up_proj`), not a Linear layer."""
    parts = path.rsplit(".", 2)
    return len(parts) == 3 and parts[1] == "experts" and parts[2] in EXPERT_PARAMETERS


def peft_names(paths: Iterable[str]) -> dict[str, tuple[str, str]]:
    """PEFT's keys for each target's A and B. Parameter targets on one module nest (ParamWrapper in ParamWrapper):
    the first in EXPERT_PARAMETERS' order is innermost, one `.base_layer` deeper per wrapper outside it."""
    paths = list(paths)
    on_module: dict[str, list[str]] = {}
    for path in paths:
        if is_expert_path(path):
            module, name = path.rsplit(".", 1)
            on_module.setdefault(module, []).append(name)
    names = {}
    for path in paths:
        prefix = path
        if is_expert_path(path):
            module, name = path.rsplit(".", 1)
            present = [n for n in EXPERT_PARAMETERS if n in on_module[module]]
            prefix = module + ".base_layer" * (len(present) - 1 - present.index(name))
        names[path] = (f"base_model.model.{prefix}.lora_A.weight", f"base_model.model.{prefix}.lora_B.weight")
    return names


def target_parameters(paths: Iterable[str]) -> list[str]:
    """PEFT's `target_parameters` for these targets (`experts.gate_up_proj`, …), in its nesting order."""
    present = {path.rsplit(".", 1)[1] for path in paths if is_expert_path(path)}
    return [f"experts.{name}" for name in EXPERT_PARAMETERS if name in present]


def targeted_paths(layers: Iterable[str], target_modules: Iterable[str]) -> list[str]:
    """The paths a run with these leaf names holds matrices for, among a base's wrapped layers (init_lora's choice)."""
    leaves = set(target_modules)
    return sorted(path for path in layers if path.rsplit(".", 1)[-1] in leaves)
