"""A data directory written by the runtime before the typed contract (commit c65e095: its journal, a format-2
snapshot, config.json) restores and replays under this code: tests/fixtures/make_legacy_datadir.py wrote it, with
the state the run held in memory when it stopped. The replay recomputes passes on this machine's CPU, whose
kernels (AVX-512 or not) may add in another order than the one that wrote the fixture: the state is compared
within FP32_REL of each tensor's scale (tests/helpers/engine_tools.py), bitwise where it is only read back (the step, the journal's answers)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import assert_relatively_close

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_datadir"


@pytest.fixture
def one_thread() -> Iterator[None]:
    # The fixture was written on one thread: CPU matmuls split across threads add in another order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_legacy_data_directory_restores_bitwise_and_trains_on(tmp_path: Path, tiny_model_dir: str, one_thread: None) -> None:
    shutil.copytree(FIXTURE / "runs", tmp_path / "runs")
    config_path = tmp_path / "runs" / "legacy-user" / "legacy-run" / "config.json"
    config = json.loads(config_path.read_text())
    config["base_model"] = tiny_model_dir  # the same seeded tiny model, built where this test runs
    config_path.write_text(json.dumps(config))
    expected = load_file(str(FIXTURE / "expected_state.safetensors"))

    engine = Engine(tmp_path, device="cpu", snapshot_every_steps=2)
    info = engine.run_info("legacy-run")  # snapshot at step 2, then fb-2, opt-2 and the pending fb-3 replayed
    assert info["step"] == int((FIXTURE / "step").read_text()) == 3
    assert info["pending_forward_backward"] == 1
    state = engine.runs["legacy-run"]
    named = state.named_parameters()
    names = list(named)
    for name, param in named.items():
        assert_relatively_close(param.detach(), expected[f"weight/{name}"], name=name)
        assert param.grad is not None
        assert_relatively_close(param.grad, expected[f"grad/{name}"], name=f"grad of {name}")
    moments = state.optimizer.state_dict()["state"]
    assert len(moments) == len(names)
    for i, values in moments.items():
        for key, value in values.items():
            assert_relatively_close(value.reshape(expected[f"adam/{names[i]}/{key}"].shape), expected[f"adam/{names[i]}/{key}"],
                                    name=f"{key} of {names[i]}")
    # Retries of the journaled calls get their first answers; the run trains on.
    assert engine.optim_step("legacy-run", {"learning_rate": 1e-2}, request_id="opt-2")["replayed"] is True
    assert engine.optim_step("legacy-run", {"learning_rate": 1e-2}, request_id="opt-3")["step"] == 4
