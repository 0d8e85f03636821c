"""A journal write that fails on a full disk (the failpoint enospc_journal raises ENOSPC at the fsync of any call
whose request id starts with "enospc") answers RESOURCE_EXHAUSTED, resource disk, and the runtime stays up. The
failed call is never applied, not in memory (the run is dropped and restored) and not after a restart; calls
acknowledged around it survive a restore. Below the free-space margin, writing calls are refused at submit."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from sqlalchemy import event
from sqlalchemy.engine import Engine as SyncEngine

from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import ResourceExhausted
from tests.conftest import ON_POSTGRES
from tests.helpers.engine_tools import assert_same_weights, lora_weights
from tests.helpers.live_server import TINY_MODEL, LiveServer

BATCH = [{"text": "The quick brown fox jumps over the lazy dog."}]
OTHER = [{"input": "Q: What is 2 + 2?\nA:", "output": " 4"}]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bitwise comparisons across engines
    yield
    torch.set_num_threads(threads)  # later tests compare in-process results with workers' (default threads)


def reference(tmp_path: Path, model: str) -> dict[str, torch.Tensor]:
    """The same run without the failed calls."""
    engine = Engine(tmp_path / "reference", device="cpu")
    engine.create_run("r", "u", model, lora={"r": 4}, seed=3)
    engine.forward_backward("r", BATCH)
    engine.optim_step("r")
    engine.forward_backward("r", OTHER)
    engine.optim_step("r")
    return lora_weights(engine, "r")


@pytest.mark.parametrize("failing", ["forward_backward", "optim_step"])
def test_a_call_whose_journal_write_fails_is_never_applied(tmp_path: Path, tiny_model_dir: str, failing: str,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    engine = Engine(tmp_path / "data", device="cpu", faults={"enospc_journal"})
    engine.create_run("r", "u", tiny_model_dir, lora={"r": 4}, seed=3)
    engine.forward_backward("r", BATCH, request_id="a1")
    assert engine.optim_step("r", request_id="a2")["step"] == 1
    engine.forward_backward("r", OTHER, request_id="a3")
    with pytest.raises(ResourceExhausted) as refused:
        if failing == "forward_backward":
            engine.forward_backward("r", BATCH, request_id="enospc-1")
        else:
            engine.optim_step("r", request_id="enospc-1")
    assert refused.value.details == {"resource": "disk"} and "disk is full" in refused.value.message
    assert str(tmp_path) not in refused.value.message  # the path goes to the log only
    assert "disk full under" in capfd.readouterr().err
    assert "r" not in engine.runs  # dropped unsaved: memory held the failed call

    # The runtime goes on; a3's gradients (acknowledged) survived the drop, the failed call's did not.
    assert engine.optim_step("r", request_id="a4")["step"] == 2
    assert_same_weights(lora_weights(engine, "r"), reference(tmp_path, tiny_model_dir))
    engine.shutdown()

    restarted = Engine(tmp_path / "data", device="cpu")  # and after a restart, from snapshot + journal
    assert_same_weights(lora_weights(restarted, "r"), reference(tmp_path / "again", tiny_model_dir))


def test_writing_calls_are_refused_below_the_free_space_margin(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu")
    engine.create_run("r", "u", tiny_model_dir, lora={"r": 4})
    tight = Engine(tmp_path / "data", device="cpu", min_free_disk_bytes=2**62)  # more than any disk has free
    with pytest.raises(ResourceExhausted) as refused:
        tight.forward_backward("r", BATCH)
    assert refused.value.details == {"resource": "disk"}
    assert tight.sample("r", ["Hello"], max_tokens=2)["sequences"]  # sampling goes on


def test_a_snapshot_that_fails_on_a_full_disk(tmp_path: Path, tiny_model_dir: str,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    """The failpoint enospc_snapshot fails every snapshot half-way while it is set. A periodic snapshot's failure is
    not its optim_step's (applied and journaled already): that call is answered, and restore replays it. A save_state,
    whose snapshot is its own work, is told RESOURCE_EXHAUSTED and never made. Space back, calls acknowledged then
    survive a restart too."""
    faults = {"enospc_snapshot"}
    engine = Engine(tmp_path / "data", device="cpu", faults=faults, snapshot_every_steps=1)
    engine.create_run("r", "u", tiny_model_dir, lora={"r": 4}, seed=3)
    engine.forward_backward("r", BATCH, request_id="a1")
    assert engine.optim_step("r", request_id="a2")["step"] == 1  # its snapshot was due, and failed
    assert "snapshot skipped, the disk is full" in capfd.readouterr().err
    with pytest.raises(ResourceExhausted) as refused:
        engine.save_state("r", mode="state")
    assert refused.value.details == {"resource": "disk"}

    faults.discard("enospc_snapshot")  # space is back
    engine.forward_backward("r", OTHER, request_id="a3")
    assert engine.optim_step("r", request_id="a4")["step"] == 2
    assert_same_weights(lora_weights(engine, "r"), reference(tmp_path, tiny_model_dir))
    run_dir = tmp_path / "data" / "runs" / "u" / "r"
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())  # never made
    assert not list(run_dir.rglob(".*.tmp-*"))  # the half-written snapshot left nothing behind
    assert sorted(p.name for p in (run_dir / "lora_adapters").glob("step_*")) == ["step_2"]  # written once space was back
    engine.shutdown()

    restarted = Engine(tmp_path / "data", device="cpu")
    assert_same_weights(lora_weights(restarted, "r"), reference(tmp_path / "again", tiny_model_dir))


# ---- The server's database on a full disk (issue 34, #6): every wire answers in its own shape, never a plain 500.
# The failpoint: SQLite's own "database or disk is full" raised at every write of this process's engines (the live
# server runs in this process), as SQLite raises it when its file cannot grow; reads go on, as they do on a full disk.


@contextmanager
def database_disk_full() -> Iterator[None]:
    def full(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE")):
            raise sqlite3.OperationalError("database or disk is full")

    event.listen(SyncEngine, "before_cursor_execute", full)
    try:
        yield
    finally:
        event.remove(SyncEngine, "before_cursor_execute", full)


sqlite_only = pytest.mark.skipif(ON_POSTGRES, reason="raises SQLite's own disk-full error")


@sqlite_only
@pytest.mark.parametrize("store", [True, False])
def test_v1_on_a_full_database_disk_is_openais_507(live_server: LiveServer, store: bool) -> None:
    key = live_server.new_user()
    body = {"model": TINY_MODEL, "prompt": "Hello", "max_tokens": 1, "store": store}
    with database_disk_full():
        answer = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=120,
                            headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 507, answer.text
    error = answer.json()["error"]
    assert error["code"] == "resource_exhausted" and "disk is full" in error["message"]
    again = httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {key}"})
    assert again.status_code == 200, again.text  # space back: served again


@sqlite_only
@pytest.mark.parametrize("path", ["create_session", "session_heartbeat"])
def test_tinker_on_a_full_database_disk_is_its_json_error(live_server: LiveServer, path: str) -> None:
    headers = {"X-API-Key": "tml-" + live_server.new_user()}
    with httpx.Client(base_url=f"{live_server.url}/api/v1", headers=headers, timeout=60) as client:
        session = client.post("create_session", json={"tags": []}).json()["session_id"]
        with database_disk_full():
            answer = client.post(path, json={"tags": [], "session_id": session})
        assert answer.status_code == 503, answer.text
        assert answer.json()["category"] == "server" and "disk is full" in answer.json()["detail"]
        assert client.post("session_heartbeat", json={"session_id": session}).status_code == 200


@sqlite_only
def test_the_dashboard_on_a_full_database_disk_shows_its_error(live_server: LiveServer) -> None:
    from tests.web.conftest import sign_in

    visitor = sign_in(live_server)
    with database_disk_full():
        answer = visitor.post("/keys", data={"name": "full"})
    assert answer.status_code == 507 and "disk is full" in answer.text  # the toast's text
    assert visitor.post("/keys", data={"name": "after"}).status_code == 200
