"""What a run leaves on disk, restoring it in a fresh engine, and the three save_state modes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_runtime.client.persistence import sha256_json
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput, RunNotFound
from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights, run_logits, train

LORA = {"r": 4, "alpha": 8, "dropout": 0.1}
PROBE = [28120, 905, 314, 260, 3575, 282, 4649]


def test_run_directory_layout_and_manifest(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir, LORA, seed=4)
    engine.forward_backward("r1", BATCH[:2])
    engine.forward_backward("r1", BATCH[2:])
    engine.optim_step("r1", {"learning_rate": 1e-3})
    root = engine.data_dir / "runs" / "u1" / "r1"

    config = json.loads((root / "config.json").read_text())
    assert config["base_model"] == tiny_model_dir and config["seed"] == 4 and config["lora"]["r"] == 4
    assert (root / "journal" / "records.log").is_file()
    assert not (root / "lora_adapters").exists()  # one step is journaled, not snapshotted
    header, step = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    assert header["base_model"]["revision"].startswith("sha256:")
    assert header["lora"] == config["lora"] and header["seed"] == 4
    assert step["step"] == 1 and step["adam"]["learning_rate"] == 1e-3
    expected = [sha256_json({"loss_fn": "cross_entropy", "batch": half}) for half in (BATCH[:2], BATCH[2:])]
    assert [b["sha256"] for b in step["batches"]] == expected
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


def test_snapshots_every_n_steps_and_keeps_the_newest(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", snapshot_every_steps=1, keep_snapshots=2)
    engine.create_run("r1", "u1", tiny_model_dir)
    train(engine, "r1", steps=4)
    steps = sorted(p.name for p in (tmp_path / "runs" / "u1" / "r1" / "lora_adapters").iterdir())
    assert steps == ["step_3", "step_4"]
    step_4 = tmp_path / "runs" / "u1" / "r1" / "lora_adapters" / "step_4"
    meta = json.loads((step_4 / "snapshot.json").read_text())
    assert meta["step"] == 4 and meta["seq"] == 8 and meta["pending_included"] is False  # 4 × (fb + optim)
    assert sorted(p.name for p in step_4.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "snapshot.json"]


def test_creating_an_existing_run_id_is_bad_input(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir)
    with pytest.raises(BadInput) as caught:
        engine.create_run("r1", "u2", tiny_model_dir)
    assert caught.value.field == "run_id"
    fresh = Engine(engine.data_dir, device="cpu")  # also when only the disk knows it
    with pytest.raises(BadInput):
        fresh.create_run("r1", "u1", tiny_model_dir)


@pytest.mark.parametrize(("run_id", "user_id", "field"), [("../x", "u", "run_id"), ("r", "a/b", "user_id"), ("", "u", "run_id")])
def test_ids_must_be_safe_path_names(engine: Engine, tiny_model_dir: str, run_id: str, user_id: str, field: str) -> None:
    with pytest.raises(BadInput) as caught:
        engine.create_run(run_id, user_id, tiny_model_dir)
    assert caught.value.field == field


def test_restored_run_continues_exactly_as_if_never_interrupted(tmp_path: Path, tiny_model_dir: str) -> None:
    first = Engine(tmp_path / "restarted", device="cpu")
    first.create_run("r1", "u1", tiny_model_dir, LORA, seed=3)
    train(first, "r1", steps=2)
    del first

    second = Engine(tmp_path / "restarted", device="cpu")  # a new worker after a crash
    assert second.run_info("r1")["step"] == 2  # restored transparently
    second.forward_backward("r1", BATCH)
    assert second.optim_step("r1", {"learning_rate": 1e-2})["step"] == 3

    uninterrupted = Engine(tmp_path / "uninterrupted", device="cpu")
    uninterrupted.create_run("r1", "u1", tiny_model_dir, LORA, seed=3)
    train(uninterrupted, "r1", steps=3)
    assert_same_weights(lora_weights(second, "r1"), lora_weights(uninterrupted, "r1"))


def test_load_close_and_delete(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir)
    train(engine, "r1", steps=1)
    before = lora_weights(engine, "r1")
    assert engine.close_run("r1")["closed"]
    assert engine.ping()["runs_in_memory"] == []
    info = engine.load_run("r1")
    assert info["step"] == 1 and info["user_id"] == "u1" and info["base_model"] == tiny_model_dir
    assert_same_weights(lora_weights(engine, "r1"), before)
    assert engine.delete_run("r1")["deleted"]
    assert not (engine.data_dir / "runs" / "u1" / "r1").exists()
    with pytest.raises(RunNotFound):
        engine.run_info("r1")


# PEFT 0.21 reads a property transformers 5 deprecated.
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_saved_adapter_reproduces_engine_logits_with_plain_peft(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir, LORA)
    engine.create_run("r2", "u1", tiny_model_dir, LORA, seed=9)
    train(engine, "r1", steps=2, lr=5e-2)
    train(engine, "r2", steps=1, lr=5e-2)
    saved = engine.save_state("r1", "adapter")
    assert saved["mode"] == "adapter" and saved["step"] == 2 and saved["size_bytes"] > 0
    assert saved["checkpoint_path"].endswith("runs/u1/r1/checkpoints/adapter_step_2")

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain = PeftModel.from_pretrained(base, saved["checkpoint_path"]).eval()
    with torch.no_grad():
        expected = plain(input_ids=torch.tensor([PROBE])).logits[0]
    torch.testing.assert_close(run_logits(engine, "r1", PROBE), expected, rtol=1e-5, atol=1e-5)


def test_merged_model_reproduces_engine_logits_and_leaves_the_base_alone(engine: Engine, tiny_model_dir: str) -> None:
    engine.create_run("r1", "u1", tiny_model_dir, LORA)
    engine.create_run("r2", "u1", tiny_model_dir, LORA, seed=9)
    train(engine, "r1", steps=2, lr=5e-2)
    train(engine, "r2", steps=1, lr=5e-2)
    other_before = run_logits(engine, "r2", PROBE)

    saved = engine.save_state("r1", "merged")
    merged = AutoModelForCausalLM.from_pretrained(saved["checkpoint_path"]).eval()
    assert AutoTokenizer.from_pretrained(saved["checkpoint_path"]).chat_template
    with torch.no_grad():
        merged_logits = merged(input_ids=torch.tensor([PROBE])).logits[0]
    torch.testing.assert_close(merged_logits, run_logits(engine, "r1", PROBE), rtol=1e-4, atol=1e-4)
    assert torch.equal(run_logits(engine, "r2", PROBE), other_before)
    assert engine.forward_backward("r1", BATCH)["step"] == 2  # the run trains on after a merge


def test_state_mode_holds_adapter_and_optimizer(engine: Engine, tiny_run: str) -> None:
    train(engine, tiny_run, steps=1)
    saved = engine.save_state(tiny_run, "state")
    names = sorted(p.name for p in Path(saved["checkpoint_path"]).iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", "checkpoint.json", "config.json",
                     "optimizer_state.pt"]
    payload = torch.load(Path(saved["checkpoint_path"]) / "optimizer_state.pt", weights_only=True)
    assert payload["step"] == 1 and payload["optimizer"]["state"]


def test_unknown_save_mode(engine: Engine, tiny_run: str) -> None:
    with pytest.raises(BadInput) as caught:
        engine.save_state(tiny_run, "everything")
    assert caught.value.field == "mode"
