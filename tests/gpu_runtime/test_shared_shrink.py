"""Layers that read one input share one shrink (issue 30, item 2): q, k and v (gate and up) of a co-batched pass
multiply x once by their A's concatenated along the rank, then expand each, and give the numbers of one
`segmented_lora` per layer: values and gradients within 1e-6 of scale in fp32, mixed ranks, a run twice in a pass,
rows of no run. Measured on the CPU: under 2e-7 (sums of the same products, x's gradient in one matmul, not three).
Through a whole model the logits and the input's gradient stay within 1e-6 (2.8e-7 measured), but the runs' weight
gradients get 1e-5, test_multilora's fp32 bound: h's rounding (one matmul of 3r columns, not three of r) compounds
through two decoder layers, and a rank-1 run's gradient of one row measured 1.05e-6, its unshared o_proj's 7.6e-7."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from gpu_runtime.compute.lora import ops
from gpu_runtime.compute.lora.layer import MultiLoraLinear, Routing, Segment, routed
from gpu_runtime.compute.lora.wrap import init_lora, wrap_targets
from tests.gpu_runtime.test_lora_ops import IN, LAYOUTS, SLOTS, scaled_error, slot_buffers

TOLERANCE = 1e-6
MODEL_WEIGHT_GRADS = 1e-5  # weight gradients after a whole model's compounding (the docstring)
LAYERS = 3  # q, k, v


def layer_buffers(layout: str) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """x, and each of three layers' A and B slot buffers and upstream gradient, for a layout of test_lora_ops."""
    segments, rows = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(7)
    ranks = {slot: rank for _, _, slot, rank, _ in segments}
    buffers = [slot_buffers(ranks, SLOTS, generator) for _ in range(LAYERS)]
    x = torch.randn(rows, IN, generator=generator)
    grads = [torch.randn(rows, B.shape[1], generator=generator) for _, B in buffers]
    return x, [A for A, _ in buffers], [B for _, B in buffers], grads


