"""A custom loss (docs/LOSSES.md) shares one pass with another run's cross_entropy: each run's loss and gradients
equal its own pass alone, and the custom call's journal (its graph, its scalar and [T, K] inputs) replays after a
crash to the live run's bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.engine.engine import Engine
from tests.gpu_runtime.test_cobatch import grads
from tests.helpers.engine_tools import FP32_REL, assert_same_grads, assert_same_weights, lora_weights, result_of, submit

RUNS: dict[str, tuple[str, dict[str, Any], int]] = {
    "custom": ("u1", {"r": 4, "alpha": 8}, 1),
    "plain": ("u2", {"r": 8, "alpha": 16, "dropout": 0.1}, 2),
}
N = 6  # every row one width: a pass padded wider than a call's rows replays to other bits (test_replay_kernels.py)


def scaled_mix(logprobs: torch.Tensor, scale: torch.Tensor, mix: torch.Tensor, advantages: torch.Tensor) -> Any:
    weight = mix.sum(-1) * scale + advantages
    return -(logprobs * weight).sum(), {"custom/w:mean": weight.mean()}


def graph() -> dict[str, Any]:
    """The loss as the tinker SDK uploads it (create_custom_loss's body)."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(scaled_mix, {"logprobs": 1, "scale": 0, "mix": 2, "advantages": 1}, "session")
    return {"name": handle.name, "inputs": [i.model_dump() for i in handle.inputs],
            "graph": encode_graph(handle).model_dump()}


def batch(run_id: str, step: int) -> list[dict[str, Any]]:
    rows = []
    for j in range(2):
        tokens = [(17 * (i + j + step) + 3) % 500 + 1 for i in range(N + 1)]
        inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
        if run_id == "custom":
            inputs.update(scale=[0.5 + j], mix=[[0.1 * ((i + j) % 5), 0.2, -0.05 * i] for i in range(N)],
                          advantages=[1.0 - 0.3 * i for i in range(N)])
        rows.append({"model_input": tokens[:-1], "loss_fn_inputs": inputs})
    return rows


def params(run_id: str, step: int) -> dict[str, Any]:
    custom = {"loss_fn": "custom", "custom_loss": graph(), "reduction": "sum"} if run_id == "custom" else \
        {"loss_fn": "cross_entropy", "reduction": "sum"}
    return {"run_id": run_id, "batch": batch(run_id, step), **custom}


def engine_with(path: Path, model: str, runs: list[str]) -> Engine:
    engine = Engine(path, device="cpu", snapshot_every_steps=1000)
    for run_id in runs:
        user, lora, seed = RUNS[run_id]
        engine.create_run(run_id, user, model, lora, seed=seed)
    return engine


def fb_tick(engine: Engine, runs: list[str], step: int) -> dict[str, dict[str, Any]]:
    futures = {r: submit(engine, "forward_backward", **params(r, step)) for r in runs}
    assert engine.tick().base_passes == 1  # co-batched: one pass for both losses
    return {r: result_of(f) for r, f in futures.items()}


def step_tick(engine: Engine, runs: list[str]) -> None:
    futures = [submit(engine, "optim_step", run_id=r, adam={"learning_rate": 1e-2}) for r in runs]
    engine.tick()
    for future in futures:
        result_of(future)


def test_a_custom_loss_beside_cross_entropy_equals_each_alone(tmp_path: Path, tiny_model_dir: str) -> None:
    together = engine_with(tmp_path / "together", tiny_model_dir, list(RUNS))
    results = fb_tick(together, list(RUNS), 0)
    # the metric read the scalar and the [T, K] rows: each position's weight, averaged per datum, then over datums
    weights = [(0.1 * ((i + j) % 5) + 0.2 - 0.05 * i) * (0.5 + j) + 1.0 - 0.3 * i for j in range(2) for i in range(N)]
    assert results["custom"]["metrics"]["custom/w:mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
    for run_id in RUNS:
        alone = engine_with(tmp_path / f"alone-{run_id}", tiny_model_dir, [run_id])
        own = fb_tick(alone, [run_id], 0)[run_id]
        assert own["loss"] == pytest.approx(results[run_id]["loss"], rel=1e-5), run_id
        assert (own["metrics"] or {}) == pytest.approx(results[run_id]["metrics"] or {}, rel=1e-5), run_id
        assert_same_grads(grads(together, run_id), grads(alone, run_id), rel=FP32_REL)


def test_a_cobatched_custom_loss_journal_replays_bitwise(tmp_path: Path, tiny_model_dir: str) -> None:
    live = engine_with(tmp_path, tiny_model_dir, list(RUNS))
    fb_tick(live, list(RUNS), 0)
    step_tick(live, list(RUNS))
    fb_tick(live, list(RUNS), 1)  # pending gradients at the crash
    records = [r for r in live.runs["custom"].journal.read() if r["type"] == "forward_backward"]
    assert [r["loss_fn"] for r in records] == ["custom", "custom"] and all("custom_loss" in r for r in records)
    for state in live.runs.values():
        state.journal.close()

    restarted = Engine(tmp_path, device="cpu", snapshot_every_steps=1000)  # a crash: no shutdown snapshot
    for run_id in RUNS:
        assert restarted.run_info(run_id)["pending_forward_backward"] == 1
        assert_same_weights(lora_weights(restarted, run_id), lora_weights(live, run_id))
        for (name, mine), other in zip(restarted.runs[run_id].named_parameters().items(),
                                       live.runs[run_id].named_parameters().values()):
            assert mine.grad is not None and other.grad is not None and torch.equal(mine.grad, other.grad), name
    step_tick(restarted, list(RUNS))
    step_tick(live, list(RUNS))
    for run_id in RUNS:  # the step after recovery: the same bits as the run that never stopped
        assert_same_weights(lora_weights(restarted, run_id), lora_weights(live, run_id))
