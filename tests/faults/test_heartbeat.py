"""/healthz follows the runtime's heartbeat, which its reader thread answers (never the tick): a stopped runtime
(SIGSTOP) is `unresponsive` (503) and `ok` again after SIGCONT; stopped past restart_after_s, the runtime this server
started is killed, and the next call starts another that restores every run from its journal."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, settings_for

BATCH = [{"input": "two plus two is", "output": " four"}]


@pytest.fixture
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = settings_for(tmp_path_factory.mktemp("heartbeat"), tiny_model_dir, heartbeat_interval_s=0.2,
                            unresponsive_s=1.0, restart_after_s=4.0)
    live = LiveServer.start(settings)
    yield live
    live.stop()


def health(server: LiveServer) -> tuple[int, str]:
    response = httpx.get(f"{server.url}/healthz", timeout=5)
    return response.status_code, response.json()["status"]


def runtime_pid(server: LiveServer) -> int:
    pid = server.backend.client.pid
    assert pid is not None
    return int(pid)


def test_a_stopped_runtime_is_unresponsive_then_ok_again(server: LiveServer) -> None:
    server.wait_for(lambda: health(server) == (200, "ok"), "a first heartbeat")
    pid = runtime_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        server.wait_for(lambda: health(server) == (503, "unresponsive"), "/healthz to see the silence", timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    server.wait_for(lambda: health(server) == (200, "ok"), "/healthz to see it answer again", timeout=30)
    assert runtime_pid(server) == pid  # below restart_after_s: the same process, not killed


def test_a_runtime_stopped_past_the_restart_setting_is_replaced(server: LiveServer) -> None:
    client = SignalClient(api_key=server.new_user(), base_url=server.url)
    run = client.create_run(lora_r=2, seed=1)
    run.forward_backward(batch=BATCH)
    assert run.optim_step()["step"] == 1
    pid = runtime_pid(server)
    os.kill(pid, signal.SIGSTOP)
    # The server kills it (SIGKILL works on a stopped process); the pid no longer exists.
    server.wait_for(lambda: server.backend.client.pid != pid, "the hung runtime to be killed", timeout=60)
    run.forward_backward(batch=BATCH)  # starts another runtime, which restores the run from its journal
    assert run.optim_step()["step"] == 2
    assert runtime_pid(server) != pid
    server.wait_for(lambda: health(server) == (200, "ok"), "the new runtime's heartbeat", timeout=30)
