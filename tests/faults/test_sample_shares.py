"""One bound on a user's sample calls in flight from every wire (issue 34 #10), and a revoked key reaching what it
opened (issue 34 #18), on a live server whose bound is 1 sample per user (SIGNAL_MAX_USER_SAMPLES_IN_FLIGHT) and
whose keys are re-checked every 0.5 s (SIGNAL_SESSION_RECHECK_S). The failpoint hold_streams keeps every streamed
sample decoding (after its first chunk) until it is cancelled: an open /v1 stream holds its user's one place."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.faults.test_client_gone import user_of
from tests.helpers.live_server import TINY_MODEL, LiveServer, settings_for

RECHECK_S = 0.5
SAMPLE = "mutation { sample(baseModel: \"tiny-llama\", prompts: [\"hi\"], maxTokens: 2) { sequences { text } } }"
CREATE = "mutation { createRun(input: {loraR: 2}) { id } }"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIGNAL_RUNTIME_FAULTS", "hold_streams")
        patch.setenv("TINKER_TELEMETRY", "0")  # the SDK's telemetry loop, which outlives the test's server
        live = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-shares"), tiny_model_dir,
                                             max_user_samples_in_flight=1, max_user_calls_in_flight=1,
                                             session_recheck_s=RECHECK_S, tinker_poll_s=1.0,
                                             decode_chunk_seconds=0.001))
        yield live
        live.stop()


def shares(server: LiveServer) -> Any:
    return server.app.state.services.runs.shares


def runtime_state(server: LiveServer) -> dict[str, Any]:
    return server.backend.client.call("runtime_state", timeout=60)


def tinker_post(server: LiveServer, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/{path}", headers={"X-API-Key": "tml-" + key}, json=body, timeout=60)


def base_sampler(server: LiveServer, key: str) -> str:
    session = tinker_post(server, key, "create_session", {"tags": []}).json()["session_id"]
    return str(tinker_post(server, key, "create_sampling_session", {
        "session_id": session, "sampling_session_seq_id": 0, "base_model": TINY_MODEL}).json()["sampling_session_id"])


@contextmanager
def open_stream(server: LiveServer, key: str) -> Iterator[Iterator[str]]:
    """A /v1 stream past its first chunk, held decoding (hold_streams); yields its remaining `data:` lines. Leaving
    the block closes it (its client gone: the sample is cancelled, its place given back)."""
    body = {"model": TINY_MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, response.read()
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        assert "choices" in json.loads(next(lines).removeprefix("data: "))  # its first chunk: it holds its place
        yield lines


def test_past_the_bound_every_wire_answers_its_retryable_error_while_another_user_is_served(
        server: LiveServer) -> None:
    import tinker
    from tinker import types

    flooder, other = server.new_user(), server.new_user()
    flooder_id = user_of(server, flooder)
    sampler = base_sampler(server, flooder)
    tinker_client = tinker.ServiceClient(base_url=server.url, api_key="tml-" + flooder).create_sampling_client(
        base_model=TINY_MODEL).result()
    # The pool is left after the stream closes (its shutdown waits for the SDK's sample, which needs the place).
    with ThreadPoolExecutor(1) as pool, open_stream(server, flooder):
        assert shares(server).in_flight == {flooder_id: 1}
        refused = shares(server).refused.get(flooder_id, 0)

        # /v1: 429 in OpenAI's shape with Retry-After, which the openai package raises as RateLimitError.
        client = openai.OpenAI(api_key=flooder, base_url=f"{server.url}/v1", max_retries=0)
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=TINY_MODEL, prompt="hi", max_tokens=2)
        assert int(limited.value.response.headers["Retry-After"]) >= 1
        assert limited.value.response.json()["error"]["code"] == "resource_exhausted"

        # GraphQL: the typed error, retryable, with retryAfterS.
        (error,) = server.graphql(SAMPLE, key=flooder)["errors"]
        assert error["extensions"]["code"] == "RESOURCE_EXHAUSTED" and error["extensions"]["resource"] == "calls"
        assert error["extensions"]["retryable"] is True and error["extensions"]["retryAfterS"] >= 1

        # Tinker: asample's submit answers 429 with Retry-After and its JSON shape; no future is made.
        submit = tinker_post(server, flooder, "asample", {"sampling_session_id": sampler, "seq_id": 0,
                                                          "num_samples": 1, "prompt": PROMPT,
                                                          "sampling_params": {"max_tokens": 2}})
        assert submit.status_code == 429, submit.text
        assert int(submit.headers["Retry-After"]) >= 1
        assert submit.json()["category"] == "server" and "error" not in submit.json()
        assert shares(server).refused[flooder_id] == refused + 3

        # The real tinker SDK backs off from the 429 and resubmits until a place frees up.
        params = types.SamplingParams(max_tokens=2, temperature=1.0)
        sampled = pool.submit(lambda: tinker_client.sample(prompt=types.ModelInput.from_ints([1, 2, 3]),
                                                           num_samples=1, sampling_params=params).result())
        server.wait_for(lambda: shares(server).refused[flooder_id] >= refused + 4 or sampled.done(),
                        "the SDK's asample refused")
        assert not sampled.done(), sampled.exception()

        # Another user is served meanwhile, on every wire.
        other_client = openai.OpenAI(api_key=other, base_url=f"{server.url}/v1", max_retries=0)
        assert other_client.completions.create(model=TINY_MODEL, prompt="hi", max_tokens=2).choices[0].text
        assert "errors" not in server.graphql(SAMPLE, key=other)
        assert not sampled.done()
    # The stream closed: its place is given back, and the SDK's next resubmission is answered.
    assert len(sampled.result(timeout=120).sequences[0].tokens) == 2
    server.wait_for(lambda: shares(server).in_flight == {}, "every place given back")
    answered = openai.OpenAI(api_key=flooder, base_url=f"{server.url}/v1", max_retries=0).completions.create(
        model=TINY_MODEL, prompt="hi", max_tokens=2)
    assert answered.choices[0].finish_reason in ("length", "stop")


def second_key(server: LiveServer, key: str) -> tuple[str, str]:
    """Another key of `key`'s user: (its secret, the first key's id), so the first can be revoked with it."""
    created = server.graphql("mutation { createApiKey(name: \"second\") { secret apiKey { id } } }", key=key)
    keys = server.graphql("{ apiKeys { id name revoked } }", key=key)["data"]["apiKeys"]
    second = created["data"]["createApiKey"]
    (first,) = [k["id"] for k in keys if k["id"] != second["apiKey"]["id"] and not k["revoked"]]
    return second["secret"], first


def revoke(server: LiveServer, key: str, key_id: str) -> None:
    body = server.graphql("mutation($k: ID!) { revokeApiKey(id: $k) { revoked } }", {"k": key_id}, key=key)
    assert body["data"]["revokeApiKey"]["revoked"] is True, body


def test_a_revoked_key_ends_its_open_v1_stream(server: LiveServer) -> None:
    key = server.new_user()
    spare, key_id = second_key(server, key)
    with open_stream(server, key) as lines:
        assert runtime_state(server)["decode_groups"]
        revoke(server, key, key_id)
        rest = list(lines)  # the stream ends by itself (hold_streams would decode it forever)
    assert rest[-1] == "data: [DONE]"
    (error,) = [json.loads(line.removeprefix("data: "))["error"] for line in rest[:-1]]
    assert error["code"] == "invalid_api_key" and "revoked" in error["message"]  # OpenAI's 401 code
    server.wait_for(lambda: not runtime_state(server)["decode_groups"], "the stream's sample to stop")
    server.wait_for(lambda: shares(server).in_flight == {}, "its place given back")
    assert "errors" not in server.graphql(SAMPLE, key=spare)  # the user's other key goes on


def test_a_revoked_key_fails_its_pending_tinker_futures(server: LiveServer) -> None:
    key = server.new_user()
    spare, key_id = second_key(server, key)
    run_id = server.graphql(CREATE, key=key)["data"]["createRun"]["id"]
    # The user's one place in the runtime (max_user_calls_in_flight 1): a call holding ticket 2 of a run, waiting
    # for ticket 1, which the test sends when it is done; the Tinker sample below waits behind it.
    client = server.backend.client
    holder = client.submit("run_info", run_id=run_id, ticket=2)
    withdrawn = sum(runtime_state(server)["calls_withdrawn"].values())
    sampler = base_sampler(server, key)
    submitted = tinker_post(server, key, "asample", {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1,
                                                     "prompt": PROMPT, "sampling_params": {"max_tokens": 2}})
    request_id = submitted.json()["request_id"]
    server.wait_for(lambda: sum(runtime_state(server)["queue_depth"].values()) == 2, "the sample to wait")
    assert tinker_post(server, spare, "retrieve_future", {"request_id": request_id}).json()["type"] == "try_again"

    revoke(server, key, key_id)
    polls: list[dict[str, Any]] = []

    def failed() -> bool:
        polls.append(tinker_post(server, spare, "retrieve_future", {"request_id": request_id}).json())
        return "error" in polls[-1]

    server.wait_for(failed, "the future to fail", timeout=30)
    assert polls[-1]["category"] == "user" and "revoked" in polls[-1]["error"]
    # Its sample was withdrawn in the runtime (never applied, not billed), and its place given back.
    server.wait_for(lambda: sum(runtime_state(server)["calls_withdrawn"].values()) == withdrawn + 1,
                    "the sample to be withdrawn")
    # the place comes back when the withdrawn sample's task ends on the server, just after the runtime counts it
    server.wait_for(lambda: shares(server).in_flight == {}, "its place given back")
    assert tinker_post(server, key, "retrieve_future", {"request_id": request_id}).status_code == 401
    assert client.submit("run_info", run_id=run_id, ticket=1).result(timeout=60)["run_id"] == run_id
    assert holder.result(timeout=60)["run_id"] == run_id


@pytest.mark.parametrize("wire", ["v1", "graphql"])
def test_the_place_is_given_back_when_a_call_fails(server: LiveServer, wire: str) -> None:
    """A sample refused for its own input frees its place: the user's next sample is served."""
    key = server.new_user()
    user_id = user_of(server, key)
    if wire == "v1":
        bad = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": TINY_MODEL, "prompt": [[10**9]], "max_tokens": 2}, timeout=60)
        assert bad.status_code == 400, bad.text
    else:
        body = server.graphql("mutation { sample(baseModel: \"tiny-llama\", promptTokens: [[1000000000]], "
                              "maxTokens: 2) { sequences { text } } }", key=key)
        assert body["errors"][0]["extensions"]["code"] == "BAD_INPUT"
    assert user_id not in shares(server).in_flight
    assert "errors" not in server.graphql(SAMPLE, key=key)
