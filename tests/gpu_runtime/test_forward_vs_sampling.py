"""The logprobs Signal reports are one quantity wherever they come from: a sampled token's logprob (at any
temperature) and a prompt's logprobs equal what a teacher-forced `forward` on the same weights returns, with
other runs decoding in the same ticks."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import result_of, submit, train

PROMPT = [28120, 905, 314, 260, 3575, 282, 1116]


@pytest.fixture
def engine(tmp_path: Path, tiny_model_dir: str) -> Engine:
    engine = Engine(tmp_path / "data", device="cpu")
    for run in ("policy", "other"):
        engine.create_run(run, f"user-{run}", tiny_model_dir, lora={"r": 4}, seed=1)
    train(engine, "policy", steps=2)  # a LoRA that is not zero: the forward must use it
    return engine


def datum(prompt: list[int], completion: list[int]) -> dict:
    tokens = prompt + completion
    return {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:]}}


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_sampled_logprobs_equal_forward_with_another_run_decoding(engine: Engine, temperature: float) -> None:
    # Both samples in one tick: the other run's rows share the decode group with the policy's.
    mine = submit(engine, "sample", run_id="policy", prompt_tokens=[PROMPT], num_samples=3, max_tokens=8,
                  temperature=temperature, seed=5, stop=[])
    theirs = submit(engine, "sample", run_id="other", prompts=["Once upon a time", "Hello"], num_samples=2,
                    max_tokens=12, seed=6)
    while not (mine.done() and theirs.done()):
        engine.tick()
    sequences = result_of(mine)["sequences"][0]
    assert len(sequences) == 3 and len({tuple(s["tokens"]) for s in sequences}) > 1
    # The forward runs while the other run decodes again.
    busy = submit(engine, "sample", run_id="other", prompts=["Another story"], max_tokens=16, seed=7)
    forward = submit(engine, "forward", run_id="policy", batch=[datum(PROMPT, s["tokens"]) for s in sequences])
    while not (forward.done() and busy.done()):
        engine.tick()
    for sequence, output in zip(sequences, result_of(forward)["outputs"]):
        scored = output["logprobs"][len(PROMPT) - 1:]  # the positions that predict the sampled tokens
        assert scored == pytest.approx(sequence["logprobs"], abs=1e-4)


def test_prompt_logprobs_equal_forward_on_the_prompt(engine: Engine) -> None:
    sampled = engine.sample("policy", prompt_tokens=[PROMPT], max_tokens=2, prompt_logprobs=True, seed=3)
    (prompt_logprobs,) = sampled["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    forward = engine.forward([datum(PROMPT[:1], PROMPT[1:])], run_id="policy")
    assert prompt_logprobs[1:] == pytest.approx(forward["outputs"][0]["logprobs"], abs=1e-4)
