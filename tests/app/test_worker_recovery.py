"""A worker killed mid-training: the call fails with WORKER_FAILED, a new worker takes over,
and the run continues from its last persisted step."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rewardsignal import SignalClient, WorkerFailedError
from tests.helpers.live_server import LiveServer

BATCH = [{"text": "a sentence that the run keeps training on"}]


def test_killed_worker_is_reported_and_replaced(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    for _ in range(2):
        run.forward_backward(batch=BATCH)
        run.optim_step()
    run.forward_backward(batch=BATCH)  # accumulated but never applied: lost with the worker

    old_pid = live_server.worker_pid
    failure: dict[str, BaseException] = {}

    def long_call() -> None:
        try:
            run.sample(prompts=["hello"] * 16, max_tokens=250, num_samples=8)
        except BaseException as error:  # noqa: BLE001 - the assertion below inspects it
            failure["error"] = error

    thread = threading.Thread(target=long_call)
    thread.start()
    time.sleep(1.0)  # the sample is now inside the worker
    os.kill(old_pid, signal.SIGKILL)
    thread.join(timeout=120)

    assert isinstance(failure.get("error"), WorkerFailedError)
    assert failure["error"].code == "WORKER_FAILED"
    assert client.get_run(run.id).step == 2
    # The next call reaches a fresh worker, which restores the run from disk and continues at step 2.
    result = run.forward_backward(batch=BATCH)
    assert result.step == 2
    assert run.optim_step().step == 3
    assert live_server.worker_pid not in (None, old_pid)


def test_killed_idle_worker_fails_one_call_only(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    os.kill(live_server.worker_pid, signal.SIGKILL)
    time.sleep(0.5)
    with pytest.raises(WorkerFailedError):
        run.forward_backward(batch=BATCH)
    assert run.forward_backward(batch=BATCH).step == 0
    assert run.optim_step().step == 1


def test_restarted_server_resumes_runs_from_disk(tiny_model_dir: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers.live_server import settings_for

    settings = settings_for(tmp_path / "data", tiny_model_dir)
    first = LiveServer.start(settings)
    try:
        key = first.new_user()
        run = SignalClient(api_key=key, base_url=first.url).create_run(lora_r=4, seed=2)
        for _ in range(2):
            run.forward_backward(batch=BATCH)
            run.optim_step(learning_rate=0.01)
        expected = run.forward_backward(batch=BATCH).loss  # the loss the weights of step 2 give
    finally:
        first.stop()

    second = LiveServer.start(settings.model_copy(update={"port": settings.port}))
    try:
        client = SignalClient(api_key=key, base_url=second.url)
        resumed = client.get_run(run.id)
        assert resumed.step == 2
        again = resumed.forward_backward(batch=BATCH)
        assert again.step == 2 and abs(again.loss - expected) < 1e-6
        assert resumed.optim_step().step == 3
    finally:
        second.stop()
