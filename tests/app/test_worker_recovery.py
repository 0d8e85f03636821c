"""A worker killed mid-training: the call in flight fails with WORKER_FAILED (and the SDK sends it again),
the next call starts a new worker, and the run continues from what it persisted."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, error_code, settings_for

BATCH = [{"text": "a sentence that the run keeps training on"}]
LONG_SAMPLE = {"prompts": ["hello"] * 16, "max_tokens": 250, "num_samples": 8}
# Long enough to still be decoding when the kill lands (ms after it reaches the backend); short to run again.
RETRIED_SAMPLE = {"prompts": ["hello"] * 4, "max_tokens": 120, "num_samples": 2}
SAMPLE = """mutation($id: ID!, $prompts: [String!]!, $n: Int!, $max: Int!) {
  sample(runId: $id, prompts: $prompts, numSamples: $n, maxTokens: $max) { outputs } }"""


def trained_run(client: SignalClient, steps: int = 2):  # type: ignore[no-untyped-def]
    run = client.create_run(lora_r=4)
    for _ in range(steps):
        run.forward_backward(batch=BATCH)
        run.optim_step()
    return run


def kill_worker_when_busy(live_server: LiveServer) -> int:
    """Kill -9 the worker once a call is in the backend; returns the killed pid."""
    live_server.wait_for(lambda: live_server.backend.in_flight > 0 and live_server.worker_pid is not None,
                         "a call to reach the worker")
    pid = live_server.worker_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return pid


def test_sdk_call_in_flight_when_the_worker_dies_is_retried(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = trained_run(client)
    answer: dict[str, object] = {}
    thread = threading.Thread(target=lambda: answer.setdefault("sample", run.sample(**RETRIED_SAMPLE)))
    thread.start()
    old_pid = kill_worker_when_busy(live_server)
    thread.join(timeout=300)

    # The SDK sent the same call again (same request id) to the new worker, which restored the run.
    assert len(answer["sample"].outputs) == 4  # type: ignore[attr-defined]
    assert live_server.worker_pid not in (None, old_pid)
    assert client.get_run(run.id).step == 2
    assert run.forward_backward(batch=BATCH).step == 2


def test_raw_call_in_flight_when_the_worker_dies_answers_worker_failed(live_server: LiveServer, key: str) -> None:
    client = SignalClient(api_key=key, base_url=live_server.url)
    run = trained_run(client)
    answer: dict[str, dict] = {}
    variables = {"id": run.id, "prompts": LONG_SAMPLE["prompts"], "n": 8, "max": 250}
    thread = threading.Thread(target=lambda: answer.setdefault("body", live_server.graphql(SAMPLE, variables, key)))
    thread.start()
    kill_worker_when_busy(live_server)
    thread.join(timeout=300)

    assert error_code(answer["body"]) == "WORKER_FAILED"
    assert run.forward_backward(batch=BATCH).step == 2  # the next call reaches a new worker


def test_worker_killed_between_calls_is_replaced_by_the_next_call(live_server: LiveServer, key: str) -> None:
    # One attempt only: the server itself must answer the next call, not the SDK's retry.
    client = SignalClient(api_key=key, base_url=live_server.url, max_attempts=1)
    run = trained_run(client)
    expected = run.forward_backward(batch=BATCH).loss  # the loss the weights of step 2 give

    old_pid = live_server.worker_pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    live_server.wait_for(lambda: not live_server.backend.client.alive, "the worker to be gone")

    again = run.forward_backward(batch=BATCH)
    assert again.step == 2 and abs(again.loss - expected) < 1e-6
    assert run.optim_step().step == 3
    assert live_server.worker_pid not in (None, old_pid)


def test_restarted_server_resumes_runs_from_disk(tiny_model_dir: str, tmp_path: Path) -> None:
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


def test_healthz_answers_while_the_runtime_starts_and_calls_wait(tiny_model_dir: str, tmp_path: Path) -> None:
    # The worker's log is a FIFO: opening it blocks the runtime's start until this test reads it, so
    # "still warming" is a state the test holds, not a race it hopes to win.
    gate = tmp_path / "worker-log"
    os.mkfifo(gate)
    server = LiveServer.start(settings_for(tmp_path / "data", tiny_model_dir, worker_log=gate), wait_for_runtime=False)
    try:
        health = httpx.get(f"{server.url}/healthz", timeout=30.0)
        assert health.status_code == 200 and health.json()["status"] == "warming"

        key = server.new_user()
        created: dict[str, object] = {}
        call = threading.Thread(target=lambda: created.setdefault("run", SignalClient(
            api_key=key, base_url=server.url, max_attempts=1).create_run(lora_r=4)))
        call.start()
        server.wait_for(lambda: server.backend.in_flight == 1, "createRun to wait for the runtime")
        assert httpx.get(f"{server.url}/healthz", timeout=30.0).json()["status"] == "warming"

        drain = threading.Thread(target=lambda: gate.read_bytes(), daemon=True)  # opens the gate; reads to EOF
        drain.start()
        call.join(timeout=300)
        assert created["run"].step == 0  # type: ignore[attr-defined]
        assert httpx.get(f"{server.url}/healthz", timeout=30.0).json()["status"] == "ok"
    finally:
        if not server.backend.ready:
            threading.Thread(target=lambda: gate.read_bytes(), daemon=True).start()  # let shutdown finish
        server.stop()
