"""Issue 31's prefix-cache hazard: a prompt's KV is reused only for the weights that computed it. load_state can put
other weights at a step the run had before; a prompt sampled again after it is prefilled anew and scores what a
teacher-forced `forward` on the loaded weights scores."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import BATCH, result_of, submit, train

PROMPT = [(37 * i) % 4000 + 100 for i in range(40)]  # two blocks and more of the prefix cache (16 tokens a block)
OTHER_BATCH = [{"text": "A different lesson entirely, with other words in it."}]


def sampled(engine: Engine) -> dict:
    future = submit(engine, "sample", run_id="r", prompt_tokens=[PROMPT], max_tokens=6, temperature=1.0, seed=3,
                    stop=[])
    while not future.done():
        engine.tick()
    return result_of(future)


def test_a_prompt_after_load_state_at_the_same_step_reads_no_kv_of_the_weights_before(tmp_path: Path,
                                                                                      tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu")
    engine.create_run("r", "u1", tiny_model_dir, lora={"r": 4}, seed=1)
    engine.call("save_state", run_id="r", mode="state", name="zero")
    train(engine, "r", steps=1, lr=5e-2)
    engine.call("save_state", run_id="r", mode="state", name="one")  # step 1: weights W
    engine.call("load_state", run_id="r", checkpoint="zero")
    train(engine, "r", steps=1, batch=OTHER_BATCH, lr=2e-1)  # step 1 again: other weights W'
    first = sampled(engine)  # the prompt's KV, computed with W', is in the cache
    assert first["step"] == 1

    assert engine.call("load_state", run_id="r", checkpoint="one")["step"] == 1  # W back, at the same step
    again = sampled(engine)
    assert again["step"] == 1 and again["prompt_cache_hit_tokens"] == 0
    tokens = again["sequences"][0][0]["tokens"]
    ids = PROMPT + tokens
    forward = engine.call("forward", run_id="r", batch=[{"model_input": ids[:-1],
                                                          "loss_fn_inputs": {"target_tokens": ids[1:]}}])
    scored = forward["outputs"][0]["logprobs"][len(PROMPT) - 1:]
    assert scored == pytest.approx(again["sequences"][0][0]["logprobs"], abs=1e-4)
    assert BATCH != OTHER_BATCH
