"""The multi-LoRA layer on its own: PEFT's numbers for one run, co-batched rows equal to each run alone (values and
gradients, mixed ranks, a run twice in a pass, dropout), and dropout masks that do not depend on how a call's rows
were cut into passes.

Tolerances: fp32 1e-5 of the tensor's scale (the same matmuls on other row counts); bf16 (the base and LoRA both
computing in bf16, fp32 masters and gradient buffers) 2e-2 of the scale: a few of bf16's 2^-8 steps, since a
co-batched pass may round h and the delta at other row counts than a pass alone. Measured on the CPU (the torch
reference, segment by segment): 0 in bf16, 1.8e-7 in fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from gpu_runtime.compute.lora.layer import MultiLoraLinear, Routing, Segment, routed, routed_rows
from gpu_runtime.compute.lora.wrap import init_lora, wrap_targets
from gpu_runtime.engine.run_state import peft_name

PROBE = [[28120, 905, 314, 260, 3575, 282, 11, 99], [1, 17, 28120, 905, 314, 44, 260, 7]]
PATH = "model.layers.0.self_attn.q_proj"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def matrices(r: int, seed: int, device: str = "cpu") -> tuple[nn.Parameter, nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    A = nn.Parameter((torch.randn(r, 16, generator=generator) * 0.3).to(device))
    B = nn.Parameter((torch.randn(12, r, generator=generator) * 0.3).to(device))  # non-zero B: the delta matters
    return A, B


def layer_with(runs: dict[str, tuple[int, float, float]], dtype: torch.dtype = torch.float32, device: str = "cpu"
               ) -> tuple[MultiLoraLinear, dict[str, tuple[nn.Parameter, nn.Parameter]]]:
    """A layer with runs attached: key → (rank, scaling, dropout); their (A, B), now views of their slots."""
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(16, 12).to(device, dtype), PATH, Routing())
    weights = {}
    for i, (key, (r, scaling, dropout)) in enumerate(runs.items()):
        A, B = matrices(r, seed=i, device=device)
        layer.routing.slots.attach(key, {PATH: layer}, {PATH: (A, B)}, r, scaling, dropout, trainable=True)
        weights[key] = (A, B)
    return layer, weights


def run_layer(layer: MultiLoraLinear, x: torch.Tensor, segments: list[Segment],
              weights: dict[str, tuple[nn.Parameter, nn.Parameter]], passes: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Output, input gradient and each run's (A.grad, B.grad) after `passes` passes from cleared gradients."""
    for A, B in weights.values():
        A.grad = B.grad = None
    for _ in range(passes):
        rows = x.clone().requires_grad_()
        with routed(layer.routing, segments):
            out = layer(rows)
        (out.float().pow(2) / 2).sum().backward()  # upstream gradient = the output: a row's own, wherever it sits
    assert rows.grad is not None
    grads = {key: (A.grad.clone(), B.grad.clone()) for key, (A, B) in weights.items() if A.grad is not None and B.grad is not None}
    return out.detach(), rows.grad, grads


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    scale = max(expected.abs().max().item(), 1e-30)
    error = (got.float() - expected.float()).abs().max().item() / scale
    assert error <= TOLERANCE[dtype], f"{what}: off by {error:.3g} of its scale (allowed {TOLERANCE[dtype]})"


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
    for _, B in weights.values():
        torch.nn.init.normal_(B, std=0.2)  # PEFT starts B at zero; a trained B is what the check needs
    routing.slots.attach("run", layers, weights, 4, 8 / 4, 0.0, trainable=True)
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


