"""The tick isolates each call: an exception in one call's preparation fails that call alone, typed and logged
with its request id, while the other calls of the same tick are answered and the runtime goes on."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine import Engine

BATCH = [{"text": "The quick brown fox jumps over the lazy dog."}]


def test_an_exception_in_one_calls_preparation_fails_it_alone(
        tmp_path: Path, tiny_model_dir: str, capfd: pytest.CaptureFixture[str]) -> None:
    engine = Engine(tmp_path, device="cpu", faults={"raise_in_prepare"})
    for run in ("a", "b"):
        engine.create_run(run, f"user-{run}", tiny_model_dir, lora={"r": 4})
    answers: dict[str, Future[dict[str, Any]]] = {run: Future() for run in ("a", "b")}
    engine.submit("forward_backward", {"run_id": "a", "batch": BATCH, "request_id": "raise-me"}, answers["a"].set_result)
    engine.submit("forward_backward", {"run_id": "b", "batch": BATCH, "request_id": "fine"}, answers["b"].set_result)
    stats = engine.tick()  # both heads in one tick
    assert stats.requests == 1 and stats.base_passes == 1  # b's call ran; a's was answered before planning
    failed, answered = answers["a"].result(timeout=0), answers["b"].result(timeout=0)
    assert failed["error"]["code"] == "INTERNAL" and "failpoint raise_in_prepare" in failed["error"]["message"]
    assert answered["result"]["num_examples"] == 1 and answered["result"]["loss"] > 0
    assert "request raise-me, run a" in capfd.readouterr().err
    # The runtime goes on: a's next call applies, b steps.
    assert engine.forward_backward("a", BATCH, request_id="second")["num_examples"] == 1
    assert engine.optim_step("b")["step"] == 1
