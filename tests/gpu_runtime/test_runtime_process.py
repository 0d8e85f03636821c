"""The worker process through RuntimeClient: typed errors, a clean protocol channel, crash and restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_runtime.client.runtime_client import RuntimeClient
from gpu_runtime.errors import BadInput, RunNotFound, WorkerFailed
from tests.helpers.engine_tools import BATCH


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeClient]:
    root = tmp_path_factory.mktemp("worker")
    worker = RuntimeClient(str(root / "data"), device="cpu", log_path=str(root / "worker.log"))
    worker.start()
    yield worker
    worker.close()


def test_worker_survives_bad_requests_and_answers_typed_errors(client: RuntimeClient, tiny_model_dir: str) -> None:
    pid = client.pid
    created = client.call("create_run", run_id="w1", user_id="u1", base_model=tiny_model_dir, lora={"r": 4})
    assert created["step"] == 0

    with pytest.raises(BadInput) as caught:
        client.call("forward_backward", run_id="w1", batch=[{"text": "ok"}, {"text": "x", "oops": 1}])
    assert caught.value.field == "batch[1].oops"
    with pytest.raises(BadInput) as caught:
        client.call("load_base_model_from_space")
    assert caught.value.field == "method"
    with pytest.raises(BadInput) as caught:
        client.call("optim_step", run_id="w1", adma={})
    assert caught.value.field == "params"
    with pytest.raises(RunNotFound):
        client.call("run_info", run_id="nobody")

    result = client.call("forward_backward", run_id="w1", batch=BATCH)
    assert result["num_examples"] == 4 and result["loss"] > 0
    assert client.call("optim_step", run_id="w1", adam={"learning_rate": 1e-2})["step"] == 1
    assert client.pid == pid and client.alive
    ping = client.call("ping")
    assert ping["pid"] == pid and ping["runs_in_memory"] == ["w1"] and ping["device"] == "cpu"


def test_killed_worker_is_worker_failed_and_restart_resumes_from_disk(client: RuntimeClient, tiny_model_dir: str) -> None:
    client.call("create_run", run_id="w2", user_id="u1", base_model=tiny_model_dir, lora={"r": 4})
    client.call("forward_backward", run_id="w2", batch=BATCH)
    client.call("optim_step", run_id="w2")
    old_pid = client.pid
    assert old_pid is not None

    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(WorkerFailed) as caught:
        client.call("forward_backward", run_id="w2", batch=BATCH)
    assert "exited with code -9 during forward_backward" in caught.value.message
    assert not client.alive and client.pid is None

    client.restart()
    assert client.alive and client.pid != old_pid
    assert client.call("ping")["runs_in_memory"] == []  # nothing loaded until asked
    assert client.call("run_info", run_id="w2")["step"] == 1
    client.call("forward_backward", run_id="w2", batch=BATCH)
    assert client.call("optim_step", run_id="w2")["step"] == 2


def test_a_cancelled_call_still_applies_and_other_answers_keep_coming(client: RuntimeClient, tiny_model_dir: str) -> None:
    client.call("create_run", run_id="cancelled", user_id="u1", base_model=tiny_model_dir, lora={"r": 4})
    future = client.submit("forward_backward", run_id="cancelled", batch=BATCH)
    assert future.cancel()  # the caller went away; the runtime still has the call
    # Per-run order: run_info is answered after the forward_backward, which was applied, its answer dropped.
    assert client.call("run_info", run_id="cancelled", timeout=120)["pending_forward_backward"] == 1


def test_close_stops_the_worker_and_start_is_idempotent(tmp_path: Path) -> None:
    worker = RuntimeClient(str(tmp_path), device="cpu", log_path=str(tmp_path / "w.log"))
    worker.start()
    pid = worker.pid
    worker.start()
    assert worker.pid == pid
    worker.close()
    assert not worker.alive and worker.pid is None


def test_a_bad_device_fails_start_with_a_typed_error(tmp_path: Path) -> None:
    worker = RuntimeClient(str(tmp_path), device="tpu", log_path=str(tmp_path / "w.log"))
    with pytest.raises(BadInput) as caught:
        worker.start()
    assert caught.value.field == "device"
    assert not worker.alive


NOISY_WORKER = """
import os, sys
from gpu_runtime import runtime_process
from gpu_runtime.engine import control_calls

original_ping = control_calls.Control.ping

def noisy_ping(self):
    print("library chatter")  # what a library's print does
    os.write(1, b"raw chatter\\n")  # and a C extension writing to fd 1
    return original_ping(self)

control_calls.Control.ping = noisy_ping
sys.exit(runtime_process.main(["--data-dir", sys.argv[1], "--device", "cpu"]))
"""


def test_library_output_never_reaches_the_protocol_channel(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", NOISY_WORKER, str(tmp_path)],
        input=b'{"id": 1, "method": "ping", "params": {}}\n',
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(b'{"ready":true')
    assert lines[1].startswith(b'{"id":1,"result":{')
    assert b"library chatter" in done.stderr and b"raw chatter" in done.stderr


def test_a_spawned_runtime_no_server_connects_to_exits_by_itself(tmp_path: Path) -> None:
    # The server that spawned it died between its "ready" and connecting: nothing else would ever stop it.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    runtime = subprocess.Popen(
        [sys.executable, "-m", "gpu_runtime.runtime_process", "--data-dir", str(tmp_path), "--device", "cpu", "--socket",
         "--spawned", "--first-client-seconds", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    assert runtime.stdout is not None
    assert runtime.stdout.readline().startswith(b'{"ready":true')
    assert (tmp_path / "runtime.sock").exists()
    _, stderr = runtime.communicate(timeout=120)
    assert runtime.returncode == 0, stderr.decode()
    assert b"no server connected" in stderr
    assert not (tmp_path / "runtime.sock").exists()
