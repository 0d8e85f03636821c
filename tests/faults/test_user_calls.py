"""A user's calls in flight are bounded in the runtime's scheduler (issue 19 §2): past the bound a flooding user's
calls wait, then are refused RESOURCE_EXHAUSTED (resource calls, retryAfterS; HTTP 429 with Retry-After on /v1 and
on dashboard pages), while another user's call is answered. The SDK sends a refused call again after retryAfterS,
and it is answered. On Tinker's wire the server sends a refused future's work again itself, and the future's polls
answer 429 with Retry-After meanwhile, which the `tinker` SDK backs off from and polls again."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for
from tests.web.conftest import sign_in

SAMPLE = "mutation { sample(baseModel: \"tiny-llama\", prompts: [\"hi\"], maxTokens: 2) { sequences { text } } }"
CREATE = "mutation { createRun(input: {loraR: 2}) { id } }"


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = settings_for(tmp_path_factory.mktemp("signal-user-calls"), tiny_model_dir,
                            max_user_calls_in_flight=1, max_user_calls_waiting=1, tinker_poll_s=1.0)
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


@contextmanager
def flooded(server: LiveServer, flooder: str) -> Iterator[Callable[[], None]]:
    """The flooder's place taken (a ticketed call waiting for its ticket 1) and its one waiting call queued; yields
    `release`, which sends ticket 1 and sees both calls answered."""
    run_id = server.graphql(CREATE, key=flooder)["data"]["createRun"]["id"]
    client = server.backend.client
    holder = client.submit("run_info", run_id=run_id, ticket=2)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(server.graphql, SAMPLE, key=flooder)
        server.wait_for(lambda: queued_calls(server) == [2], "one call in flight and one waiting")

        def release() -> None:
            assert client.submit("run_info", run_id=run_id, ticket=1).result(timeout=60)["run_id"] == run_id
            assert holder.result(timeout=60)["run_id"] == run_id
            assert "errors" not in waiting.result(timeout=120)

        yield release


def test_a_refusal_is_429_on_pages_and_resent_behind_429_polls_on_tinkers_wire(server: LiveServer,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")  # the SDK's telemetry loop, which outlives the test's server
    import tinker
    from tinker import types

    email = f"flood-{uuid.uuid4().hex[:8]}@example.com"
    flooder = server.new_user(email)
    page_run = server.graphql(CREATE, key=flooder)["data"]["createRun"]["id"]  # no call held on it
    visitor = sign_in(server, email)
    wire = {"X-API-Key": "tml-" + flooder}

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/api/v1/{path}", headers=wire, json=body, timeout=60)

    session = post("create_session", {"tags": []}).json()["session_id"]
    sampling = post("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                "base_model": TINY_MODEL}).json()["sampling_session_id"]
    sampler = tinker.ServiceClient(base_url=server.url, api_key="tml-" + flooder).create_sampling_client(
        base_model=TINY_MODEL).result()
    prompt, params = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=2, temperature=1.0)
    with flooded(server, flooder) as release:
        before = sum(refusals(server))
        form = {"run_id": page_run, "prompt": "hi", "temperature": "0.7", "max_tokens": "2", "num_samples": "1"}
        page = visitor.post("/playground", data=form)
        assert page.status_code == 429, page.text
        assert int(page.headers["Retry-After"]) >= 1 and "too many calls in flight" in page.text
        assert sum(refusals(server)) == before + 1

        request_id = post("asample", {"sampling_session_id": sampling, "seq_id": 0, "num_samples": 1,
                                      "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                                      "sampling_params": {"max_tokens": 2}}).json()["request_id"]
        server.wait_for(lambda: sum(refusals(server)) >= before + 2, "the future's work to be refused")
        polls: list[httpx.Response] = []

        def poll_is_429() -> bool:
            polls.append(post("retrieve_future", {"request_id": request_id}))
            return polls[-1].status_code == 429

        # Until the server has heard the refusal (a poll before that waits out its 1 s, and answers try_again).
        server.wait_for(poll_is_429, "a poll answered 429", timeout=30)
        assert int(polls[-1].headers["Retry-After"]) >= 1
        assert polls[-1].json()["category"] == "server" and "error" not in polls[-1].json()
        with ThreadPoolExecutor(1) as pool:
            sdk = pool.submit(lambda: sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result())
            server.wait_for(lambda: sum(refusals(server)) >= before + 4, "both futures refused again")
            release()
            assert len(sdk.result(timeout=120).sequences[0].tokens) == 2  # polled through its 429s, then answered
    answered = post("retrieve_future", {"request_id": request_id})
    while answered.headers["content-type"].startswith("application/json"):  # try_again while it is being sent
        assert answered.status_code in (200, 429) and "error" not in answered.json(), answered.text
        answered = post("retrieve_future", {"request_id": request_id})
    assert answered.status_code == 200 and answered.headers["content-type"] == "application/x-protobuf"
