"""Checkpoints you can resume (docs/CHECKPOINTS.md): named save_state, load_state into a run, create_run from a
checkpoint, deleting one; a resumed run continues bitwise, and a load survives a crash without its checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import load_file

from gpu_runtime.client.runtime_client import RuntimeClient
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput, FailedPrecondition, NotFound, WorkerFailed
from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights, train
from tests.helpers.tiny_model import build_tiny_model

LORA = {"r": 4, "alpha": 8, "dropout": 0.1}
BATCHES = [BATCH[:2], BATCH[2:], BATCH[1:3]]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Bitwise comparisons: one intra-op thread, so every reduction sums in one order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def steps(engine: Engine, run_id: str, batches: list[list[dict]]) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(engine.forward_backward(run_id, batch)["loss"])
        engine.optim_step(run_id, {"learning_rate": 5e-2})
    return losses


def optimizer_state(engine: Engine, run_id: str) -> dict[str, dict[str, torch.Tensor]]:
    state = engine.runs[run_id]
    index = {id(p): name for name, p in state.named_parameters().items()}
    return {index[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in state.optimizer.state.items()}


def test_a_run_from_a_checkpoint_continues_bitwise_like_the_original(engine: Engine, tiny_model_dir: str,
                                                                      one_thread: None) -> None:
    engine.create_run("orig", "u1", tiny_model_dir, LORA, seed=7)
    steps(engine, "orig", BATCHES[:2])
    saved = engine.call("save_state", run_id="orig", mode="state", name="mid")
    assert (saved["name"], saved["step"], saved["with_optimizer"]) == ("mid", 2, True)
    meta = json.loads((Path(saved["checkpoint_path"]) / "checkpoint.json").read_text())
    assert (meta["step"], meta["seed"], meta["lora"]["dropout"], meta["base_model"]) == (2, 7, 0.1, tiny_model_dir)
    assert meta["quantization"] is None and meta["with_optimizer"] is True

    resumed = engine.call("create_run", run_id="copy", user_id="u1", base_model=tiny_model_dir,
                          from_checkpoint="signal://orig/state/mid", with_optimizer=True)
    assert (resumed["step"], resumed["seed"], resumed["lora"]) == (2, 7, engine.runs["orig"].lora)
    assert_same_weights(lora_weights(engine, "copy"), lora_weights(engine, "orig"))

    original = steps(engine, "orig", BATCHES)
    again = steps(engine, "copy", BATCHES)
    assert again == original  # the same dropout masks (seed, step, call) and the same AdamW moments
    assert_same_weights(lora_weights(engine, "copy"), lora_weights(engine, "orig"))
    assert engine.run_info("copy")["step"] == 5


def test_a_run_from_a_checkpoint_refuses_settings_that_disagree_naming_them(engine: Engine,
                                                                            tiny_model_dir: str) -> None:
    engine.create_run("orig", "u1", tiny_model_dir, LORA, seed=7)
    train(engine, "orig", steps=1)
    engine.call("save_state", run_id="orig", mode="adapter", name="w")
    base = {"user_id": "u1", "base_model": tiny_model_dir, "from_checkpoint": "signal://orig/adapter/w"}
    for extra, field in (({"lora": {"r": 8}}, "lora.r"), ({"seed": 3}, "seed")):
        with pytest.raises(BadInput) as caught:
            engine.call("create_run", run_id="x", with_optimizer=False, **base, **extra)
        assert caught.value.field == field
    with pytest.raises(FailedPrecondition) as refused:  # an adapter checkpoint holds no AdamW
        engine.call("create_run", run_id="x", with_optimizer=True, **base)
    assert refused.value.field == "with_optimizer"
    with pytest.raises(NotFound) as other:  # another user's checkpoint is not found, like a missing one
        engine.call("create_run", run_id="x", **{**base, "user_id": "u2"}, with_optimizer=False)
    assert other.value.field == "from_checkpoint"
    same = engine.call("create_run", run_id="x", **base, lora={"r": 4}, seed=7, with_optimizer=False)
    assert same["step"] == 1 and same["seed"] == 7


def test_load_state_without_the_optimizer_takes_the_weights_a_fresh_adamw_and_the_checkpoints_step(
        engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("a", "u1", tiny_model_dir, LORA, seed=1)
    engine.create_run("b", "u1", tiny_model_dir, LORA, seed=2)
    steps(engine, "a", BATCHES[:2])
    engine.call("save_state", run_id="a", mode="state", name="two")
    steps(engine, "b", BATCHES)
    engine.forward_backward("b", BATCH)  # pending gradients: dropped by the load

    loaded = engine.call("load_state", run_id="b", checkpoint="signal://a/state/two", with_optimizer=False,
                         request_id="load-1")
    assert (loaded["step"], loaded["with_optimizer"], loaded["pending_dropped"]) == (2, False, 1)
    assert_same_weights(lora_weights(engine, "b"), lora_weights(engine, "a"))
    assert optimizer_state(engine, "b") == {}  # fresh: no moments, AdamW's own step starts again
    info = engine.run_info("b")
    assert (info["step"], info["pending_forward_backward"], info["seed"]) == (2, 0, 2)  # its own seed stays
    engine.forward_backward("b", BATCH)
    assert engine.optim_step("b", {"learning_rate": 5e-2})["step"] == 3
    assert all(float(s["step"]) == 1.0 for s in optimizer_state(engine, "b").values())

    again = engine.call("load_state", run_id="b", checkpoint="signal://a/state/two", with_optimizer=False,
                        request_id="load-1")
    assert again["replayed"] is True and engine.run_info("b")["step"] == 3  # a retry is not applied twice


def test_load_state_with_the_optimizer_restores_adamw(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("a", "u1", tiny_model_dir, LORA, seed=1)
    steps(engine, "a", BATCHES[:2])
    engine.call("save_state", run_id="a", name="two", mode="state")
    expected = optimizer_state(engine, "a")
    steps(engine, "a", BATCHES)
    assert engine.call("load_state", run_id="a", checkpoint="two")["step"] == 2  # a bare name: this run's state
    got = optimizer_state(engine, "a")
    assert got.keys() == expected.keys()
    for name in got:
        for key in got[name]:
            assert torch.equal(got[name][key], expected[name][key])


@pytest.mark.parametrize(("lora", "field_text"), [({"r": 8, "alpha": 16}, "lora.r"), ({"r": 4, "alpha": 4}, "lora.alpha")])
def test_load_state_refuses_a_checkpoint_of_another_shape_naming_the_field(
        engine: Engine, tiny_model_dir: str, lora: dict, field_text: str) -> None:
    engine.create_run("a", "u1", tiny_model_dir, LORA)
    engine.create_run("b", "u1", tiny_model_dir, lora)
    engine.call("save_state", run_id="a", name="w", mode="state")
    with pytest.raises(BadInput) as caught:
        engine.call("load_state", run_id="b", checkpoint="signal://a/state/w")
    assert caught.value.field == "checkpoint" and caught.value.message.startswith(field_text)


def test_load_state_refuses_a_checkpoint_of_another_base_naming_it(engine: Engine, tiny_model_dir: str) -> None:
    other_base = build_tiny_model(Path(engine.data_dir) / "other-llama",
                                  tokenizer_cache=Path(tiny_model_dir).parent / "smollm2-tokenizer", seed=1)
    engine.create_run("a", "u1", tiny_model_dir, LORA)
    engine.create_run("b", "u1", other_base, LORA)
    engine.call("save_state", run_id="a", name="w", mode="state")
    with pytest.raises(BadInput) as caught:
        engine.call("load_state", run_id="b", checkpoint="signal://a/state/w")
    assert caught.value.field == "checkpoint" and caught.value.message.startswith("base_model")
    with pytest.raises(BadInput) as created:
        engine.call("create_run", run_id="c", user_id="u1", base_model=other_base, from_checkpoint="signal://a/state/w")
    assert created.value.field == "base_model"


def test_another_users_checkpoint_is_not_found(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("a", "u1", tiny_model_dir, LORA)
    engine.create_run("b", "u2", tiny_model_dir, LORA)
    engine.call("save_state", run_id="a", name="w", mode="state")
    with pytest.raises(NotFound) as caught:
        engine.call("load_state", run_id="b", checkpoint="signal://a/state/w")
    assert caught.value.field == "checkpoint" and "signal://a/state/w" in caught.value.message


def test_a_name_is_kept_once_per_kind_and_may_be_shared_across_kinds(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=1)
    first = engine.call("save_state", run_id=tiny_run, mode="state", name="final", request_id="s1")
    assert engine.call("save_state", run_id=tiny_run, mode="adapter", name="final")["name"] == "final"
    train(engine, tiny_run, steps=1)
    with pytest.raises(FailedPrecondition) as caught:
        engine.call("save_state", run_id=tiny_run, mode="state", name="final")
    assert caught.value.field == "name" and "final" in caught.value.message
    retry = engine.call("save_state", run_id=tiny_run, mode="state", name="final", request_id="s1")
    assert retry["replayed"] is True and retry["step"] == first["step"] == 1
    # A fresh runtime forgot the answer: the checkpoint's own record of its request id answers the retry.
    fresh = Engine(engine.data_dir, device="cpu")
    assert fresh.call("save_state", run_id=tiny_run, mode="state", name="final", request_id="s1")["step"] == 1
    # Unnamed saves are step-N, where they always were; again at the same step rewrites the same state.
    unnamed = engine.call("save_state", run_id=tiny_run, mode="adapter")
    assert unnamed["name"] == "step-2" and unnamed["checkpoint_path"].endswith("checkpoints/adapter_step_2")
    assert engine.call("save_state", run_id=tiny_run, mode="adapter")["name"] == "step-2"


def test_save_state_leaves_pending_gradients_out_and_says_so(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("a", "u1", tiny_model_dir, LORA)
    train(engine, "a", steps=1)
    engine.forward_backward("a", BATCH)
    saved = engine.call("save_state", run_id="a", mode="state", name="p")
    assert saved["pending_excluded"] == 1
    weights = lora_weights(engine, "a")
    resumed = engine.call("create_run", run_id="c", user_id="u1", base_model=engine.runs["a"].base_model,
                          from_checkpoint="signal://a/state/p")
    assert resumed["pending_forward_backward"] == 0 and resumed["step"] == 1
    assert_same_weights(lora_weights(engine, "c"), weights)
    assert engine.optim_step("a")["step"] == 2  # the saving run keeps its gradients


def test_delete_checkpoint_removes_its_files(engine: Engine, tiny_run: str) -> None:
    saved = engine.call("save_state", run_id=tiny_run, mode="adapter", name="gone")
    assert engine.call("delete_checkpoint", run_id=tiny_run, mode="adapter", name="gone")["deleted"] is True
    assert not Path(saved["checkpoint_path"]).exists()
    with pytest.raises(NotFound) as caught:
        engine.call("delete_checkpoint", run_id=tiny_run, mode="adapter", name="gone")
    assert caught.value.field == "name"
    with pytest.raises(NotFound):
        engine.call("load_state", run_id=tiny_run, checkpoint=f"signal://{tiny_run}/adapter/gone",
                    with_optimizer=False)


def test_a_crash_after_load_state_restores_the_loaded_weights_without_the_checkpoint(
        tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", snapshot_every_steps=1)
    engine.create_run("a", "u1", tiny_model_dir, LORA, seed=1)
    engine.create_run("b", "u1", tiny_model_dir, LORA, seed=2)
    steps(engine, "a", BATCHES[:1])
    saved = engine.call("save_state", run_id="a", mode="state", name="one")
    steps(engine, "b", BATCHES)  # b's snapshots are at steps 2 and 3, above the step the load brings it to
    engine.call("load_state", run_id="b", checkpoint="signal://a/state/one", request_id="L")
    loaded = lora_weights(engine, "b")
    engine.forward_backward("b", BATCH)  # journaled after the load's snapshot
    grads = {n: cast(torch.Tensor, p.grad).clone() for n, p in engine.runs["b"].named_parameters().items()}
    adapters = tmp_path / "runs" / "u1" / "b" / "lora_adapters"
    assert sorted(p.name for p in adapters.iterdir()) == ["step_1", "step_3"]  # the load's (newest) and step 3's
    assert not (tmp_path / "runs" / "u1" / "b" / "loads").exists()  # the run's copy went once a snapshot held it
    shutil.rmtree(saved["checkpoint_path"])  # the checkpoint is gone; the run never needs it again
    for state in engine.runs.values():
        state.journal.close()
    del engine  # a crash: nothing shut down, nothing more saved

    fresh = Engine(tmp_path, device="cpu")
    info = fresh.run_info("b")
    assert (info["step"], info["pending_forward_backward"]) == (1, 1)  # the step_1 snapshot, newer than step_3's
    assert_same_weights(lora_weights(fresh, "b"), loaded)
    for name, p in fresh.runs["b"].named_parameters().items():
        assert torch.equal(cast(torch.Tensor, p.grad), grads[name])
    assert fresh.call("load_state", run_id="b", checkpoint="signal://a/state/one", request_id="L")["replayed"]


def test_a_kill_between_the_loads_journal_record_and_its_snapshot_replays_the_runs_own_copy(
        tmp_path: Path, tiny_model_dir: str) -> None:
    """The runtime killed while writing the snapshot after load_state (the during_snapshot failpoint): the restore
    replays the journaled load from the copy staged in the run, never from the checkpoint (deleted here)."""
    data = tmp_path / "data"
    first = Engine(data, device="cpu")
    first.create_run("a", "u1", tiny_model_dir, LORA, seed=1)
    first.create_run("b", "u1", tiny_model_dir, LORA, seed=2)
    steps(first, "a", BATCHES[:2])
    saved = first.call("save_state", run_id="a", mode="state", name="two")
    steps(first, "b", BATCHES[:1])
    first.shutdown()
    expected = load_file(str(Path(saved["checkpoint_path"]) / "adapter_model.safetensors"))

    client = RuntimeClient(str(data), device="cpu", log_path=str(tmp_path / "worker.log"))
    try:
        client.env = {"SIGNAL_RUNTIME_FAULTS": "during_snapshot"}
        client.start()
        with pytest.raises(WorkerFailed):
            client.call("load_state", run_id="b", checkpoint="signal://a/state/two", request_id="L")
        assert (data / "runs" / "u1" / "b" / "loads").is_dir()  # staged, journaled; its snapshot never finished
        shutil.rmtree(saved["checkpoint_path"])
        client.env = {}
        info = client.call("run_info", run_id="b")
        assert (info["step"], info["pending_forward_backward"]) == (2, 0)
        again = client.call("load_state", run_id="b", checkpoint="signal://a/state/two", request_id="L")
        assert again["replayed"] is True and again["step"] == 2
        client.call("close_run", run_id="b")  # snapshot and free: the engine below reads what it left
    finally:
        client.close()
    fresh = Engine(data, device="cpu")
    assert_same_weights(lora_weights(fresh, "b"), expected)
