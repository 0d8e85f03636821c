"""Expert LoRA in slot buffers (compute/lora/experts.py): co-batched runs of mixed ranks read their expert matrices
from one buffer per target in place, and their values and gradients equal each run computed alone through
transformers' own experts forward with the delta merged into the expert weights (an independent path, so within 1e-5
of each tensor's scale: merging rounds otherwise than x·Aᵀ·Bᵀ, ~1e-6 of the scale after two layers). The kernels
against today's stacked layout, within 1e-6: tests/gpu_runtime/test_lora_ops.py (test_grouped_expert_lora)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from torch.func import functional_call

from gpu_runtime.compute.lora.experts import MultiLoraExperts, attach_experts, detach_experts
from gpu_runtime.compute.lora.layer import Routing, Segment, routed
from gpu_runtime.compute.lora.wrap import wrap_targets
from tests.helpers.tiny_families import FAMILIES, INIT_STD, SHAPE

VOCAB = 97
TARGETS = ["gate_up_proj", "down_proj"]
# run key → (rank, alpha, its batch rows): mixed ranks, one run of one row
RUNS = {"a": (2, 4.0, (0, 2)), "b": (5, 5.0, (2, 3)), "c": (3, 9.0, (3, 5))}
TOKENS = 7


def assert_near(got: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    assert got.shape == expected.shape
    error = float((got - expected).abs().max()) / float(expected.abs().max())
    assert error <= tolerance, f"off by {error:.3g} of its scale"


def tiny_moe(family: str) -> nn.Module:
    config_name, model_name, own = FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, initializer_range=INIT_STD, **{**SHAPE, **own})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # some families initialise experts and routers to zero: every weight gets a spread
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed" not in name:
                param.normal_(0.0, INIT_STD * (3.0 if "router" in name or name.endswith("mlp.gate.weight") else 1.0))
    return model.float().eval()


def run_weights(layers: Mapping[str, Any], rank: int, seed: int) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """PEFT-shaped A [E·r, in] and B [out, r·E] per expert target, both non-zero so each side's gradient shows."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for path, layer in sorted(layers.items()):
        if not isinstance(layer, nn.Module):  # an expert target (ExpertTarget), not a Linear wrapper
            E, fan_in, fan_out = layer.num_experts, layer.in_features, layer.out_features
            A = torch.randn(E * rank, fan_in, generator=generator) / fan_in**0.5
            B = torch.randn(fan_out, rank * E, generator=generator) / rank**0.5
            weights[path] = (nn.Parameter(A), nn.Parameter(B))
    return weights


