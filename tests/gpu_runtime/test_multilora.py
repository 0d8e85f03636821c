"""The multi-LoRA layer on its own: PEFT's numbers for one run, its grouped path against its loop, and
dropout masks that do not depend on how a call's rows were cut into passes."""

from __future__ import annotations

import copy
from typing import cast

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from gpu_runtime.compute.lora.layer import LoraWeights, MultiLoraLinear, Routing, Segment, padded_bmm, routed
from gpu_runtime.compute.lora.wrap import init_lora, wrap_targets
from gpu_runtime.engine.run_state import peft_name

PROBE = [[28120, 905, 314, 260, 3575, 282, 11, 99], [1, 17, 28120, 905, 314, 44, 260, 7]]


def lora(r: int, in_features: int, out_features: int, scaling: float, dropout: float, seed: int) -> LoraWeights:
    generator = torch.Generator().manual_seed(seed)
    A = nn.Parameter(torch.randn(r, in_features, generator=generator) * 0.3)
    B = nn.Parameter(torch.randn(out_features, r, generator=generator) * 0.3)  # non-zero B: the delta matters
    return LoraWeights(A, B, scaling, dropout)


def layer_with(adapters: dict[str, LoraWeights], routing: Routing) -> MultiLoraLinear:
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(16, 12), "model.layers.0.self_attn.q_proj", routing)
    layer.adapters.update(adapters)
    return layer


def run_layer(layer: MultiLoraLinear, x: torch.Tensor, segments: list[Segment], grouped: bool | None):
    for weights in layer.adapters.values():
        weights.A.grad = weights.B.grad = None
    with routed(layer.routing, segments, grouped=grouped):
        out = layer(x)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)).sum().backward()
    grads = {key: (w.A.grad.clone(), cast(torch.Tensor, w.B.grad).clone()) for key, w in layer.adapters.items() if w.A.grad is not None}
    return out.detach(), grads


# PEFT 0.21 reads a property transformers 5 deprecated.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_one_run_through_the_layer_gives_pefts_logits_and_gradients(tiny_model_dir: str) -> None:
    targets = ["q_proj", "v_proj", "down_proj"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    ours_model = copy.deepcopy(base).requires_grad_(False)
    routing = Routing()
    layers = wrap_targets(ours_model, targets, routing)
    weights = init_lora(layers, targets, 4, 8, seed=3, device=torch.device("cpu"))
    for path, (A, B) in weights.items():
        torch.nn.init.normal_(B, std=0.2)  # PEFT starts B at zero; a trained B is what the check needs
        layers[path].adapters["run"] = LoraWeights(A, B, 8 / 4, 0.0)
    peft_params = dict(peft.named_parameters())
    with torch.no_grad():
        for path, (A, B) in weights.items():
            peft_params[peft_name(path, "A").replace(".weight", ".default.weight")].copy_(A)
            peft_params[peft_name(path, "B").replace(".weight", ".default.weight")].copy_(B)

    input_ids = torch.tensor(PROBE)
    expected = peft(input_ids=input_ids, labels=input_ids)
    expected.loss.backward()
    with routed(routing, [Segment("run", 0, len(PROBE))]):
        got = ours_model(input_ids=input_ids, labels=input_ids)
    got.loss.backward()

    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert len(weights) == 2 * 3  # two layers, three targets each
    for path, (A, B) in weights.items():
        for matrix, ours in (("A", A), ("B", B)):
            theirs = peft_params[peft_name(path, matrix).replace(".weight", ".default.weight")]
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=f"{path} {matrix}")


