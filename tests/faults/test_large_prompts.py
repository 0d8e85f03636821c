"""Eight 6 MB text prompts at once on /v1 (issue 34, finding 2): the server once deadlocked for good, a thread holding
the runtime connection's lock while blocked writing one line, the answer reader and the heartbeat waiting for that
lock, and the runtime's reader blocked writing a reply nobody read. Now lines go out on writer threads and no lock
is held across I/O: /healthz answers within a second throughout, every prompt gets its answer, the runtime lives."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, settings_for

PROMPTS = 8
PROMPT = "hello " * 1_000_000  # 6 MB of text
HEALTH_BOUND_S = 1.0

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # Bodies up to 8 MiB: the prompts must reach the runtime's connection, not stop at the server's body bound.
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("large-prompts"), tiny_model_dir,
                                           max_request_bytes=8 * 1024 * 1024))
    yield server
    server.stop()


def test_eight_six_megabyte_prompts_at_once_never_stall_healthz(live_server: LiveServer) -> None:
    key = live_server.new_user()
    run_id = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4).id
    pid = live_server.worker_pid

    # Encoded once here: eight client threads each encoding 6 MB would hold the GIL this process shares with the
    # server (LiveServer runs uvicorn in a thread) and the /healthz poll, timing the client instead of the server.
    body = json.dumps({"model": run_id, "prompt": PROMPT, "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def complete(_: int) -> int:
        response = httpx.post(f"{live_server.url}/v1/completions", headers=headers, content=body, timeout=300)
        return response.status_code

    slowest = 0.0
    with ThreadPoolExecutor(PROMPTS) as pool:
        answers = [pool.submit(complete, i) for i in range(PROMPTS)]
        while not all(answer.done() for answer in answers):  # bounded: each completion has its own 300 s timeout
            started = time.monotonic()
            health = httpx.get(f"{live_server.url}/healthz", timeout=HEALTH_BOUND_S * 5)
            slowest = max(slowest, time.monotonic() - started)
            assert health.status_code == 200, health.text
        codes = [answer.result() for answer in answers]
    assert slowest < HEALTH_BOUND_S, f"/healthz took {slowest:.2f} s while the prompts were in flight"
    # Each prompt is answered in OpenAI's shape: too long for the context is the caller's error, never a 5xx.
    assert all(code < 500 for code in codes), codes
    assert live_server.worker_pid == pid  # the runtime was never restarted by its watchdog
