"""A journal written before the engine was typed from edge to edge (commit 2c2a128, contract 10: its records dict
literals; tests/fixtures/make_journal_v10.py wrote it) replays bitwise under this code: the restored run equals a
twin that made the same calls live here, in weights, pending gradients, AdamW moments and its answers to retries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gpu_runtime.engine.engine import Engine
from tests.fixtures.make_legacy_datadir import BATCHES
from tests.helpers.engine_tools import assert_same_weights, lora_weights

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "journal_v10"
RUN, USER = "v10-run", "v10-user"


def test_a_journal_written_before_typed_records_replays_bitwise(tmp_path: Path, tiny_model_dir: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(FIXTURE / "runs", tmp_path / "old" / "runs")
    config_path = tmp_path / "old" / "runs" / USER / RUN / "config.json"
    config = json.loads(config_path.read_text())
    config["base_model"] = tiny_model_dir  # the same seeded tiny model, built where this test runs
    config_path.write_text(json.dumps(config))
    restored = Engine(tmp_path / "old", device="cpu", snapshot_every_steps=1000)
    # The twin computes as the code that wrote the journal did: one F.linear per LoRA segment (today's default is the
    # grouped kernel, whose bits differ); the restore below runs with no such setting: its records name no kernel.
    monkeypatch.setenv("SIGNAL_LORA_KERNELS", "torch")
    twin = Engine(tmp_path / "twin", device="cpu", snapshot_every_steps=1000)
    twin.create_run(RUN, USER, tiny_model_dir, lora={"r": 4, "alpha": 8, "dropout": 0.1}, seed=7)
    answers = []
    for step, batch in enumerate(BATCHES):
        answers.append(twin.forward_backward(RUN, batch, request_id=f"fb-{step}",
                                             reduction="sum" if step == 1 else "mean"))
        if step < 3:
            answers.append(twin.optim_step(RUN, {"learning_rate": 1e-2}, request_id=f"opt-{step}"))
    monkeypatch.delenv("SIGNAL_LORA_KERNELS")

    info = restored.run_info(RUN)  # no snapshot: every record of the old journal replayed
    assert info["step"] == 3 and info["pending_forward_backward"] == 1
    assert_same_weights(lora_weights(restored, RUN), lora_weights(twin, RUN))
    ours, theirs = restored.runs[RUN], twin.runs[RUN]
    for (name, mine), other in zip(ours.named_parameters().items(), theirs.named_parameters().values()):
        assert mine.grad is not None and other.grad is not None and torch.equal(mine.grad, other.grad), name
    for mine, other in zip(ours.optimizer.state_dict()["state"].values(), theirs.optimizer.state_dict()["state"].values()):
        assert all(torch.equal(mine[key], other[key]) for key in mine)
    # Retries of the old journal's calls get their first answers (as the twin gave them, marked replayed).
    retried = restored.optim_step(RUN, {"learning_rate": 1e-2}, request_id="opt-2")
    assert retried["replayed"] is True and retried["grad_norm"] == answers[-2]["grad_norm"]
    first = restored.forward_backward(RUN, BATCHES[0], request_id="fb-0")
    assert first["replayed"] is True and first["loss"] == answers[0]["loss"]