@pytest.mark.parametrize("shape", [(16,), (5, 16)], ids=["rows", "rows-by-tokens"])
@pytest.mark.parametrize("ends", [(2, 3, 7), (2, 4, 6)], ids=["uneven", "even"])  # even: one bmm, no _grouped_mm
def test_grouped_path_equals_the_per_segment_loop(shape: tuple[int, ...], ends: tuple[int, int, int]) -> None:
    adapters = {f"run-{i}": lora(4, 16, 12, scaling=[2.0, 0.5, 1.0][i], dropout=0.0, seed=i) for i in range(3)}
    layer = layer_with(adapters, Routing())
    x = torch.randn(ends[2], *shape, generator=torch.Generator().manual_seed(5))
    segments = [Segment("run-0", 0, ends[0]), Segment("run-1", ends[0], ends[1]), Segment("run-2", ends[1], ends[2])]
    looped, loop_grads = run_layer(layer, x, segments, grouped=False)
    grouped, grouped_grads = run_layer(layer, x, segments, grouped=True)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    assert loop_grads.keys() == grouped_grads.keys() == adapters.keys()
    for key in adapters:
        for ours, theirs in zip(grouped_grads[key], loop_grads[key]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_grouped_path_takes_a_zero_stride_gradient() -> None:
    # A plain .sum() sends back an expanded (zero-stride) gradient, which _grouped_mm's backward refuses: the
    # layer's scaling multiply in between makes it dense.
    adapters = {f"run-{i}": lora(4, 16, 12, scaling=1.0, dropout=0.0, seed=i) for i in range(2)}
    layer = layer_with(adapters, Routing())
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(5))
    grads = []
    for grouped in (False, True):
        for weights in adapters.values():
            weights.A.grad = weights.B.grad = None
        with routed(layer.routing, [Segment("run-0", 0, 2), Segment("run-1", 2, 5)], grouped=grouped):
            layer(x).sum().backward()
        grads.append([cast(torch.Tensor, g).clone() for w in adapters.values() for g in (w.A.grad, w.B.grad)])
    for ours, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


def test_each_rows_delta_is_its_own_runs() -> None:
    adapters = {"a": lora(2, 16, 12, 1.0, 0.0, seed=1), "b": lora(8, 16, 12, 3.0, 0.0, seed=2)}
    layer = layer_with(adapters, Routing())
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(5))
    mixed, grads = run_layer(layer, x, [Segment("a", 0, 2), Segment("b", 2, 5)], grouped=None)
    alone_a, grads_a = run_layer(layer, x[:2], [Segment("a", 0, 2)], grouped=None)
    torch.testing.assert_close(mixed[:2], alone_a)
    base_only = layer.base_layer(x[2:]).detach()
    b = adapters["b"]
    torch.testing.assert_close(mixed[2:], base_only + (x[2:] @ b.A.T @ b.B.T) * 3.0, rtol=1e-5, atol=1e-6)
    # A row outside every segment is the plain base layer; a run without rows gets no gradient.
    plain, none = run_layer(layer, x, [Segment("nobody", 0, 5)], grouped=None)
    torch.testing.assert_close(plain, layer.base_layer(x).detach())
    assert none == {}


def test_dropout_mask_is_the_same_however_a_call_is_split() -> None:
    adapters = {"a": lora(4, 16, 12, 2.0, dropout=0.5, seed=1)}
    layer = layer_with(adapters, Routing())
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(5))
    whole = Segment("a", 0, 6, dropout_seed=42, call_rows=6, call_width=5, row_offset=0)
    full, _ = run_layer(layer, x, [whole], grouped=None)
    first = Segment("a", 0, 2, dropout_seed=42, call_rows=6, call_width=5, row_offset=0)
    rest = Segment("a", 0, 4, dropout_seed=42, call_rows=6, call_width=5, row_offset=2)
    part1, _ = run_layer(layer, x[:2], [first], grouped=None)
    part2, _ = run_layer(layer, x[2:], [rest], grouped=None)
    torch.testing.assert_close(torch.cat([part1, part2]), full)
    # Beside another run's rows, and padded wider, the run's real positions see the same mask.
    other = lora(4, 16, 12, 1.0, 0.0, seed=9)
    layer.adapters["b"] = other
    wide = torch.cat([x, torch.zeros(6, 2, 16)], dim=1)
    beside = torch.cat([torch.randn(3, 7, 16), wide])
    mixed, _ = run_layer(layer, beside, [Segment("b", 0, 3), Segment("a", 3, 9, 42, 6, 5, 0)], grouped=None)
    torch.testing.assert_close(mixed[3:, :5], full)
    # Another seed draws another mask; no seed means no dropout.
    reseeded, _ = run_layer(layer, x, [Segment("a", 0, 6, 43, 6, 5, 0)], grouped=None)
    assert not torch.allclose(reseeded, full)
    undropped, _ = run_layer(layer, x, [Segment("a", 0, 6)], grouped=None)
    A, B = adapters["a"].A, adapters["a"].B
    torch.testing.assert_close(undropped, (layer.base_layer(x) + (x @ A.T @ B.T) * 2.0).detach(), rtol=1e-5, atol=1e-6)


