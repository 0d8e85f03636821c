"""The tick isolates each call: an exception in one call's preparation fails that call alone, typed and logged
with its request id, while the other calls of the same tick are answered and the runtime goes on."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import assert_same_weights, lora_weights

BATCH = [{"text": "The quick brown fox jumps over the lazy dog."}]


def test_an_exception_in_one_calls_preparation_fails_it_alone(
        tmp_path: Path, tiny_model_dir: str, capfd: pytest.CaptureFixture[str]) -> None:
    engine = Engine(tmp_path, device="cpu", faults={"raise_in_prepare"})
    for run in ("a", "b"):
        engine.create_run(run, f"user-{run}", tiny_model_dir, lora={"r": 4})
    answers: dict[str, Future[dict[str, Any]]] = {run: Future() for run in ("a", "b")}
    engine.submit_message("forward_backward", {"run_id": "a", "batch": BATCH, "request_id": "raise-me"}, answers["a"].set_result)
    engine.submit_message("forward_backward", {"run_id": "b", "batch": BATCH, "request_id": "fine"}, answers["b"].set_result)
    stats = engine.tick()  # both heads in one tick
    assert stats.requests == 1 and stats.base_passes == 1  # b's call ran; a's was answered before planning
    failed, answered = answers["a"].result(timeout=0), answers["b"].result(timeout=0)
    assert failed["error"]["code"] == "INTERNAL" and "failpoint raise_in_prepare" in failed["error"]["message"]
    assert answered["result"]["num_examples"] == 1 and answered["result"]["loss"] > 0
    assert "request raise-me, run a" in capfd.readouterr().err
    # The runtime goes on: a's next call applies, b steps.
    assert engine.forward_backward("a", BATCH, request_id="second")["num_examples"] == 1
    assert engine.optim_step("b")["step"] == 1


def test_an_exception_in_one_calls_completion_fails_it_alone_and_leaves_no_gradient(
        tmp_path: Path, tiny_model_dir: str, capfd: pytest.CaptureFixture[str]) -> None:
    # The pass ran for both calls, so a's failed call had summed its gradients into a's memory: they must not stay.
    engine = Engine(tmp_path / "faulty", device="cpu", faults={"raise_in_count"})
    twin = Engine(tmp_path / "twin", device="cpu")
    for runtime in (engine, twin):
        for run in ("a", "b"):
            runtime.create_run(run, f"user-{run}", tiny_model_dir, lora={"r": 4}, seed=3)
    answers: dict[str, Future[dict[str, Any]]] = {run: Future() for run in ("a", "b")}
    engine.submit_message("forward_backward", {"run_id": "a", "batch": BATCH * 2, "request_id": "raise-me"},
                  answers["a"].set_result)
    engine.submit_message("forward_backward", {"run_id": "b", "batch": BATCH, "request_id": "fine"}, answers["b"].set_result)
    stats = engine.tick()
    assert stats.base_passes == 1 and stats.fb_runs == 2  # one pass for both: the failure came after it
    failed, answered = answers["a"].result(timeout=0), answers["b"].result(timeout=0)
    assert failed["error"]["code"] == "INTERNAL" and "failpoint raise_in_count" in failed["error"]["message"]
    assert answered["result"]["num_examples"] == 1
    assert "request raise-me, run a" in capfd.readouterr().err
    # a comes back from disk without the failed call: its next step is bitwise a twin's that never saw it.
    for runtime in (engine, twin):
        runtime.forward_backward("a", BATCH, request_id="second")
        assert runtime.optim_step("a")["step"] == 1
    assert_same_weights(lora_weights(engine, "a"), lora_weights(twin, "a"))
    assert engine.optim_step("b")["step"] == 1  # b's call was applied and counted
