"""sample() at token level: token-id prompts, one prefill per prompt, the logprobs' definition, prompt and top-k
logprobs, stop token ids and EOS, top_k=-1; and the tokenizer call."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import run_logits, train

PROMPTS = ["hello", "a much longer prompt here"]


def without_timing(result: dict[str, Any]) -> dict[str, Any]:
    return {**result, "compute_seconds": 0}


def teacher_forced(engine: Engine, run_id: str, ids: list[int]) -> torch.Tensor:
    """Logprobs [len(ids), vocab] of the run's plain model, unpadded: row j predicts ids[j + 1]."""
    return torch.log_softmax(run_logits(engine, run_id, ids), -1)


def test_prompt_token_ids_give_what_the_same_text_gives(engine: Engine, tiny_run: str) -> None:
    by_text = engine.sample(tiny_run, PROMPTS, max_tokens=6, num_samples=2, seed=4)
    by_ids = engine.sample(tiny_run, prompt_tokens=by_text["prompt_tokens"], max_tokens=6, num_samples=2, seed=4)
    assert without_timing(by_ids) == without_timing(by_text)


def test_each_prompt_is_prefilled_once_and_samples_match_one_row_per_sample(engine: Engine, tiny_run: str) -> None:
    entry = engine.residency.bases[engine.runs[tiny_run].base_key]
    widths: list[int] = []
    hook = entry.model.get_decoder().register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[0]),
                                                 with_kwargs=True)
    try:
        repeated = engine.sample(tiny_run, ["hello"], max_tokens=5, num_samples=3, seed=7)
        prefill_rows = widths[0]
        widths.clear()
        one_each = engine.sample(tiny_run, ["hello"] * 3, max_tokens=5, num_samples=1, seed=7)
    finally:
        hook.remove()
    assert prefill_rows == 1 and widths[0] == 3  # the prefill's rows: one prompt, then three prompts
    ours = repeated["sequences"][0]
    theirs = [per_prompt[0] for per_prompt in one_each["sequences"]]
    assert [s["tokens"] for s in ours] == [s["tokens"] for s in theirs]  # the same draws from the same logits
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings", [{"temperature": 1.7}, {"temperature": 0.5, "top_k": 5, "top_p": 0.9}],
                         ids=["hot", "cold-filtered"])
def test_sampled_logprobs_are_the_plain_models_teacher_forced_ones(
    engine: Engine, tiny_run: str, settings: dict[str, Any]
) -> None:
    train(engine, tiny_run, steps=1)
    result = engine.sample(tiny_run, PROMPTS, max_tokens=6, num_samples=3, seed=5, **settings)
    for prompt, per_prompt in zip(result["prompt_tokens"], result["sequences"]):
        for seq in per_prompt:
            logprobs = teacher_forced(engine, tiny_run, prompt + seq["tokens"])[len(prompt) - 1:-1]
            expected = logprobs[torch.arange(len(seq["tokens"])), torch.tensor(seq["tokens"])]
            torch.testing.assert_close(torch.tensor(seq["logprobs"]), expected, rtol=1e-4, atol=1e-4)


def test_prompt_logprobs_and_top_k_lists_are_the_teacher_forced_ones(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=1)
    result = engine.sample(tiny_run, PROMPTS, max_tokens=3, seed=2, prompt_logprobs=True, topk_prompt_logprobs=4,
                           topk_sample_logprobs=3)
    assert len(result["prompt_logprobs"]) == len(result["topk_prompt_logprobs"]) == 2
    for i, prompt in enumerate(result["prompt_tokens"]):
        expected = teacher_forced(engine, tiny_run, prompt)
        got = result["prompt_logprobs"][i]
        assert len(got) == len(prompt) and got[0] is None
        own = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(torch.tensor(got[1:]), own, rtol=1e-4, atol=1e-4)
        tops = result["topk_prompt_logprobs"][i]
        assert len(tops) == len(prompt) and tops[0] is None
        for position, pairs in enumerate(tops[1:]):
            check_top(pairs, expected[position], 4)
        seq = result["sequences"][i][0]
        continued = teacher_forced(engine, tiny_run, prompt + seq["tokens"])[len(prompt) - 1:]
        assert len(seq["topk_logprobs"]) == len(seq["tokens"])
        for position, pairs in enumerate(seq["topk_logprobs"]):
            check_top(pairs, continued[position], 3)


def check_top(pairs: list[list[float]], expected: torch.Tensor, k: int) -> None:
    """k [token, logprob] pairs, most likely first, the first the argmax, each the teacher-forced logprob."""
    assert len(pairs) == k
    values = [value for _, value in pairs]
    assert values == sorted(values, reverse=True)
    assert int(pairs[0][0]) == int(expected.argmax())
    for token, value in pairs:
        assert value == pytest.approx(float(expected[int(token)]), abs=1e-4)