def test_grouped_path_with_mixed_ranks_dropout_and_gaps_equals_the_loop() -> None:
    # Ranks 4 and 16 share width 16, rank 20 pads to 32; run-1 drops out; rows 7-8 belong to no run here.
    adapters = {f"run-{i}": lora(r, 16, 12, scaling=s, dropout=p, seed=i)
                for i, (r, s, p) in enumerate([(4, 2.0, 0.0), (20, 0.5, 0.3), (16, 1.0, 0.0)])}
    layer = layer_with(adapters, Routing())
    x = torch.randn(9, 5, 16, generator=torch.Generator().manual_seed(5))
    segments = [Segment("run-0", 0, 2), Segment("run-1", 2, 4, 11, 2, 5, 0), Segment("run-2", 4, 7), Segment("gone", 7, 9)]
    looped, loop_grads = run_layer(layer, x, segments, grouped=False)
    grouped, grouped_grads = run_layer(layer, x, segments, grouped=True)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5 * looped.abs().max().item())
    for key in adapters:
        for ours, theirs in zip(grouped_grads[key], loop_grads[key]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())


@pytest.mark.parametrize("counts", [(3, 1, 5), (4,), (2, 2)], ids=["uneven", "one-group", "even"])
def test_padded_bmm_gives_each_groups_own_matmul_and_gradients(counts: tuple[int, ...]) -> None:
    # The grouped path where _grouped_mm has no kernel (fp32 on CUDA): per-group matmuls' values and gradients.
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 16, generator=generator, dtype=torch.float64).requires_grad_()
    w = torch.randn(len(counts), 16, 8, generator=generator, dtype=torch.float64).requires_grad_()
    weights = torch.randn(sum(counts), 8, generator=generator, dtype=torch.float64)
    got = padded_bmm(x, w, counts)
    (got * weights).sum().backward()
    got_grads = cast(torch.Tensor, x.grad).clone(), cast(torch.Tensor, w.grad).clone()
    x.grad = w.grad = None
    expected = torch.cat([part @ w[g] for g, part in enumerate(x.split(list(counts)))])
    (expected * weights).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grads, (x.grad, w.grad), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("ranks", "keys"), [((16, 4), ("run-0", "run-1", "run-0")), ((16, 16, 16), ("run-0", "run-1", "run-2"))],
                         ids=["a-run-twice-and-a-padded-rank", "each-run-once-at-its-width"])
def test_equal_rows_hand_each_run_its_gradient_slice_as_autograd_would(ranks: tuple[int, ...], keys: tuple[str, ...]) -> None:
    # Equal rows take one batched matmul on the runs' stacked matrices (multilora.EqualRowsLora), whose gradient
    # comes back in slices: each run's .grad is its slice, dense. A run with two segments gets their sum; a second
    # pass adds to the .grad it has; ranks 4 and 16 share width 16 (a rank-4 slice is cut back to rank 4); the
    # input's gradient is the loop's.
    adapters = {f"run-{i}": lora(r, 16, 12, scaling=[2.0, 0.5, 1.0][i], dropout=0.0, seed=i) for i, r in enumerate(ranks)}
    layer = layer_with(adapters, Routing())
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(5))
    segments = [Segment(key, 2 * i, 2 * i + 2) for i, key in enumerate(keys)]
    results = {}
    for grouped in (False, True):
        for weights in adapters.values():
            weights.A.grad = weights.B.grad = None
        outputs, input_grads = [], []
        for _ in range(2):  # two passes before any optimizer step: the second accumulates
            rows = x.clone().requires_grad_()
            with routed(layer.routing, segments, grouped=grouped):
                out = layer(rows)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outputs.append(out.detach())
            input_grads.append(cast(torch.Tensor, rows.grad))
        grads = [cast(torch.Tensor, g).clone() for w in adapters.values() for g in (w.A.grad, w.B.grad)]
        results[grouped] = outputs, input_grads, grads
    for ours, theirs in zip(results[True], results[False]):
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape and a.is_contiguous()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
