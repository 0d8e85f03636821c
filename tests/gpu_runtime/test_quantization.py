"""Quantized bases on CPU, with bitsandbytes' real Linear4bit / Linear8bitLt modules (never de-quantized at load):
the multi-LoRA layer against PEFT's bitsandbytes LoRA, training, the adapter on a plain base, and `merged`."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from gpu_runtime.compute.lora.layer import MultiLoraLinear, Routing, Segment, routed
from gpu_runtime.compute.lora.wrap import init_lora, wrap_targets
from gpu_runtime.compute.merging import MERGE_INFO, save_merged
from gpu_runtime.compute.quantization import count_quantized, dequantized_weight, quantize_model
from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.run_state import peft_name
from gpu_runtime.errors import BadInput, FailedPrecondition
from tests.helpers.engine_tools import BATCH, run_logits, train

bnb = pytest.importorskip("bitsandbytes")

PROBE = [28120, 905, 314, 260, 3575, 282, 11, 99]
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down
MODULE_TYPES = {"4bit": "Linear4bit", "8bit": "Linear8bitLt"}
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore:.*is_gradient_checkpointing:FutureWarning")


def quantized(tiny_model_dir: str, kind: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    quantize_model(model, kind, torch.device("cpu"), compute_dtype=torch.float32)
    return model.requires_grad_(False)


def plain_dequantized(tiny_model_dir: str, model: torch.nn.Module) -> torch.nn.Module:
    """The unquantized architecture holding exactly the weights the quantized model computes with."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for path, module in model.named_modules():
            if type(module).__name__ in MODULE_TYPES.values():
                plain.get_submodule(path.removesuffix(".base_layer")).weight.copy_(dequantized_weight(module))
    return plain


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_layer_over_a_quantized_base_matches_pefts_bitsandbytes_lora(tiny_model_dir: str, kind: str) -> None:
    ours_model = quantized(tiny_model_dir, kind)
    theirs_base = quantized(tiny_model_dir, kind)  # quantizing is deterministic: the same packed weights
    assert count_quantized(ours_model) == {kind: 2 * LINEARS_PER_LAYER}
    peft = get_peft_model(theirs_base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    peft_layer = cast(Any, peft.base_model).model.model.layers[0].self_attn.q_proj
    assert type(peft_layer).__module__ == "peft.tuners.lora.bnb"  # PEFT's own bitsandbytes LoRA, not its plain one
    assert type(peft_layer.base_layer).__name__ == MODULE_TYPES[kind]

    routing = Routing()
    layers = wrap_targets(ours_model, TARGETS, routing)
    assert type(cast(MultiLoraLinear, layers["model.layers.0.mlp.down_proj"]).base_layer).__name__ == MODULE_TYPES[kind]
    weights = init_lora(layers, TARGETS, 4, 8, seed=3, device=torch.device("cpu"))
    peft_params = dict(peft.named_parameters())
    for path, (A, B) in weights.items():
        torch.nn.init.normal_(B, std=0.2)  # a non-zero B, so the delta counts
        with torch.no_grad():
            peft_params[peft_name(path, "A").replace(".weight", ".default.weight")].copy_(A)
            peft_params[peft_name(path, "B").replace(".weight", ".default.weight")].copy_(B)

    routing.slots.attach("run", layers, weights, 4, 8 / 4, 0.0, trainable=True)
    input_ids = torch.tensor([PROBE, PROBE[::-1]])
    expected = peft(input_ids=input_ids, labels=input_ids)
    expected.loss.backward()
    with routed(routing, [Segment("run", 0, 2)]):
        got = ours_model(input_ids=input_ids, labels=input_ids)
    got.loss.backward()

    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    for path, (A, B) in weights.items():
        for matrix, ours in (("A", A), ("B", B)):
            theirs = peft_params[peft_name(path, matrix).replace(".weight", ".default.weight")]
            assert ours.grad is not None and ours.grad.abs().sum() > 0, f"{path} {matrix}"
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-6, msg=f"{path} {matrix}")


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_training_on_a_quantized_base_then_adapter_and_merged(engine: Engine, tiny_model_dir: str, tmp_path: Path,
                                                             kind: str) -> None:
    info = engine.create_run("q1", "u1", tiny_model_dir, {"r": 4, "alpha": 8, "target_modules": TARGETS},
                             seed=1, quantization=kind)
    assert info["quantization"] == kind
    entry = engine.residency.bases[f"{tiny_model_dir}#{kind}"]
    assert count_quantized(entry.model) == {kind: 2 * LINEARS_PER_LAYER}  # the real modules, still packed
    assert entry.params == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())

    losses = train(engine, "q1", steps=5, lr=1e-2)
    assert losses[-1] < losses[0] - 0.1 and all(b < a for a, b in zip(losses, losses[1:])), losses

    # The adapter is PEFT's format on the plain architecture. On the de-quantized weights it is the reference.
    adapter = engine.save_state("q1", "adapter")["checkpoint_path"]
    plain = plain_dequantized(tiny_model_dir, entry.model)
    with torch.no_grad():
        reference = PeftModel.from_pretrained(plain, adapter).eval()(input_ids=torch.tensor([PROBE])).logits[0]
    engine_logits = run_logits(engine, "q1", PROBE)
    # 4-bit computes with exactly the de-quantized weight; LLM.int8 also rounds each activation row to int8.
    error = (engine_logits - reference).abs().max().item()
    assert error <= (1e-4 if kind == "4bit" else 2e-2 * reference.abs().max().item()), error
    # ... and it loads on the original unquantized base as it is.
    original = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    assert cast(LoraConfig, original.peft_config["default"]).r == 4

    merged = engine.save_state("q1", "merged")["checkpoint_path"]
    assert json.loads((Path(merged) / MERGE_INFO).read_text())["dequantized_from"] == kind
    state = engine.runs["q1"]
    with safe_open(str(Path(merged) / "model.safetensors"), framework="pt") as fh:
        expected_keys = set(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()) - {"lm_head.weight"}
        assert set(fh.keys()) == expected_keys  # lm_head is tied to the embeddings, as in the original
        for path, (A, B) in state.weights.items():
            folded = dequantized_weight(entry.model.get_submodule(path).base_layer) + (B @ A).detach() * 2.0
            torch.testing.assert_close(fh.get_tensor(f"{path}.weight"), folded, rtol=0, atol=1e-6)
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert count_quantized(model) == {}
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=torch.tensor([PROBE])).logits[0], reference, rtol=1e-4, atol=1e-4)