def test_no_prompt_logprobs_unless_asked(engine: Engine, tiny_run: str) -> None:
    result = engine.sample(tiny_run, PROMPTS, max_tokens=2, seed=1)
    assert "prompt_logprobs" not in result and "topk_prompt_logprobs" not in result
    assert all("topk_logprobs" not in seq for per_prompt in result["sequences"] for seq in per_prompt)


def test_stop_token_ids_stop_at_the_first_and_are_included(engine: Engine, tiny_run: str) -> None:
    full = engine.sample(tiny_run, ["hello"], max_tokens=12, temperature=0)["sequences"][0][0]["tokens"]
    stop = full[4]
    first = full.index(stop)
    seq = engine.sample(tiny_run, ["hello"], max_tokens=12, temperature=0, stop=[stop, 49151])["sequences"][0][0]
    assert seq["tokens"] == full[:first + 1] and len(seq["logprobs"]) == first + 1
    assert seq["stop_reason"] == "stop"
    tokenizer = engine.residency.bases[engine.runs[tiny_run].base_key].base.tokenizer
    assert seq["text"] == tokenizer.decode(full[:first], skip_special_tokens=True)


def test_a_stop_string_is_completed_by_the_last_token(engine: Engine, tiny_run: str) -> None:
    full = engine.sample(tiny_run, ["hello"], max_tokens=12, temperature=0)["outputs"][0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    seq = engine.sample(tiny_run, ["hello"], max_tokens=12, temperature=0, stop=stop)["sequences"][0][0]
    tokenizer = engine.residency.bases[engine.runs[tiny_run].base_key].base.tokenizer
    assert seq["text"] == full[:full.find(stop)] and seq["stop_reason"] == "stop"
    assert stop in tokenizer.decode(seq["tokens"]) and stop not in tokenizer.decode(seq["tokens"][:-1])


@pytest.fixture
def eos_run(engine: Engine, tiny_run: str, tiny_model_dir: str, tmp_path: Path) -> tuple[str, list[int], int]:
    """A run on a copy of the tiny model whose generation config names, beside its EOS, the token greedy decoding
    of the prompt picks first: a random model almost never draws its real EOS."""
    prompt = [28120, 905, 314]
    eos = engine.sample(tiny_run, prompt_tokens=[prompt], max_tokens=1, temperature=0)["sequences"][0][0]["tokens"][0]
    copy = tmp_path / "tiny-llama-eos"
    shutil.copytree(tiny_model_dir, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], eos]}))
    engine.create_run("eos-run", "user-1", str(copy), {"r": 4, "alpha": 8}, seed=1)
    assert eos in engine.tokenizer(run_id="eos-run")["eos_token_ids"]
    return "eos-run", prompt, eos


@pytest.mark.parametrize(("stop", "length"), [(None, 1), ([], 5), ([49151], 1), (["@@never@@"], 1)],
                         ids=["omitted-eos-stops", "empty-eos-off", "token-list-keeps-eos", "string-list-keeps-eos"])
def test_eos_stops_unless_stop_is_empty(engine: Engine, eos_run: tuple[str, list[int], int], stop: Any,
                                        length: int) -> None:
    run_id, prompt, eos = eos_run
    seq = engine.sample(run_id, prompt_tokens=[prompt], max_tokens=5, temperature=0, stop=stop)["sequences"][0][0]
    assert seq["tokens"][0] == eos and len(seq["tokens"]) == length
    assert seq["stop_reason"] == ("length" if stop == [] else "stop")
    if stop != []:
        assert seq["text"] == ""


def test_top_k_minus_one_is_top_k_zero(engine: Engine, tiny_run: str) -> None:
    off = engine.sample(tiny_run, PROMPTS, max_tokens=6, num_samples=2, seed=9, top_k=0)
    minus_one = engine.sample(tiny_run, PROMPTS, max_tokens=6, num_samples=2, seed=9, top_k=-1)
    assert without_timing(off) == without_timing(minus_one)


@pytest.mark.parametrize("by", ["base_model", "run_id"])
def test_tokenizer_describes_the_base(engine: Engine, tiny_run: str, tiny_model_dir: str, by: str) -> None:
    described = engine.tokenizer(**({"base_model": tiny_model_dir} if by == "base_model" else {"run_id": tiny_run}))
    tokenizer = engine.residency.bases[engine.runs[tiny_run].base_key].base.tokenizer
    assert described["name"] == tiny_model_dir
    assert described["vocab_size"] == 49152
    assert tokenizer.eos_token_id in described["eos_token_ids"]
    assert described["bos_token_id"] == tokenizer.bos_token_id
    assert described["chat_template"] == tokenizer.chat_template and "{%" in described["chat_template"]
