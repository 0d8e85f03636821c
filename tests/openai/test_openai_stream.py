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
    """A decode group of base-model samples (their routing key is "base:" and the model's path)."""
    return all(key.startswith("base:") for key in group["runs"])


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
