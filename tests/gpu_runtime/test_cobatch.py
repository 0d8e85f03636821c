"""Co-batching is real: runs on one base share a forward and backward pass (and decode passes), and
each run still gets exactly its own losses, gradients and weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import BATCH, FP32_REL, assert_same_grads, assert_same_weights, lora_weights, result_of, submit

# Mixed ranks, alphas, dropouts, target modules and learning rates, in one tick.
RUNS: dict[str, tuple[str, dict[str, Any], int]] = {
    "a": ("u1", {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, 1),
    "b": ("u2", {"r": 8, "alpha": 8, "dropout": 0.1,
                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}, 2),
    "c": ("u3", {"r": 2, "alpha": 4, "dropout": 0.2, "target_modules": ["o_proj"]}, 3),
    "d": ("u1", {"r": 16, "alpha": 32}, 4),
}
BATCHES = {"a": BATCH[:1], "b": BATCH[1:3], "c": BATCH[3:], "d": BATCH}
LEARNING_RATES = {"a": 1e-2, "b": 5e-2, "c": 2e-2, "d": 1e-3}
# AdamW divides by the root of each element's squared gradients, so the gradients' rounding (sums in another
# order, within FP32_REL of scale: checked each step) comes back larger in the weights, the more so the smaller the
# element's gradients (and the next step's gradients follow the weights). At the default eps (1e-8) that reached
# 8e-4 of scale on one CPU and passed 1e-4 on another; an eps of 1e-6 damps the tiniest elements (1.7e-4 there).
# A wrong row's delta would be off by the whole scale.
ADAM_EPS = 1e-6
WEIGHTS_REL = 1e-3


def engine_with_runs(path: Path, model: str, runs: list[str], **options: Any) -> Engine:
    engine = Engine(path, device="cpu", **options)
    for run_id in runs:
        user, lora, seed = RUNS[run_id]
        engine.create_run(run_id, user, model, lora, seed=seed)
    return engine


def count_base_passes(engine: Engine, model: str) -> list[int]:
    passes: list[int] = []
    # the decoder: a pass through the chunked loss head runs it alone, without the model's own logits
    engine.residency.bases[model].model.get_decoder().register_forward_hook(lambda *_: passes.append(1))
    return passes


def grads(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in engine.runs[run_id].named_parameters().items() if p.grad is not None}


def test_a_tick_of_four_different_runs_is_one_base_pass(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = engine_with_runs(tmp_path, tiny_model_dir, list(RUNS))
    passes = count_base_passes(engine, tiny_model_dir)
    futures = {run_id: submit(engine, "forward_backward", run_id=run_id, batch=BATCHES[run_id]) for run_id in RUNS}
    stats = engine.tick()
    assert all(future.done() for future in futures.values())
    assert [result_of(futures[r])["num_examples"] for r in RUNS] == [1, 2, 1, 4]
    assert len(passes) == 1
    assert (stats.base_passes, stats.fb_runs, stats.fb_rows) == (1, 4, 8)
    recent = engine.runtime_state()["ticks"]["recent"]
    assert any(t["base_passes"] == 1 and t["fb_runs"] == 4 for t in recent)


def test_cobatched_training_equals_each_run_trained_alone(tmp_path: Path, tiny_model_dir: str) -> None:
    together = engine_with_runs(tmp_path / "together", tiny_model_dir, list(RUNS))
    losses: dict[str, list[float]] = {r: [] for r in RUNS}
    step_grads: list[dict[str, dict[str, torch.Tensor]]] = []
    for step in range(2):
        futures = {r: submit(together, "forward_backward", run_id=r, batch=BATCHES[r]) for r in RUNS}
        assert together.tick().base_passes == 1
        for run_id, future in futures.items():
            losses[run_id].append(result_of(future)["loss"])
        step_grads.append({r: grads(together, r) for r in RUNS})
        steps = {r: submit(together, "optim_step", run_id=r, adam={"learning_rate": LEARNING_RATES[r], "eps": ADAM_EPS}) for r in RUNS}
        together.tick()
        assert [result_of(steps[r])["step"] for r in RUNS] == [step + 1] * 4

    for run_id in RUNS:
        alone = engine_with_runs(tmp_path / f"alone-{run_id}", tiny_model_dir, [run_id])
        for step in range(2):
            loss = alone.forward_backward(run_id, BATCHES[run_id])["loss"]
            assert loss == pytest.approx(losses[run_id][step], rel=1e-5), run_id
            # The first step's gradients come from equal weights; later ones from weights AdamW moved apart.
            assert_same_grads(step_grads[step][run_id], grads(alone, run_id), rel=FP32_REL if step == 0 else WEIGHTS_REL)
            alone.optim_step(run_id, {"learning_rate": LEARNING_RATES[run_id], "eps": ADAM_EPS})
        assert_same_weights(lora_weights(together, run_id), lora_weights(alone, run_id), exact=False, rel=WEIGHTS_REL)


def test_a_call_with_the_tick_to_itself_is_bitwise_the_run_alone(tmp_path: Path, tiny_model_dir: str) -> None:
    # Others' runs train on the same base in ticks of their own; run b's numbers do not move by a bit.
    shared = engine_with_runs(tmp_path / "shared", tiny_model_dir, list(RUNS))
    alone = engine_with_runs(tmp_path / "alone", tiny_model_dir, ["b"])
    for engine in (shared, alone):
        for _ in range(2):
            for run_id in list(engine.runs):
                engine.forward_backward(run_id, BATCHES[run_id])
                engine.optim_step(run_id, {"learning_rate": LEARNING_RATES[run_id]})
    assert_same_weights(lora_weights(shared, "b"), lora_weights(alone, "b"))


def test_a_large_call_is_split_across_ticks_and_equals_it_whole(tmp_path: Path, tiny_model_dir: str) -> None:
    whole = engine_with_runs(tmp_path / "whole", tiny_model_dir, ["b"])
    split = engine_with_runs(tmp_path / "split", tiny_model_dir, ["b"], tick_tokens=16)
    whole_before = whole.totals.base_passes
    expected = whole.forward_backward("b", BATCH)
    assert whole.totals.base_passes == whole_before + 1
    passes_before = split.totals.base_passes
    got = split.forward_backward("b", BATCH)
    assert split.totals.base_passes - passes_before >= 3  # four examples over ~16-token ticks
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert (got["num_tokens"], got["num_examples"]) == (expected["num_tokens"], expected["num_examples"])
    assert_same_grads(grads(split, "b"), grads(whole, "b"))


def test_while_a_long_call_is_split_another_runs_short_call_shares_its_ticks(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = engine_with_runs(tmp_path, tiny_model_dir, ["b", "c"], tick_tokens=24)
    long = submit(engine, "forward_backward", run_id="b", batch=BATCH * 4)
    short = submit(engine, "forward_backward", run_id="c", batch=BATCHES["c"])
    first = engine.tick()
    assert short.done() and not long.done()
    assert first.fb_runs == 2 and first.base_passes == 1
    for _ in range(40):  # bounded: 16 examples over ticks of ~24 tokens
        if long.done():
            break
        engine.tick()
    assert result_of(long)["num_examples"] == 16


def test_decode_rows_of_two_runs_share_each_pass(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = engine_with_runs(tmp_path, tiny_model_dir, ["a", "d"])
    for run_id in ("a", "d"):  # a step each, so both adapters change the logits
        engine.forward_backward(run_id, BATCH)
        engine.optim_step(run_id, {"learning_rate": 5e-2})
    prompt: dict[str, Any] = dict(prompts=["The quick brown fox"], max_tokens=6, temperature=0)
    passes = count_base_passes(engine, tiny_model_dir)
    futures = {run_id: submit(engine, "sample", run_id=run_id, **prompt) for run_id in ("a", "d")}
    groups = []
    for _ in range(20):
        if all(f.done() for f in futures.values()):
            break
        engine.tick()
        groups += [g["runs"] for g in engine.runtime_state()["decode_groups"]]
    together = {run_id: result_of(f)["sequences"][0][0] for run_id, f in futures.items()}
    assert len(passes) == 6  # one prefill and five decode passes for both runs' rows, not twelve
    assert all(sorted(g) == ["a", "d"] for g in groups)

    for run_id in ("a", "d"):
        alone = engine.sample(run_id, **prompt)["sequences"][0][0]
        assert alone["tokens"] == together[run_id]["tokens"]
        assert alone["logprobs"] == pytest.approx(together[run_id]["logprobs"], rel=1e-5, abs=1e-6)
    assert together["a"]["tokens"] != together["d"]["tokens"] or together["a"]["logprobs"] != together["d"]["logprobs"]