def merged_alone(plain: nn.Module, layers: Mapping[str, Any], weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 scaling: float, tokens: torch.Tensor, loss_weights: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One run alone: the unwrapped model with W + scaling·B_e A_e in every targeted expert weight (through autograd)."""
    leaves = {path: (A.detach().clone().requires_grad_(), B.detach().clone().requires_grad_()) for path, (A, B) in weights.items()}
    merged = {}
    for path, (A, B) in leaves.items():
        target = layers[path]
        module_path, name = path.rsplit(".", 1)
        weight = plain.get_parameter(f"{module_path}.{name}")
        merged[f"{module_path}.{name}"] = weight + target.delta_weight(A, B, scaling)
    logits = functional_call(plain, merged, (tokens,)).logits
    (logits * loss_weights).sum().backward()
    return logits.detach(), [g for A, B in leaves.values() for g in (A.grad, B.grad) if g is not None]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_co_batched_expert_runs_of_mixed_ranks_equal_each_alone(family: str) -> None:
    model = tiny_moe(family)
    plain = copy.deepcopy(model)
    for p in list(model.parameters()) + list(plain.parameters()):
        p.requires_grad_(False)
    routing = Routing()
    layers = wrap_targets(model, TARGETS, routing)
    experts: dict[str, Any] = {p: t for p, t in layers.items() if not isinstance(t, nn.Module)}
    assert experts and all(isinstance(m, MultiLoraExperts) for m in model.modules() if type(m).__name__.endswith("Experts")
                           and hasattr(m, "base_layer"))
    weights = {key: run_weights(experts, rank, seed) for seed, (key, (rank, _, _)) in enumerate(RUNS.items())}
    for key, (rank, alpha, _) in RUNS.items():
        attach_experts(routing.slots, key, layers, weights[key], rank, alpha / rank, 0.0, trainable=True)

    # every run's matrices are views of its slot in one buffer per target: nothing to gather in a pass
    for path, target in experts.items():
        buffer = target.lora
        for key in RUNS:
            A, B = weights[key][path]
            slot = routing.slots.expert_slots().slot_of(key)
            assert A.data_ptr() == buffer.A[slot].data_ptr() and B.data_ptr() == buffer.Bt[slot].data_ptr()

    generator = torch.Generator().manual_seed(7)
    rows = max(end for _, _, (_, end) in RUNS.values())
    tokens = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator)
    loss_weights = torch.randn(rows, TOKENS, VOCAB, generator=generator)
    segments = [Segment(key, start, end) for key, (_, _, (start, end)) in RUNS.items()]
    with routed(routing, segments, "grouped"):
        logits = model(tokens).logits
        (logits * loss_weights).sum().backward()

    for key, (rank, alpha, (start, end)) in RUNS.items():
        expected, grads = merged_alone(plain, experts, weights[key], alpha / rank, tokens[start:end], loss_weights[start:end])
        assert_near(logits[start:end].detach(), expected)
        got = [g for A, B in weights[key].values() for g in (A.grad, B.grad)]
        for g, e in zip(got, grads):
            assert g is not None
            assert_near(g, e)
        # its gradients are the rows of the buffers' gradients, as a Linear run's are
        path, (A, _) = next(iter(weights[key].items()))
        assert A.grad is not None and A.grad.data_ptr() == experts[path].lora.grad_A[
            routing.slots.expert_slots().slot_of(key)].data_ptr()

    # a detached run's matrices keep their values in storage of their own
    A, _ = next(iter(weights["b"].values()))
    before = A.detach().clone()
    detach_experts(routing.slots, "b")
    assert torch.equal(A.detach(), before) and routing.slots.expert_slots().slot_of("b") is None


def co_batched_pass(family: str, device: torch.device | str, kernel: str, dropout: float = 0.1) -> list[torch.Tensor]:
    """The logits and every run's expert gradients of one co-batched pass (mixed ranks, dropout) with `kernel`."""
    model = tiny_moe(family).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    routing = Routing()
    layers = wrap_targets(model, TARGETS, routing)
    experts: dict[str, Any] = {p: t for p, t in layers.items() if not isinstance(t, nn.Module)}
    weights = {key: {path: (nn.Parameter(A.to(device)), nn.Parameter(B.to(device)))
                     for path, (A, B) in run_weights(experts, rank, seed).items()}
               for seed, (key, (rank, _, _)) in enumerate(RUNS.items())}
    for key, (rank, alpha, _) in RUNS.items():
        attach_experts(routing.slots, key, layers, weights[key], rank, alpha / rank, dropout, trainable=True)
    generator = torch.Generator().manual_seed(7)
    rows = max(end for _, _, (_, end) in RUNS.values())
    tokens = torch.randint(0, VOCAB, (rows, TOKENS), generator=generator).to(device)
    loss_weights = torch.randn(rows, TOKENS, VOCAB, generator=generator).to(device)
    segments = [Segment(key, start, end, dropout_seed=100 + i, call_rows=end - start, call_width=TOKENS)
                for i, (key, (_, _, (start, end))) in enumerate(RUNS.items())]
    with routed(routing, segments, kernel):  # type: ignore[arg-type]
        logits = model(tokens).logits
        (logits * loss_weights).sum().backward()
    grads = [t.grad for key in RUNS for A, B in weights[key].values() for t in (A, B)]
    assert all(g is not None for g in grads)
    return [logits.detach(), *(g for g in grads if g is not None)]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_grouped_kernel_equals_the_reference_in_a_co_batched_moe_pass(family: str) -> None:
    """With dropout: the same values and gradients whichever kernel a pass runs (the journal names it for replay)."""
    for got, expected in zip(co_batched_pass(family, "cpu", "grouped"), co_batched_pass(family, "cpu", "torch")):
        assert_near(got, expected)