# Five mixed runs: ranks 1 to 32 (R = 32, the others zero-padded), scalings apart, run-1 and run-3 drop out, run-0
# twice in the pass, rows 11-12 of no run here.
FIVE = {"run-0": (4, 2.0, 0.0), "run-1": (20, 0.5, 0.3), "run-2": (1, 1.0, 0.0), "run-3": (32, 0.25, 0.1), "run-4": (8, 1.5, 0.0)}
FIVE_SEGMENTS = [Segment("run-0", 0, 2), Segment("run-1", 2, 4, 11, 2, 7, 0), Segment("run-2", 4, 5),
                 Segment("run-3", 5, 8, 12, 3, 7, 0), Segment("run-4", 8, 9), Segment("run-0", 9, 11), Segment("gone", 11, 13)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16,), (7, 16)], ids=["rows", "rows-by-tokens"])
def test_five_mixed_runs_co_batched_equal_each_alone(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> None:
    layer, weights = layer_with(FIVE, dtype, device)
    x = torch.randn(13, *shape, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    mixed, mixed_x_grad, mixed_grads = run_layer(layer, x, FIVE_SEGMENTS, weights)
    assert mixed.dtype == dtype and mixed_grads.keys() == FIVE.keys()
    expected_grads: dict[str, list[torch.Tensor]] = {}
    for segment in FIVE_SEGMENTS:
        rows = slice(segment.start, segment.end)
        alone_segment = Segment(segment.key, 0, segment.end - segment.start, segment.dropout_seed, segment.call_rows,
                                segment.call_width, segment.row_offset)
        alone, alone_x_grad, alone_grads = run_layer(layer, x[rows], [alone_segment], weights)
        assert_close(mixed[rows], alone, dtype, f"{segment.key} output")
        if segment.key in FIVE:
            assert_close(mixed_x_grad[rows], alone_x_grad, dtype, f"{segment.key} input gradient")
            A_grad, B_grad = alone_grads[segment.key]
            sums = expected_grads.setdefault(segment.key, [torch.zeros_like(A_grad), torch.zeros_like(B_grad)])
            sums[0], sums[1] = sums[0] + A_grad, sums[1] + B_grad
        else:  # a key with no slot: the plain base layer, no gradient anywhere
            assert torch.equal(alone, layer.base_layer(x[rows]).detach()) and alone_grads == {}
    for key, (A_grad, B_grad) in mixed_grads.items():  # a run twice in the pass: the sum of its two segments'
        assert A_grad.dtype == B_grad.dtype == torch.float32  # fp32 masters' gradients, whatever the compute
        assert_close(A_grad, expected_grads[key][0], dtype, f"{key} A")
        assert_close(B_grad, expected_grads[key][1], dtype, f"{key} B")


def test_each_rows_delta_is_its_own_runs() -> None:
    layer, weights = layer_with({"a": (2, 1.0, 0.0), "b": (8, 3.0, 0.0)})
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(5))
    mixed, _, grads = run_layer(layer, x, [Segment("a", 0, 2), Segment("b", 2, 5)], weights)
    alone_a, _, _ = run_layer(layer, x[:2], [Segment("a", 0, 2)], weights)
    torch.testing.assert_close(mixed[:2], alone_a)
    base_only = layer.base_layer(x[2:]).detach()
    A, B = weights["b"]
    torch.testing.assert_close(mixed[2:], base_only + (x[2:] @ A.detach().T @ B.detach().T) * 3.0, rtol=1e-5, atol=1e-6)
    # A row outside every segment is the plain base layer; a run without rows gets no gradient.
    plain, _, none = run_layer(layer, x, [Segment("nobody", 0, 5)], weights)
    torch.testing.assert_close(plain, layer.base_layer(x).detach())
    assert none == {}


def test_a_run_twice_and_a_second_pass_accumulate_into_its_slot_rows() -> None:
    # A run twice in a pass sums its segments' gradients; a second pass before any optimizer step adds to the .grad
    # it has; each run's .grad is a view of its rows of the layer's one gradient buffer, in its parameter's layout.
    layer, weights = layer_with({"run-0": (16, 2.0, 0.0), "run-1": (4, 0.5, 0.0)})
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(5))
    segments = [Segment("run-0", 0, 2), Segment("run-1", 2, 4), Segment("run-0", 4, 6)]
    _, _, once = run_layer(layer, x, segments, weights)
    _, _, twice = run_layer(layer, x, segments, weights, passes=2)
    lora = layer.lora
    assert lora is not None and lora.grad_A is not None and lora.grad_Bt is not None
    for key, (A, B) in weights.items():
        for grad, one, two, buffer in ((A.grad, once[key][0], twice[key][0], lora.grad_A),
                                       (B.grad, once[key][1], twice[key][1], lora.grad_Bt)):
            torch.testing.assert_close(two, 2 * one, rtol=1e-6, atol=1e-6)
            assert grad is not None and grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert A.grad is not None and B.grad is not None
        assert A.grad.stride() == A.stride() and B.grad.stride() == B.stride()
    alone, _, alone_grads = run_layer(layer, x[:2], [Segment("run-0", 0, 2)], weights)
    second, _, second_grads = run_layer(layer, x[4:], [Segment("run-0", 0, 2)], weights)
    for ours, first, other in zip(once["run-0"], alone_grads["run-0"], second_grads["run-0"]):
        torch.testing.assert_close(ours, first + other, rtol=1e-5, atol=1e-6)


