"""Saves cut short by kill -9 (issue 34 #7, #8): a checkpoint or a named sampler snapshot is whole or absent, never
half there, and what an interrupted save left is swept when its run comes back, with a log line that counts it.

The failpoint during_save kills the runtime once a save's files are written, before they are renamed in place;
during_swap once an existing checkpoint or snapshot of that name is moved aside, before its replacement is renamed
in. One client throughout, as a server holds one: each crash answers WORKER_FAILED, and the next call starts a clean
runtime on the same data directory."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.client.persistence import TEMPORARY, read_json
from gpu_runtime.client.runtime_client import RuntimeClient
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.errors import WorkerFailed
from tests.helpers.engine_tools import BATCH

USER = "u1"
PROMPT: dict[str, Any] = {"prompts": ["The quick brown"], "max_tokens": 2, "temperature": 0.0}


@dataclass
class Runtime:
    data: Path
    log: Path
    client: RuntimeClient
    model: str

    def crash(self, failpoint: str, method: str, **params: Any) -> str:
        """Call `method` in a runtime armed with `failpoint`; it dies there. The WORKER_FAILED message."""
        self.client.env = {"SIGNAL_RUNTIME_FAULTS": failpoint}
        self.client.restart()  # armed: a runtime of its own
        try:
            with pytest.raises(WorkerFailed) as failed:
                self.client.call(method, **params)
        finally:
            self.client.env = {}  # the next call starts a runtime without failpoints
        return failed.value.message

    def run_dir(self, run_id: str) -> Path:
        return self.data / "runs" / USER / run_id

    def temporaries(self, run_id: str) -> list[Path]:
        return [p for p in self.run_dir(run_id).rglob("*") if TEMPORARY.match(p.name)]

    def trained_run(self, run_id: str) -> None:
        self.client.call("create_run", run_id=run_id, user_id=USER, base_model=self.model, lora={"r": 4}, seed=1)


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    root = tmp_path_factory.mktemp("interrupted-saves")
    log = root / "runtime.log"
    client = RuntimeClient(str(root / "data"), device="cpu", options=RuntimeOptions(), log_path=str(log))
    try:
        yield Runtime(root / "data", log, client, tiny_model_dir)
    finally:
        client.close()


def step(runtime: Runtime, run_id: str) -> int:
    runtime.client.call("forward_backward", run_id=run_id, batch=BATCH)
    return int(runtime.client.call("optim_step", run_id=run_id)["step"])


@pytest.mark.parametrize("mode", ["merged", "state"])
def test_a_save_killed_half_way_leaves_nothing_once_its_run_comes_back(runtime: Runtime, mode: str) -> None:
    run_id = f"leak-{mode}"
    runtime.trained_run(run_id)
    save: dict[str, Any] = {"run_id": run_id, "mode": mode, "name": "m1", "request_id": f"save-{mode}"}
    assert "exited with code -9" in runtime.crash("during_save", "save_state", **save)
    leaked = runtime.temporaries(run_id)
    assert [p.name.startswith(".m1.tmp-") for p in leaked] == [True]  # what the kill left: the half-written save
    assert not (runtime.run_dir(run_id) / "checkpoints" / mode / "m1").exists()  # never listed

    before = runtime.log.read_text()
    saved = runtime.client.call("save_state", **save)  # the retry, in a fresh runtime
    assert saved["name"] == "m1" and Path(saved["checkpoint_path"]).is_dir()
    assert runtime.temporaries(run_id) == []
    swept = runtime.log.read_text()[len(before):]
    assert f"run {run_id}: swept 1 temporaries of interrupted saves" in swept


def test_a_named_snapshot_is_whole_or_the_old_one_after_a_crash(runtime: Runtime) -> None:
    for failpoint in ("during_save", "during_swap"):
        run_id = f"snap-{failpoint.replace('_', '-')}"
        runtime.trained_run(run_id)
        runtime.client.call("save_weights_for_sampler", run_id=run_id, name="s")  # at step 0
        assert step(runtime, run_id) == 1
        runtime.crash(failpoint, "save_weights_for_sampler", run_id=run_id, name="s")

        # Listed before the crash, so it must still load and sample: the step-0 one, whole.
        runtime.client.call("run_info", run_id=run_id)  # the run comes back: its debris is swept
        assert runtime.temporaries(run_id) == []
        directory = runtime.run_dir(run_id) / "checkpoints" / "sampler" / "s"
        assert read_json(directory / "sampler.json")["step"] == 0
        sampled = runtime.client.call("sample", run_id=run_id, snapshot="s", **PROMPT)
        assert len(sampled["sequences"][0][0]["tokens"]) == 2 and sampled["step"] == 0
        again = runtime.client.call("save_weights_for_sampler", run_id=run_id, name="s")
        assert again["step"] == 1


def test_a_checkpoint_overwritten_when_the_runtime_dies_keeps_the_old_one(runtime: Runtime) -> None:
    run_id = "overwrite-swap"
    runtime.trained_run(run_id)
    first = runtime.client.call("save_state", run_id=run_id, mode="state", name="c")
    assert first["step"] == 0 and step(runtime, run_id) == 1
    runtime.crash("during_swap", "save_state", run_id=run_id, mode="state", name="c", overwrite=True)

    loaded = runtime.client.call("load_state", run_id=run_id, checkpoint="c")  # the old one, back in place
    assert loaded["step"] == 0 and runtime.temporaries(run_id) == []
    sampled = runtime.client.call("sample", run_id=run_id, checkpoint="c", **PROMPT)
    assert len(sampled["sequences"][0][0]["tokens"]) == 2 and sampled["step"] == 0
    assert step(runtime, run_id) == 1
    replaced = runtime.client.call("save_state", run_id=run_id, mode="state", name="c", overwrite=True)
    assert replaced["step"] == 1
