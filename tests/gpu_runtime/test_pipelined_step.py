"""A run's forward_backward and the optim_step queued right behind it share a tick (issue 30, item 4): a pipelining
client (the SDK, Tinker's cookbook) pays one tick and one journal fsync a training step, with the same weights and
the same journal as two ticks. Only the run's very next call joins, in its ticket's turn, and only once its
forward_backward completed; a failed or cancelled call leaves today's order."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights, result_of, submit

LORA = {"r": 4, "alpha": 8}
ADAM = {"learning_rate": 1e-2}
ROW = [28120, 905, 314, 260, 3575, 282, 1188, 2683, 16, 469, 1151, 3240, 260, 8624, 1060, 30]  # 16 tokens


def engine_with(path: Path, model: str, *runs: str, **options: Any) -> tuple[Engine, list[int]]:
    """An engine with `runs` (one user each, seed 1) and the list its after_sync appends to: one entry per tick whose
    journals were fsync'd."""
    synced: list[int] = []
    engine = Engine(path, device="cpu", snapshot_every_steps=1000, after_sync=lambda: synced.append(1), **options)
    for run_id in runs:
        engine.create_run(run_id, f"user-{run_id}", model, LORA, seed=1)
    synced.clear()
    return engine, synced


def step_calls(engine: Engine, run_id: str, batch: list[dict[str, Any]] = BATCH,
               tickets: tuple[int, int] | None = None) -> tuple[Future[dict[str, Any]], Future[dict[str, Any]]]:
    fb, step = ({"ticket": tickets[0]}, {"ticket": tickets[1]}) if tickets else ({}, {})
    return (submit(engine, "forward_backward", run_id=run_id, batch=batch, **fb),
            submit(engine, "optim_step", run_id=run_id, adam=ADAM, request_id=f"step-{run_id}", **step))


def journal_types(engine: Engine, run_id: str) -> list[str]:
    return [str(record["type"]) for record in engine.runs[run_id].journal.read()]


def test_a_pipelined_step_takes_one_tick_and_one_fsync_with_the_weights_of_two(tmp_path: Path,
                                                                               tiny_model_dir: str) -> None:
    together, together_synced = engine_with(tmp_path / "one", tiny_model_dir, "r")
    trained, stepped = step_calls(together, "r")
    stats = together.tick()
    assert trained.done() and stepped.done()
    assert (stats.base_passes, stats.joined, stats.requests, len(together_synced)) == (1, 1, 2, 1)
    assert result_of(stepped)["step"] == 1 and result_of(trained)["step"] == 0
    assert journal_types(together, "r") == ["forward_backward", "optim_step"]

    apart, apart_synced = engine_with(tmp_path / "two", tiny_model_dir, "r")
    trained_alone = submit(apart, "forward_backward", run_id="r", batch=BATCH)
    assert apart.tick().joined == 0 and trained_alone.done()
    assert apart.call("optim_step", run_id="r", adam=ADAM, request_id="step-r")["step"] == 1
    assert len(apart_synced) == 2
    assert result_of(trained)["loss"] == result_of(trained_alone)["loss"]
    assert_same_weights(lora_weights(together, "r"), lora_weights(apart, "r"))  # bitwise

    together.runs["r"].journal.close()
    restarted = Engine(tmp_path / "one", device="cpu", snapshot_every_steps=1000)  # a crash: the journal replays
    assert restarted.run_info("r")["step"] == 1
    assert_same_weights(lora_weights(restarted, "r"), lora_weights(apart, "r"))


def test_of_two_runs_only_the_pipelined_one_steps_in_the_tick(tmp_path: Path, tiny_model_dir: str) -> None:
    engine, synced = engine_with(tmp_path, tiny_model_dir, "p", "q")
    p_trained, p_stepped = step_calls(engine, "p", tickets=(1, 2))  # as a server numbers them: the step's turn is next
    q_trained = submit(engine, "forward_backward", run_id="q", batch=BATCH)
    stats = engine.tick()
    assert (stats.base_passes, stats.fb_runs, stats.joined, len(synced)) == (1, 2, 1, 1)  # one pass, one fsync
    assert p_trained.done() and p_stepped.done() and q_trained.done()
    assert engine.run_info("p")["step"] == 1 and engine.run_info("p")["pending_forward_backward"] == 0
    assert engine.run_info("q")["step"] == 0 and engine.run_info("q")["pending_forward_backward"] == 1
    q_stepped = submit(engine, "optim_step", run_id="q", adam=ADAM)
    assert engine.tick().joined == 0 and result_of(q_stepped)["step"] == 1  # a step alone: today's tick


def test_a_split_forward_backward_steps_in_the_tick_its_last_part_runs(tmp_path: Path, tiny_model_dir: str) -> None:
    engine, synced = engine_with(tmp_path, tiny_model_dir, "r", tick_tokens=32)  # two 16-token rows a tick
    rows = [{"tokens": ROW, "weights": [0] + [1] * (len(ROW) - 1)} for _ in range(5)]
    trained, stepped = step_calls(engine, "r", rows)
    for _ in range(2):  # 2 + 2 of 5 rows: the call is not done, so its step waits
        assert engine.tick().joined == 0 and not trained.done() and not stepped.done()
        assert engine.runs["r"].step == 0
    stats = engine.tick()  # the last row, then the step
    assert stats.joined == 1 and trained.done() and result_of(stepped)["step"] == 1
    assert journal_types(engine, "r") == ["forward_backward", "optim_step"] and len(synced) == 1


@pytest.mark.parametrize("between", ["cancel", "save_state", "failed forward_backward", "later ticket"])
def test_a_step_not_right_behind_a_completed_forward_backward_keeps_todays_order(
        tmp_path: Path, tiny_model_dir: str, between: str) -> None:
    faults = {"raise_in_count"} if between == "failed forward_backward" else None
    engine, _ = engine_with(tmp_path, tiny_model_dir, "r", faults=faults)
    tickets: dict[str, Any] = {"ticket": 1} if between == "later ticket" else {}
    trained = submit(engine, "forward_backward", run_id="r", batch=BATCH, **tickets,
                     request_id="raise-fb" if faults else "fb")
    saved = submit(engine, "save_state", run_id="r", name="mid") if between == "save_state" else None
    stepped = submit(engine, "optim_step", run_id="r", adam=ADAM, request_id="opt", **({"ticket": 3} if tickets else {}))
    if between == "cancel":
        submit(engine, "cancel", request_id="opt", user_id="user-r")  # a system call: runs first in the tick
    stats = engine.tick()
    assert trained.done() and stats.joined == 0
    if between == "cancel":
        assert result_of_error(stepped) == "CANCELLED"
        assert engine.run_info("r")["step"] == 0 and journal_types(engine, "r") == ["forward_backward"]
        return
    assert not stepped.done()  # it waits for the next tick (the ticketed one: for ticket 2, or its wait)
    if between == "save_state":
        assert engine.tick().joined == 0 and saved is not None and result_of(saved)["step"] == 0
        assert not stepped.done()
    if between == "later ticket":
        engine.scheduler.release_ticket("r", 2)  # ticket 2 will not come (refused at its server)
    engine.tick()
    if between == "failed forward_backward":
        assert result_of_error(trained) == "INTERNAL" and result_of_error(stepped) == "FAILED_PRECONDITION"
    else:
        assert result_of(stepped)["step"] == 1


def result_of_error(future: Future[dict[str, Any]]) -> str:
    return str(future.result(timeout=0)["error"]["code"])