def test_dropout_mask_is_the_same_however_a_call_is_split() -> None:
    layer, weights = layer_with({"a": (4, 2.0, 0.5), "b": (4, 1.0, 0.0)})
    x = torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(5))
    whole = Segment("a", 0, 6, dropout_seed=42, call_rows=6, call_width=5, row_offset=0)
    full, _, _ = run_layer(layer, x, [whole], weights)
    first = Segment("a", 0, 2, dropout_seed=42, call_rows=6, call_width=5, row_offset=0)
    rest = Segment("a", 0, 4, dropout_seed=42, call_rows=6, call_width=5, row_offset=2)
    part1, _, _ = run_layer(layer, x[:2], [first], weights)
    part2, _, _ = run_layer(layer, x[2:], [rest], weights)
    torch.testing.assert_close(torch.cat([part1, part2]), full)
    # Beside another run's rows, and padded wider, the run's real positions see the same mask.
    wide = torch.cat([x, torch.zeros(6, 2, 16)], dim=1)
    beside = torch.cat([torch.randn(3, 7, 16), wide])
    mixed, _, _ = run_layer(layer, beside, [Segment("b", 0, 3), Segment("a", 3, 9, 42, 6, 5, 0)], weights)
    torch.testing.assert_close(mixed[3:, :5], full)
    # Another seed draws another mask; no seed means no dropout.
    reseeded, _, _ = run_layer(layer, x, [Segment("a", 0, 6, 43, 6, 5, 0)], weights)
    assert not torch.allclose(reseeded, full)
    undropped, _, _ = run_layer(layer, x, [Segment("a", 0, 6)], weights)
    A, B = (t.detach() for t in weights["a"])
    torch.testing.assert_close(undropped, (layer.base_layer(x) + (x @ A.T @ B.T) * 2.0).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_row_slots_give_each_decode_row_its_runs_delta(dtype: torch.dtype) -> None:
    # Decoding's form: one slot per row (-1 and unknown keys: the base alone), equal to the segmented pass's rows.
    layer, weights = layer_with({"a": (4, 2.0, 0.0), "b": (16, 0.5, 0.0)}, dtype)
    routing = layer.routing
    x = torch.randn(5, 1, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    keys = ["b", None, "a", "b", "unknown"]
    with torch.no_grad(), routed_rows(routing, [routing.slot_of(key) for key in keys]):
        got = layer(x)
    with torch.no_grad(), routed(routing, [Segment(key, i, i + 1) for i, key in enumerate(keys) if key is not None]):
        expected = layer(x)
    assert [routing.slot_of(key) for key in keys][1::3] == [-1, -1]
    assert_close(got, expected, dtype, "decode rows")
    with routed_rows(routing, [0, 1, 0, 1, 0]), pytest.raises(RuntimeError, match="without autograd"):
        layer(x.clone().requires_grad_())
