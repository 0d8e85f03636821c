"""Compute seconds: what each call cost the device, as billing charges it. A co-batched tick's forward and
backward pass is shared among its calls by their tokens; a call split across ticks adds up its parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import result_of, submit

ROW = list(range(300, 316))  # 16 token ids: every row the same length, so token shares are known exactly


def rows(n: int) -> list[dict[str, Any]]:
    return [{"tokens": ROW, "weights": [0] + [1] * (len(ROW) - 1)} for _ in range(n)]






def test_a_cobatched_pass_is_shared_by_token_share(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu")
    engine.create_run("small", "u1", tiny_model_dir, {"r": 4})
    engine.create_run("large", "u2", tiny_model_dir, {"r": 8})
    small = submit(engine, "forward_backward", run_id="small", batch=rows(1))
    large = submit(engine, "forward_backward", run_id="large", batch=rows(3))
    stats = engine.tick()
    assert (stats.base_passes, stats.fb_runs) == (1, 2)  # one pass for both
    a, b = result_of(small)["compute_seconds"], result_of(large)["compute_seconds"]
    assert a > 0 and b > 0
    assert a + b == pytest.approx(stats.fb_seconds, rel=1e-9)
    assert b / a == pytest.approx(3.0, rel=1e-6)  # 48 tokens against 16


def test_a_split_call_adds_up_its_parts(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", tick_tokens=32)  # two 16-token rows a tick
    engine.create_run("r", "u1", tiny_model_dir, {"r": 4})
    call = submit(engine, "forward_backward", run_id="r", batch=rows(5))
    seconds = []
    for _ in range(10):  # bounded: 5 rows at 2 a tick are 3 ticks
        seconds.append(engine.tick().fb_seconds)
        if call.done():
            break
    assert len([s for s in seconds if s > 0]) == 3
    assert result_of(call)["compute_seconds"] == pytest.approx(sum(seconds), rel=1e-9)


def test_optim_step_sample_and_save_state_report_compute_seconds(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu")
    engine.create_run("r", "u1", tiny_model_dir, {"r": 4})
    assert engine.forward_backward("r", rows(2))["compute_seconds"] > 0
    assert engine.optim_step("r", {"learning_rate": 1e-2})["compute_seconds"] > 0
    assert engine.sample("r", ["hello"], max_tokens=3, seed=1)["compute_seconds"] > 0
    assert engine.save_state("r")["compute_seconds"] > 0


def test_a_split_call_cancelled_between_parts_puts_its_gradients_back(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", tick_tokens=32)  # two 16-token rows a tick
    engine.create_run("r", "u1", tiny_model_dir, {"r": 4})
    engine.forward_backward("r", rows(1))  # gradients before the split call
    before = {name: cast(torch.Tensor, p.grad).clone() for name, p in engine.runs["r"].named_parameters().items()}
    call = submit(engine, "forward_backward", run_id="r", batch=rows(5), request_id="split")
    engine.tick()  # its first part: 2 of 5 rows into the gradients
    assert not call.done() and engine.tick().fb_seconds > 0 and not call.done()
    assert engine.call("cancel", request_id="split", user_id="u1", deadline=True) == {"found": True}
    error = call.result()["error"]
    assert error["code"] == "DEADLINE_EXCEEDED" and error["details"]["compute_seconds"] > 0
    after = {name: cast(torch.Tensor, p.grad) for name, p in engine.runs["r"].named_parameters().items()}
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert engine.optim_step("r")["step"] == 1  # the one applied call's gradients, nothing of the cancelled one
