"""/v1 streams fed by the runtime's decode chunks, with the official `openai` package and httpx as clients, on a live
server with the tiny model and short decode chunks: the chunks add up to the whole answer, a second stream starts
while a first decodes, a client that goes away cancels its generation (recorded as cancelled), and training on
another run is answered while a long stream decodes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer

pytestmark = pytest.mark.timeout(600)

LONG = 200  # tokens: many decode chunks of the tiny model (its context is 256)
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story"}]
BASE_SAMPLES = "query { baseSamples { prompt output params } }"


@pytest.fixture(scope="module")
def owner(streaming_server: LiveServer) -> tuple[str, str]:
    key = streaming_server.new_user()
    return key, SignalClient(api_key=key, base_url=streaming_server.url).create_run(lora_r=4).id


@pytest.fixture(scope="module")
def admin(streaming_server: LiveServer) -> str:
    return streaming_server.new_user(is_admin=True)


def decode_groups(server: LiveServer, admin: str) -> list[dict[str, Any]]:
    body = server.graphql("{ runtime }", key=admin)
    assert "errors" not in body
    return list(body["data"]["runtime"]["decode_groups"])


def on_the_base(group: dict[str, Any]) -> bool:
    """A decode group with base-model samples in it (their routing key is "base:" and the model's path)."""
    return any(key.startswith("base:") for key in group["runs"])


def events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """A stream's chunks as they come (the [DONE] line ends it)."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def content(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or [{}]
    return str((choices[0].get("delta") or {}).get("content") or "")


def long_stream(server: LiveServer, key: str, model: str) -> Any:
    body = {"model": model, "messages": MESSAGES, "max_tokens": LONG, "temperature": 1.0, "seed": 5, "stream": True}
    return httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300,
                        headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("chat", [True, False])
def test_a_greedy_stream_comes_in_chunks_that_add_up_to_the_answer(streaming_server: LiveServer,
                                                                  owner: tuple[str, str], chat: bool) -> None:
    client = openai.OpenAI(api_key=owner[0], base_url=f"{streaming_server.url}/v1", max_retries=0)
    ask: dict[str, Any] = {"model": owner[1], "max_tokens": 24, "temperature": 0,
                           "extra_body": {"return_token_ids": True}}
    if chat:
        whole = client.chat.completions.create(messages=MESSAGES, **ask)
        chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **ask))
        texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        expected, expected_ids = whole.choices[0].message.content, (whole.choices[0].model_extra or {})["token_ids"]
    else:
        whole = client.completions.create(prompt="Once upon a time", **ask)
        chunks = list(client.completions.create(prompt="Once upon a time", stream=True, **ask))
        texts = [c.choices[0].text for c in chunks if c.choices]
        expected, expected_ids = whole.choices[0].text, (whole.choices[0].model_extra or {})["token_ids"]
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert len(expected_ids) > 4  # enough tokens to need several decode chunks
    assert "".join(texts) == expected and ids == expected_ids
    assert sum(1 for text in texts if text) > 1  # streamed as it decoded, not once at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]


def test_a_second_stream_starts_while_the_first_decodes(streaming_server: LiveServer, owner: tuple[str, str],
                                                        admin: str) -> None:
    key, run_id = owner
    with long_stream(streaming_server, key, TINY_MODEL) as first:
        first_events = events(first.iter_lines())
        assert any(content(chunk) for chunk in first_events)  # the first stream is decoding
        with long_stream(streaming_server, key, run_id) as second:
            assert any(content(chunk) for chunk in events(second.iter_lines()))  # its first token is here…
            # …and the first stream's group is still decoding in the runtime.
            assert any(on_the_base(group) and group["tokens_done"] < LONG
                       for group in decode_groups(streaming_server, admin))


def test_a_client_that_goes_away_stops_its_generation(streaming_server: LiveServer, admin: str) -> None:
    key = streaming_server.new_user()
    with long_stream(streaming_server, key, TINY_MODEL) as response:
        assert any(content(chunk) for chunk in events(response.iter_lines()))
    # The connection is closed: the runtime cancels the sample, and no decode group is left.
    streaming_server.wait_for(lambda: not decode_groups(streaming_server, admin), "the decode group to go", 60)
    streaming_server.wait_for(lambda: bool(streaming_server.graphql(BASE_SAMPLES, key=key)["data"]["baseSamples"]),
                              "the cancelled sample's record", 60)
    rows = streaming_server.graphql(BASE_SAMPLES, key=key)["data"]["baseSamples"]
    assert len(rows) == 1 and rows[0]["params"]["finish_reason"] == "cancelled"
    assert rows[0]["output"]  # what it had generated is kept


def test_training_another_run_is_answered_during_a_long_stream(streaming_server: LiveServer,
                                                               owner: tuple[str, str], admin: str) -> None:
    other = SignalClient(api_key=streaming_server.new_user(), base_url=streaming_server.url).create_run(lora_r=4)
    with long_stream(streaming_server, owner[0], TINY_MODEL) as response:
        stream = events(response.iter_lines())
        assert any(content(chunk) for chunk in stream)
        result = other.forward_backward(batch=[{"text": "trained while a stream decodes"}])
        assert result["num_tokens"] > 0
        groups = decode_groups(streaming_server, admin)
        assert any(on_the_base(group) for group in groups), groups  # the stream still decodes


def latest_groups(server: LiveServer, admin: str, run_id: str) -> list[dict[str, Any]]:
    """Decode groups reading copies of the run's latest weights (routing key "<run_id>@latest:<step>-<id>")."""
    return [group for group in decode_groups(server, admin)
            if any(key.startswith(f"{run_id}@latest:") for key in group["runs"])]


def test_two_streams_on_one_run_decode_together(streaming_server: LiveServer, admin: str) -> None:
    key = streaming_server.new_user()
    run = SignalClient(api_key=key, base_url=streaming_server.url).create_run(lora_r=4)
    with long_stream(streaming_server, key, run.id) as first:
        first_events = events(first.iter_lines())  # kept: a generator dropped closes its stream (a disconnect)
        assert any(content(chunk) for chunk in first_events)  # the first stream is decoding
        with long_stream(streaming_server, key, run.id) as second:
            second_events = events(second.iter_lines())
            assert any(content(chunk) for chunk in second_events)  # its first token is here…
            # …while the first still decodes: both calls are in the runtime's decode groups, neither waits for the run.
            calls = sum(group["calls"] for group in latest_groups(streaming_server, admin, run.id))
            assert calls == 2, decode_groups(streaming_server, admin)


def test_an_optim_step_during_a_stream_does_not_change_what_it_decodes(streaming_server: LiveServer,
                                                                       admin: str) -> None:
    key = streaming_server.new_user()
    run = SignalClient(api_key=key, base_url=streaming_server.url).create_run(lora_r=4)
    client = openai.OpenAI(api_key=key, base_url=f"{streaming_server.url}/v1", max_retries=0)
    run.forward_backward(batch=[{"text": "a gradient pending while the stream starts"}])  # changes no weights
    before = run.save_weights_for_sampler()
    assert before["step"] == 0
    body = {"model": run.id, "messages": MESSAGES, "max_tokens": LONG, "temperature": 1.0, "seed": 5, "stream": True,
            "return_token_ids": True}
    streamed: list[int] = []
    with httpx.stream("POST", f"{streaming_server.url}/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        chunks = events(response.iter_lines())
        for chunk in chunks:
            streamed += (chunk.get("choices") or [{}])[0].get("token_ids") or []
            if streamed:
                break
        assert run.optim_step(learning_rate=5e-2)["step"] == 1
        assert latest_groups(streaming_server, admin, run.id)  # the step was applied while the stream decoded
        for chunk in chunks:
            streamed += (chunk.get("choices") or [{}])[0].get("token_ids") or []
    ask: dict[str, Any] = {"messages": MESSAGES, "max_tokens": LONG, "temperature": 1.0, "seed": 5,
                           "extra_body": {"return_token_ids": True}}
    on_before = client.chat.completions.create(model=f"{run.id}@{before['name']}", **ask)  # type: ignore[call-overload]  # kwargs
    assert streamed == (on_before.choices[0].model_extra or {})["token_ids"]  # the stream decoded step 0's weights
    # A request after the step samples the new weights: its first token's logprob is not step 0's.
    ask = {**ask, "max_tokens": 4, "logprobs": True}
    lp_after, lp_before = (client.chat.completions.create(model=model, **ask).choices[0].logprobs.content[0].logprob  # type: ignore[call-overload, union-attr]  # kwargs; logprobs asked
                           for model in (run.id, f"{run.id}@{before['name']}"))
    assert abs(lp_after - lp_before) > 1e-3
    # The run's history (snapshot requests are in it too, named): the stream at step 0, the later request at step 1.
    steps = sorted(row["step"] for row in run.samples() if "snapshot" not in row["params"])
    assert steps == [0, 1], steps