@pytest.mark.parametrize("grad_into", [False, True], ids=["returned", "grad-into"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_shrink_for_three_layers_equals_one_segmented_lora_each(layout: str, grad_into: bool) -> None:
    segments, rows = LAYOUTS[layout]
    table = ops.build_table(segments, "cpu", rows)
    x, As, Bs, upstream = layer_buffers(layout)

    def run(shared: bool) -> list[torch.Tensor]:
        xs = x.clone().requires_grad_()
        A_leaves = [A.clone().requires_grad_() for A in As]
        B_leaves = [B.clone().requires_grad_() for B in Bs]
        into = [(torch.zeros_like(A), torch.zeros_like(B)) for A, B in zip(As, Bs)] if grad_into else None
        if shared:
            hs = ops.shared_shrink(xs, A_leaves, table, [i[0] for i in into] if into else None)
            deltas = [ops.segmented_expand(h, B, table, into[p][1] if into else None)
                      for p, (h, B) in enumerate(zip(hs, B_leaves))]
        else:
            deltas = [ops.segmented_lora(xs, A, B, table, impl="torch", grad_into=into[p] if into else None)
                      for p, (A, B) in enumerate(zip(A_leaves, B_leaves))]
        sum((d * g).sum() for d, g in zip(deltas, upstream)).backward()  # type: ignore[union-attr]  # a tensor sum
        assert xs.grad is not None
        weight_grads = [g for pair in into for g in pair] if into else [t.grad for pair in zip(A_leaves, B_leaves)
                                                                        for t in pair if t.grad is not None]
        assert len(weight_grads) == 2 * LAYERS
        return [*deltas, xs.grad, *weight_grads]

    for i, (got, expected) in enumerate(zip(run(shared=True), run(shared=False), strict=True)):
        assert got.shape == expected.shape
        assert expected.abs().max() > 0, f"tensor {i} is all zero: the check would be empty"
        assert scaled_error(got, expected) <= TOLERANCE, f"tensor {i}: off by {scaled_error(got, expected):.3g}"


# Mixed ranks and scalings, run-0 twice in the pass, rows 9-10 of no run; run-4 targets q and v alone, so there k
# holds other runs than q and v: q and v share a shrink, k runs its own. No dropout: a layer's own mask stops sharing.
RUNS = {"run-0": (4, 2.0), "run-1": (16, 0.5), "run-2": (1, 1.0), "run-3": (8, 0.25), "run-4": (2, 1.5)}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEGMENTS = [Segment("run-0", 0, 2), Segment("run-1", 2, 4), Segment("run-2", 4, 5), Segment("run-3", 5, 7),
            Segment("run-0", 7, 9), Segment("gone", 9, 11), Segment("run-4", 11, 12)]


class CountBmm(TorchFunctionMode):
    """Counts torch.bmm calls: the torch path's matmuls, one per segment group and shrink or expand."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # torch's protocol
        self.calls += func is torch.bmm
        return func(*args, **(kwargs or {}))


def model_with_runs(tiny_model_dir: str, share: bool) -> tuple[Any, Routing, dict[str, dict[str, tuple[nn.Parameter, nn.Parameter]]]]:
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)
    model, routing = copy.deepcopy(base), Routing()
    layers = wrap_targets(model, ALL, routing)
    runs = {}
    for i, (key, (rank, scaling)) in enumerate(RUNS.items()):
        targets = ["q_proj", "v_proj"] if key == "run-4" else ALL
        weights = init_lora(layers, targets, rank, rank * scaling, seed=i, device=torch.device("cpu"))
        for _, B in weights.values():
            nn.init.normal_(B, std=0.2, generator=torch.Generator().manual_seed(i))  # a trained B: the delta matters
        routing.slots.attach(key, layers, weights, rank, scaling, 0.0, trainable=True)
        runs[key] = weights
    if not share:
        for module in model.modules():
            if isinstance(module, MultiLoraLinear):
                module.siblings = ()
    return model, routing, runs


def test_a_co_batched_model_pass_shares_the_shrink_and_keeps_every_number(tiny_model_dir: str) -> None:
    ids = torch.randint(0, 500, (12, 6), generator=torch.Generator().manual_seed(3))
    results = {}
    for share in (True, False):
        model, routing, runs = model_with_runs(tiny_model_dir, share)
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        with routed(routing, SEGMENTS), CountBmm() as counted:
            out = model(inputs_embeds=embeds, labels=ids)
        out.loss.backward()
        assert embeds.grad is not None
        grads = {f"{key} {path} {m}": t.grad for key, w in runs.items() for path, pair in w.items()
                 for m, t in zip("AB", pair) if t.grad is not None}
        results[share] = (counted.calls, out.logits.detach(), embeds.grad, grads)
    (shared_bmm, logits, x_grad, grads), (alone_bmm, alone_logits, alone_x_grad, alone_grads) = results[True], results[False]
    decoders = model_with_runs(tiny_model_dir, True)[0].config.num_hidden_layers
    # per decoder layer, one shrink saved per segment group (rows, rank) of q and v (runs 0-4; k holds no run-4) and
    # of gate and up (runs 0-3)
    groups = {(s.end - s.start, RUNS[s.key][0]) for s in SEGMENTS if s.key in RUNS}
    groups_without_4 = {(s.end - s.start, RUNS[s.key][0]) for s in SEGMENTS if s.key in RUNS and s.key != "run-4"}
    assert alone_bmm - shared_bmm == decoders * (len(groups) + len(groups_without_4)), (shared_bmm, alone_bmm)
    assert scaled_error(logits, alone_logits) <= TOLERANCE
    assert scaled_error(x_grad, alone_x_grad) <= TOLERANCE
    assert grads.keys() == alone_grads.keys() and len(grads) == 2 * decoders * (4 * len(ALL) + 2)
    for name, grad in grads.items():
        assert scaled_error(grad, alone_grads[name]) <= MODEL_WEIGHT_GRADS, name
