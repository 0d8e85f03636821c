"""Sampler snapshots (save_weights_for_sampler) and samples off their run's queue: frozen weights, one decode group for
every pending sample, restarts, eviction, expiry and deletion while sampled."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import FailedPrecondition, NotFound, RunNotFound
from tests.helpers.engine_tools import BATCH, result_of, submit, train

PROMPTS = ["hello", "The capital of France is"]


def greedy(engine: Engine, run_id: str | None, snapshot: str | None = None, **extra: Any) -> list[list[int]]:
    result = engine.call("sample", run_id=run_id, snapshot=snapshot, prompts=PROMPTS, max_tokens=8, temperature=0.0,
                         **extra)
    return [seq[0]["tokens"] for seq in result["sequences"]]


def pump_until(engine: Engine, future: Future[dict[str, Any]], most: int = 500) -> int:
    for ticks in range(1, most + 1):
        engine.tick()
        if future.done():
            return ticks
    raise AssertionError("not answered")


def test_a_snapshot_keeps_its_weights_while_the_run_trains(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=2, lr=5e-2)
    before_current = greedy(engine, tiny_run)
    saved = engine.save_weights_for_sampler(tiny_run, "frozen")
    assert saved["name"] == "frozen" and saved["named"] and saved["step"] == 2
    assert (Path(saved["path"]) / "adapter_model.safetensors").is_file()
    before = greedy(engine, tiny_run, "frozen")  # a tick of its own: nothing else pads the group
    assert before == before_current  # the same weights as the run's when it was frozen
    train(engine, tiny_run, steps=5, lr=5e-2)
    assert greedy(engine, tiny_run, "frozen") == before
    state = engine.runtime_state()
    assert [s["key"] for s in state["sampler_snapshots"]] == [f"{tiny_run}@frozen"]


def test_a_base_sample_is_the_base_alone(engine: Engine, tiny_run: str, tiny_model_dir: str) -> None:
    untrained = greedy(engine, tiny_run)  # B is zero before any step: the base's own tokens
    train(engine, tiny_run, steps=3, lr=5e-2)
    assert greedy(engine, None, base_model=tiny_model_dir, user_id="user-2") == untrained


def test_a_snapshot_sample_finishes_before_a_queued_forward_backward(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-4)  # one token per tick
    engine.create_run("run-a", "user-1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=1)
    engine.save_weights_for_sampler("run-a", "s")
    order: list[str] = []

    def tracked(name: str, method: str, **params: Any) -> Future[dict[str, Any]]:
        future: Future[dict[str, Any]] = Future()
        future.add_done_callback(lambda _: order.append(name))
        engine.submit_message(method, params, future.set_result)
        return future

    long = tracked("long", "sample", run_id="run-a", prompts=["hello"], max_tokens=40, temperature=1.0, seed=3)
    engine.tick()  # the long sample decodes on the run's current weights: it holds the run
    fb = tracked("fb", "forward_backward", run_id="run-a", batch=BATCH)
    assert [r.method for r in engine.scheduler.queued_on("run-a")] == ["sample", "forward_backward"]  # fb is queued
    frozen = tracked("frozen", "sample", run_id="run-a", snapshot="s", prompts=["hi"], max_tokens=3, temperature=0.0)
    pump_until(engine, frozen)
    assert result_of(frozen)["sequences"][0][0]["stop_reason"] in ("length", "stop")
    assert not fb.done() and not long.done()
    pump_until(engine, fb)
    assert order == ["frozen", "long", "fb"]
    assert result_of(fb)["num_examples"] == len(BATCH)


def test_32_concurrent_snapshot_samples_share_one_decode_group(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=1)
    engine.save_weights_for_sampler(tiny_run, "s")
    # 200 tokens: more than one decode chunk (0.25 s) of 64 rows takes, so the group is still there after one tick.
    futures = [submit(engine, "sample", run_id=tiny_run, snapshot="s", prompts=[f"prompt {i}"], max_tokens=200,
                      num_samples=2, seed=i) for i in range(32)]
    engine.tick()
    groups = engine.runtime_state()["decode_groups"]
    assert len(groups) == 1 and groups[0]["calls"] == 32 and groups[0]["rows"] == 64
    assert set(groups[0]["runs"]) == {f"{tiny_run}@s"}
    in_use = engine.runtime_state()["sampler_snapshots"][0]["in_use"]
    assert in_use == 32 or all(f.done() for f in futures)
    for future in futures:
        pump_until(engine, future)
        assert [len(s) for s in result_of(future)["sequences"]] == [2]
    assert engine.runtime_state()["sampler_snapshots"][0]["in_use"] == 0


def test_a_sample_sent_with_its_save_waits_for_the_save(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=1)
    save = submit(engine, "save_weights_for_sampler", run_id=tiny_run, name="next")
    sample = submit(engine, "sample", run_id=tiny_run, snapshot="next", prompts=["hi"], max_tokens=2)
    pump_until(engine, sample)
    assert result_of(save)["name"] == "next"
    assert result_of(sample)["step"] == 1


def test_named_snapshots_survive_a_restart_and_unnamed_ones_do_not(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu")
    engine.create_run("run-a", "user-1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=1)
    train(engine, "run-a", steps=2, lr=5e-2)
    engine.save_weights_for_sampler("run-a", "keep")
    unnamed = engine.save_weights_for_sampler("run-a")
    assert not unnamed["named"] and unnamed["expires_in_seconds"] == engine.options.unnamed_snapshot_seconds
    kept = greedy(engine, "run-a", "keep")
    assert greedy(engine, "run-a", unnamed["name"]) == kept
    engine.shutdown()

    again = Engine(tmp_path / "data", device="cpu")
    assert greedy(again, "run-a", "keep") == kept
    assert again.call("sample", run_id="run-a", snapshot="keep", prompts=["hi"], max_tokens=1)["step"] == 2
    with pytest.raises(NotFound) as missing:
        greedy(again, "run-a", unnamed["name"])
    assert missing.value.field == "snapshot"
    assert "save_weights_for_sampler again" in str(missing.value) and "restart" in str(missing.value)


def test_an_evicted_unnamed_snapshot_spills_and_expires(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu", resident_bytes=1)  # every idle run and snapshot is evicted
    engine.create_run("run-a", "user-1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=1)
    train(engine, "run-a", steps=1, lr=5e-2)
    name = engine.save_weights_for_sampler("run-a")["name"]
    spill = engine.snapshots.scratch / f"run-a@{name}.safetensors"
    assert spill.is_file()  # evicted after its tick: spilled
    first = greedy(engine, "run-a", name)  # loaded back from the spill
    assert spill.is_file()  # and evicted again once the sample finished
    assert greedy(engine, "run-a", name) == first
    gone = engine.snapshots.expire(now=float("inf"))
    assert gone == [f"run-a@{name}"] and not spill.exists()
    with pytest.raises(NotFound):
        greedy(engine, "run-a", name)


def test_a_snapshot_being_sampled_is_never_evicted_and_its_run_cannot_be_deleted(tmp_path: Path,
                                                                                tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu", resident_bytes=1, decode_chunk_seconds=1e-4)
    engine.create_run("run-a", "user-1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=1)
    engine.save_weights_for_sampler("run-a", "s")
    sample = submit(engine, "sample", run_id="run-a", snapshot="s", prompts=["hello"], max_tokens=30,
                    temperature=1.0, seed=2)
    engine.tick()
    snapshot = engine.snapshots.entries["run-a@s"]
    assert snapshot.in_use == 1 and snapshot.weights is not None  # over budget, and kept: a decode group reads it
    with pytest.raises(FailedPrecondition) as refused:
        engine.delete_run("run-a")
    assert refused.value.field == "run_id"
    assert not sample.done()
    pump_until(engine, sample)
    assert snapshot.in_use == 0 and snapshot.weights is None  # idle now: evicted (a named one reloads from disk)
    assert engine.delete_run("run-a")["deleted"]
    with pytest.raises(RunNotFound):  # the run is gone, and its snapshots with it
        greedy(engine, "run-a", "s")


def test_a_forward_on_a_snapshot_reads_its_frozen_weights(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=2, lr=5e-2)
    at_save = engine.forward(BATCH, tiny_run)
    saved = engine.save_weights_for_sampler(tiny_run, "frozen")
    assert Path(saved["path"]).parts[-3:] == ("checkpoints", "sampler", "frozen")  # where checkpoints of its kind live
    train(engine, tiny_run, steps=3, lr=5e-2)
    moved = engine.forward(BATCH, tiny_run)
    frozen = engine.forward(BATCH, tiny_run, snapshot="frozen")
    assert frozen["step"] == 2 and moved["step"] == 5
    assert frozen["loss"] == pytest.approx(at_save["loss"], abs=1e-5)
    assert moved["loss"] != pytest.approx(at_save["loss"], abs=1e-3)
    for mine, theirs in zip(frozen["outputs"], at_save["outputs"]):
        assert mine["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)


def test_a_forward_sent_with_its_save_waits_for_the_save(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=1)
    save = submit(engine, "save_weights_for_sampler", run_id=tiny_run, name="next")
    forward = submit(engine, "forward", run_id=tiny_run, snapshot="next", batch=BATCH)
    pump_until(engine, forward)
    assert result_of(save)["name"] == "next"
    assert result_of(forward)["step"] == 1 and result_of(forward)["num_examples"] == len(BATCH)


def test_deleting_a_sampler_checkpoint_deletes_the_snapshot_unless_it_is_sampled(tmp_path: Path,
                                                                                 tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-4)
    engine.create_run("run-a", "user-1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=1)
    path = Path(engine.save_weights_for_sampler("run-a", "s")["path"])
    sample = submit(engine, "sample", run_id="run-a", snapshot="s", prompts=["hello"], max_tokens=30,
                    temperature=1.0, seed=2)
    engine.tick()
    with pytest.raises(FailedPrecondition) as refused:
        engine.call("delete_checkpoint", run_id="run-a", mode="sampler", name="s")
    assert refused.value.field == "snapshot" and path.is_dir()
    pump_until(engine, sample)
    deleted = engine.call("delete_checkpoint", run_id="run-a", mode="sampler", name="s")
    assert deleted == {"run_id": "run-a", "mode": "sampler", "name": "s", "deleted": True}
    assert not path.exists() and "run-a@s" not in engine.snapshots.entries
    with pytest.raises(NotFound) as missing:
        greedy(engine, "run-a", "s")
    assert missing.value.field == "snapshot"


def test_deleting_an_unnamed_snapshots_row_drops_it_from_memory(engine: Engine, tiny_run: str) -> None:
    name = engine.save_weights_for_sampler(tiny_run)["name"]
    assert f"{tiny_run}@{name}" in engine.snapshots.entries
    engine.call("delete_checkpoint", run_id=tiny_run, mode="sampler", name=name)
    assert f"{tiny_run}@{name}" not in engine.snapshots.entries
    with pytest.raises(NotFound) as again:
        engine.call("delete_checkpoint", run_id=tiny_run, mode="sampler", name=name)
    assert again.value.field == "name"


@pytest.mark.parametrize("mode", ["state", "adapter"])
def test_a_named_training_checkpoint_is_a_weights_source(tmp_path: Path, tiny_model_dir: str, mode: str) -> None:
    """sample and forward read a state or adapter checkpoint's adapter, frozen, while the run trains on; deleting it
    is refused while a sample reads it."""
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-4)
    engine.create_run("run-c", "user-1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=1)
    train(engine, "run-c", steps=2, lr=5e-2)
    at_save = greedy(engine, "run-c")
    batch = [{"text": "checkpoints are weights too"}]
    scored = engine.forward(batch, run_id="run-c")["outputs"][0]["logprobs"]
    engine.call("save_state", run_id="run-c", mode=mode, name="best")
    train(engine, "run-c", steps=3, lr=5e-2)
    assert greedy(engine, "run-c") != at_save  # the run moved on
    assert engine.call("sample", run_id="run-c", checkpoint="best", prompts=PROMPTS, max_tokens=8,
                       temperature=0.0)["step"] == 2
    assert greedy(engine, "run-c", checkpoint="best") == at_save
    again = engine.call("forward", batch=batch, run_id="run-c", checkpoint="best")["outputs"][0]["logprobs"]
    assert again == pytest.approx(scored, abs=1e-5)
    sample = submit(engine, "sample", run_id="run-c", checkpoint="best", prompts=["hello"], max_tokens=30,
                    temperature=1.0, seed=2)
    engine.tick()
    with pytest.raises(FailedPrecondition) as refused:
        engine.call("delete_checkpoint", run_id="run-c", mode=mode, name="best")
    assert refused.value.field == "name"
    pump_until(engine, sample)
    engine.call("delete_checkpoint", run_id="run-c", mode=mode, name="best")
    with pytest.raises(NotFound) as missing:
        greedy(engine, "run-c", checkpoint="best")
    assert missing.value.field == "checkpoint"
