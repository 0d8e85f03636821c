"""A user's calls in flight are bounded in the runtime's scheduler (issue 19 §2): past the bound a flooding user's
calls wait, then are refused RESOURCE_EXHAUSTED (resource calls, retryAfterS; HTTP 429 with Retry-After on /v1),
while another user's call is answered. The SDK sends a refused call again after retryAfterS, and it is answered."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

SAMPLE = "mutation { sample(baseModel: \"tiny-llama\", prompts: [\"hi\"], maxTokens: 2) { sequences { text } } }"
CREATE = "mutation { createRun(input: {loraR: 2}) { id } }"


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = settings_for(tmp_path_factory.mktemp("signal-user-calls"), tiny_model_dir,
                            max_user_calls_in_flight=1, max_user_calls_waiting=1)
    live = LiveServer.start(settings)
    yield live
    live.stop()


def queued_calls(server: LiveServer) -> list[int]:
    """Each user's calls queued or waiting in the runtime (its state, asked through the server's own client)."""
    return list(server.backend.client.call("runtime_state", timeout=60)["queue_depth"].values())


def refusals(server: LiveServer) -> list[int]:
    return list(server.backend.client.call("runtime_state", timeout=60)["calls_refused"].values())


def test_a_flood_is_refused_while_another_users_call_is_answered(server: LiveServer) -> None:
    flooder, other = server.new_user(), server.new_user()
    run_id = server.graphql(CREATE, key=flooder)["data"]["createRun"]["id"]
    client = server.backend.client
    # The flooder's one place: a call on its run holding ticket 2, as another server process would send it, waiting
    # (up to the scheduler's ticket wait) for ticket 1, which the test sends when it is done.
    holder = client.submit("run_info", run_id=run_id, ticket=2)
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(server.graphql, SAMPLE, key=flooder)  # the flooder's one waiting call
        server.wait_for(lambda: queued_calls(server) == [2], "one call in flight and one waiting")

        refused = server.graphql(SAMPLE, key=flooder)
        (error,) = refused["errors"]
        assert refused.get("data") is None
        assert error["extensions"]["code"] == "RESOURCE_EXHAUSTED" and error["extensions"]["resource"] == "calls"
        assert error["extensions"]["retryable"] is True and error["extensions"]["retryAfterS"] >= 1

        openai_wire = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {flooder}"},
                                 json={"model": TINY_MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert openai_wire.status_code == 429, openai_wire.text
        assert int(openai_wire.headers["Retry-After"]) >= 1
        assert openai_wire.json()["error"]["code"] == "resource_exhausted"
        assert refusals(server) == [2]

        answered = server.graphql(SAMPLE, key=other)  # the flood holds no one else's call
        assert "errors" not in answered, answered
        assert len(answered["data"]["sample"]["sequences"][0]) == 1

        # The SDK's call is refused while the flooder's place and lane are full, and sent again after retryAfterS.
        sdk = SignalClient(api_key=flooder, base_url=server.url)
        retried = pool.submit(sdk.sample_base, "hi", base_model=TINY_MODEL, max_tokens=2)
        server.wait_for(lambda: refusals(server) == [3], "the SDK's first try to be refused")
        due = client.submit("run_info", run_id=run_id, ticket=1)  # goes past the bound: the holder waits for it
        assert due.result(timeout=60)["run_id"] == run_id and holder.result(timeout=60)["run_id"] == run_id
        body = waiting.result(timeout=120)  # taken in once the holder was answered
        assert "errors" not in body, body
        assert len(retried.result(timeout=120).sequences[0]) == 1