def test_merged_streams_into_shards_that_load_as_one_model(engine: Engine, tiny_model_dir: str, tmp_path: Path) -> None:
    engine.create_run("q2", "u1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=2, quantization="4bit")
    train(engine, "q2", steps=2, lr=5e-2)
    state = engine.runs["q2"]
    out = tmp_path / "merged"
    out.mkdir()
    info = save_merged(engine.residency.bases[state.base_key], state, out, shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert info["shards"] == len(set(index["weight_map"].values())) >= 3
    assert not list(out.glob("*.tmp.safetensors"))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=torch.tensor([PROBE])).logits[0]
    torch.testing.assert_close(logits, run_logits(engine, "q2", PROBE), rtol=1e-4, atol=1e-4)


def test_quantized_and_plain_runs_are_separate_pools_and_co_batch_within_their_own(engine: Engine,
                                                                                   tiny_model_dir: str) -> None:
    for run_id, kind in (("a", "4bit"), ("b", "4bit"), ("c", None)):
        engine.create_run(run_id, "u1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=3, quantization=kind)
    assert sorted(engine.residency.bases) == sorted([tiny_model_dir, f"{tiny_model_dir}#4bit"])
    from tests.helpers.engine_tools import result_of, submit

    futures = [submit(engine, "forward_backward", run_id=r, batch=BATCH) for r in ("a", "b", "c")]
    stats = engine.tick()
    assert [result_of(f)["step"] for f in futures] == [0, 0, 0]
    assert stats.base_passes == 2  # one pass on the 4-bit base for both of its runs, one on the plain base


@pytest.mark.parametrize(("value", "error"), [("3bit", BadInput), (4, BadInput)])
def test_a_bad_quantization_names_the_field(engine: Engine, tiny_model_dir: str, value: object,
                                            error: type[Exception]) -> None:
    with pytest.raises(error) as caught:
        engine.create_run("bad", "u1", tiny_model_dir, quantization=value)  # type: ignore[arg-type]
    assert caught.value.field == "quantization"  # type: ignore[attr-defined]
    assert "bad" not in engine.runs


def test_without_bitsandbytes_quantization_is_refused_clearly(engine: Engine, tiny_model_dir: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets where it is absent
    with pytest.raises(FailedPrecondition, match="bitsandbytes==0.50.2") as caught:
        engine.create_run("nobnb", "u1", tiny_model_dir, quantization="8bit")
    assert caught.value.field == "quantization"
    assert engine.create_run("plain", "u1", tiny_model_dir)["quantization"] is None  # the plain path is untouched


def test_a_quantized_copy_is_not_the_plain_model(tiny_model_dir: str) -> None:
    """Guards the tests above: 4-bit really changes the weights, so matching de-quantized numbers means something."""
    model = quantized(tiny_model_dir, "4bit")
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    q = dequantized_weight(model.get_submodule("model.layers.0.mlp.up_proj"))
    w = cast(torch.Tensor, plain.get_submodule("model.layers.0.mlp.up_proj").weight)
    assert 1e-3 < (q - w).abs().max().item() < 0.5 * w.abs().max().item()
    assert copy.deepcopy(q).shape == w.shape
