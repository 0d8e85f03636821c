"""sample(): determinism, stop conditions, logprobs, and that it leaves training state alone."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch

from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput
from tests.helpers.engine_tools import BATCH, lora_weights, run_logits, train


def test_same_seed_same_text_and_greedy_is_deterministic(engine: Engine, tiny_run: str) -> None:
    prompts = ["hello", "The capital of France is"]
    a = engine.sample(tiny_run, prompts, max_tokens=8, seed=11)
    b = engine.sample(tiny_run, prompts, max_tokens=8, seed=11)
    c = engine.sample(tiny_run, prompts, max_tokens=8, seed=12)
    assert {**a, "compute_seconds": 0, "sequences": None} == {**b, "compute_seconds": 0, "sequences": None}
    same_sequences(a, b)
    assert a["outputs"] != c["outputs"]
    greedy = [engine.sample(tiny_run, prompts, max_tokens=8, temperature=0, seed=s) for s in (1, 2)]
    same_sequences(greedy[0], greedy[1])


def same_sequences(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same tokens and text; logprobs within float noise (the decode batch's rows and columns may differ from one
    call to the next, as the slots they take do: the sums run in another order)."""
    for got, expected in zip(a["sequences"], b["sequences"], strict=True):
        assert [{**s, "logprobs": None} for s in got] == [{**s, "logprobs": None} for s in expected]
        assert [s["logprobs"] for s in got] == [pytest.approx(s["logprobs"], abs=1e-4) for s in expected]


def test_result_shape_num_samples_and_logprob_lengths(engine: Engine, tiny_run: str) -> None:
    result = engine.sample(tiny_run, ["hello", "world"], max_tokens=5, num_samples=3, seed=0)
    assert len(result["outputs"]) == 2 and [len(s) for s in result["sequences"]] == [3, 3]
    for prompt_sequences, output in zip(result["sequences"], result["outputs"]):
        assert output == prompt_sequences[0]["text"]
        for seq in prompt_sequences:
            assert len(seq["tokens"]) == len(seq["logprobs"]) == 5
            assert seq["stop_reason"] == "length"
            assert all(lp <= 0 for lp in seq["logprobs"])


def test_logprobs_are_the_models_own_for_each_token(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=1)
    seq = engine.sample(tiny_run, ["hello", "a much longer prompt here"], max_tokens=6, seed=5)["sequences"][1][0]
    prompt = engine.sample(tiny_run, ["a much longer prompt here"], max_tokens=1)["prompt_tokens"][0]
    # Teacher-forced logprobs of the sampled tokens (the batch was left-padded; this one is not).
    logits = run_logits(engine, tiny_run, prompt + seq["tokens"])
    logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    expected = logprobs[torch.arange(6), torch.tensor(seq["tokens"])]
    torch.testing.assert_close(torch.tensor(seq["logprobs"]), expected, rtol=1e-4, atol=1e-4)


def test_stop_string_cuts_the_text_before_it(engine: Engine, tiny_run: str) -> None:
    full = engine.sample(tiny_run, ["hello"], max_tokens=12, temperature=0)["outputs"][0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip()
    result = engine.sample(tiny_run, ["hello"], max_tokens=12, temperature=0, stop=["@@never@@", stop])
    seq = result["sequences"][0][0]
    assert seq["stop_reason"] == "stop"
    assert seq["text"] == full[: full.find(stop)]
    assert len(seq["tokens"]) == len(seq["logprobs"]) < 12


def test_sampling_leaves_training_state_untouched(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir, {"r": 4, "dropout": 0.2})
    engine.forward_backward("r1", BATCH)
    grads = [cast(torch.Tensor, p.grad).clone() for p in engine.runs["r1"].parameters()]
    weights = lora_weights(engine, "r1")
    engine.sample("r1", ["hello"], max_tokens=4, seed=0)
    assert all(torch.equal(g, cast(torch.Tensor, p.grad)) for g, p in zip(grads, engine.runs["r1"].parameters()))
    assert all(torch.equal(w, v) for w, v in zip(weights.values(), lora_weights(engine, "r1").values()))
    assert engine.run_info("r1")["pending_forward_backward"] == 1
    assert engine.optim_step("r1")["step"] == 1


BAD: list[tuple[dict[str, Any], str]] = [
    ({"prompts": []}, "prompts"),
    ({"prompts": "hello"}, "prompts"),
    ({"prompts": ["ok", ""]}, "prompts[1]"),
    ({"prompts": ["ok", 3]}, "prompts[1]"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_tokens": 255}, "max_tokens"),  # prompt + max_tokens past the 256-token context
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),  # -1, like 0, means off (Tinker's spelling)
    ({"num_samples": 0}, "num_samples"),
    ({"num_samples": 17}, "num_samples"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 3]}, "stop"),  # strings and token ids mixed
    ({"stop": [3, -1]}, "stop"),
    ({"stop": [49152]}, "stop"),  # outside the vocabulary
    ({"stop": [True]}, "stop"),
    ({"prompts": None, "prompt_tokens": [[1, 2], [3, 49152]]}, "prompt_tokens[1]"),
    ({"prompts": None, "prompt_tokens": [[1, 2], []]}, "prompt_tokens[1]"),
    ({"prompts": None, "prompt_tokens": [[1, -2]]}, "prompt_tokens[0]"),
    ({"prompts": None, "prompt_tokens": []}, "prompt_tokens"),
    ({"prompts": None, "prompt_tokens": None}, "prompts"),
    ({"prompt_tokens": [[1, 2]]}, "prompts"),  # both
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs"),
    ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),
    ({"seed": -1}, "seed"),
    ({"prompts": ["word " * 300]}, "prompts[0]"),
]


@pytest.mark.parametrize(("overrides", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_sampling_arguments_name_their_field(engine: Engine, tiny_run: str, overrides: dict[str, Any], field: str) -> None:
    kwargs: dict[str, Any] = {"prompts": ["hello there"], "max_tokens": 4, **overrides}
    with pytest.raises(BadInput) as caught:
        engine.sample(tiny_run, **kwargs)
    assert caught.value.field == field


def test_top_k_one_is_greedy(engine: Engine, tiny_run: str) -> None:
    greedy = engine.sample(tiny_run, ["hello"], max_tokens=6, temperature=0)["outputs"]
    assert engine.sample(tiny_run, ["hello"], max_tokens=6, temperature=1.5, top_k=1, seed=3)["outputs"] == greedy
    assert engine.sample(tiny_run, ["hello"], max_tokens=6, top_p=1e-6, seed=3)["outputs"] == greedy
