"""Bounded memory: resident runs fit a byte budget (least recently used idle runs go first), and a
base with no resident runs is unloaded after its idle time; both come back on the next call."""

from __future__ import annotations

from pathlib import Path

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights, train

LORA = {"r": 8, "alpha": 16}


def test_runs_past_the_byte_budget_are_evicted_least_recently_used_first(tmp_path: Path, tiny_model_dir: str) -> None:
    probe = Engine(tmp_path / "probe", device="cpu")
    probe.create_run("p", "u1", tiny_model_dir, LORA)
    train(probe, "p", steps=1)
    one_run = probe.runtime_state()["resident_bytes"]  # parameters + AdamW moments after a step

    engine = Engine(tmp_path / "data", device="cpu", resident_bytes=int(2.5 * one_run))
    trained = {}
    for run_id in ("r1", "r2", "r3"):
        engine.create_run(run_id, "u1", tiny_model_dir, LORA)
        train(engine, run_id, steps=1)
        trained[run_id] = lora_weights(engine, run_id)
    state = engine.runtime_state()
    assert [r["run_id"] for r in state["resident_runs"]] == ["r2", "r3"]
    assert state["evicted_runs"] == ["r1"] and state["resident_bytes"] <= state["budget"]["bytes"]

    assert_same_weights(lora_weights(engine, "r1"), trained["r1"])  # reloaded; r2, now least recent, goes
    state = engine.runtime_state()
    assert [r["run_id"] for r in state["resident_runs"]] == ["r3", "r1"] and "r2" in state["evicted_runs"]
    train(engine, "r1", steps=1)
    reference = Engine(tmp_path / "reference", device="cpu")
    reference.create_run("r1", "u1", tiny_model_dir, LORA)
    train(reference, "r1", steps=2)
    assert_same_weights(lora_weights(engine, "r1"), lora_weights(reference, "r1"))


def test_a_base_without_resident_runs_is_unloaded_and_reloaded_on_demand(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", base_idle_seconds=1e-6)
    engine.create_run("r1", "u1", tiny_model_dir, LORA)
    train(engine, "r1", steps=1)
    assert [b["name"] for b in engine.runtime_state()["bases"]] == [tiny_model_dir]  # in use: kept
    weights = lora_weights(engine, "r1")
    engine.close_run("r1")
    engine.ping()  # a tick: its housekeeping finds the base idle past base_idle_seconds
    assert engine.runtime_state()["bases"] == [] and engine.ping()["loaded_models"] == []

    assert engine.forward_backward("r1", BATCH)["step"] == 1  # the base and the run come back
    assert engine.models.load_count[tiny_model_dir] == 2
    engine.close_run("r1")
    reopened = Engine(tmp_path, device="cpu")
    assert reopened.run_info("r1")["pending_forward_backward"] == 1
    restored = lora_weights(reopened, "r1")
    assert_same_weights(restored, weights)
