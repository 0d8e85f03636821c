"""`signal pull RUN_ID DIR` (issue 8 §4): a run's artifacts to a local directory, and the run re-derived from
them alone in a fresh data directory, by its newest snapshot and the journal after it: same weights, same loss."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpu_runtime.client.run_files import select_artifacts
from tests.app.test_cli import cli_env, run_cli


def test_select_artifacts_keeps_the_newest_snapshot_and_whole_files_only() -> None:
    listing = ["config.json", "manifest.jsonl", "journal/records.log", "lora_adapters/step_2/adapter_model.safetensors",
               "lora_adapters/step_10/adapter_model.safetensors", "lora_adapters/step_10/optimizer.pt",
               "checkpoints/adapter_step_3/adapter_config.json", "checkpoints/.adapter_step_4.tmp-1/adapter_config.json",
               "lora_adapters/.step_11.tmp-9/snapshot.json", "stray.txt"]
    assert select_artifacts(listing) == [
        "checkpoints/adapter_step_3/adapter_config.json", "config.json", "journal/records.log",
        "lora_adapters/step_10/adapter_model.safetensors", "lora_adapters/step_10/optimizer.pt", "manifest.jsonl"]


def test_pull_then_rederive_from_the_journal(tmp_path: Path, tiny_model_dir: str) -> None:
    from gpu_runtime.engine.engine import Engine
    from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights, train

    data = tmp_path / "data"
    engine = Engine(data, device="cpu", snapshot_every_steps=2)  # snapshots at 2 and 4, and 5 (save_state)
    engine.create_run("run-p", "user-1", tiny_model_dir, {"r": 4, "alpha": 8, "dropout": 0.1}, seed=7)
    losses = train(engine, "run-p", 5)
    engine.save_state("run-p", mode="adapter")
    engine.forward_backward("run-p", BATCH[:2])  # pending gradients, journaled but not yet stepped
    weights = lora_weights(engine, "run-p")

    pulled = tmp_path / "pulled"
    result = run_cli(cli_env(data), "pull", "run-p", str(pulled))
    assert result.returncode == 0, result.stderr
    assert "pulled" in result.stdout
    names = {p.relative_to(pulled).as_posix() for p in pulled.rglob("*") if p.is_file()}
    assert {"config.json", "manifest.jsonl", "pull.json", "checkpoints/adapter_step_5/adapter_model.safetensors"} <= names
    assert any(n.startswith("journal/") for n in names)
    assert {n.split("/")[1] for n in names if n.startswith("lora_adapters/")} == {"step_5"}  # the newest only
    record = json.loads((pulled / "pull.json").read_text())
    assert {f["path"] for f in record["files"]} == names - {"pull.json"}

    # A second pull into the same (now full) directory is refused, naming it.
    again = run_cli(cli_env(data), "pull", "run-p", str(pulled))
    assert again.returncode == 1 and "not empty" in again.stderr
    missing = run_cli(cli_env(data), "pull", "no-such-run", str(tmp_path / "x"))
    assert missing.returncode == 1 and "not found" in missing.stderr

    # Re-derive: the pulled files in a fresh data directory; the newest snapshot, then the journal after it (compaction
    # dropped the records before the oldest kept snapshot, so the seed alone no longer replays to the run).
    assert not any(n.startswith("journal/records.log") for n in names)
    fresh = tmp_path / "fresh"
    run_dir = fresh / "runs" / "user-1" / "run-p"
    shutil.copytree(pulled, run_dir, ignore=shutil.ignore_patterns("pull.json"))
    again_engine = Engine(fresh, device="cpu")
    info = again_engine.run_info("run-p")
    assert info["step"] == 5 and info["pending_forward_backward"] == 1
    assert_same_weights(lora_weights(again_engine, "run-p"), weights)  # bitwise on CPU
    # And it trains on as the original does: the same loss, then the same step (pending gradients included).
    assert again_engine.forward_backward("run-p", BATCH[2:])["loss"] == engine.forward_backward("run-p", BATCH[2:])["loss"]
    stepped = [e.optim_step("run-p", {"learning_rate": 1e-2}) for e in (again_engine, engine)]
    for answer in stepped:
        assert answer.pop("compute_seconds") > 0  # a timing: the one field that may differ
    assert stepped[0] == stepped[1]
    assert_same_weights(lora_weights(again_engine, "run-p"), lora_weights(engine, "run-p"))
    manifest = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert [line["step"] for line in manifest[1:]] == [1, 2, 3, 4, 5, 6] and len(losses) == 5  # 6: the step just taken
