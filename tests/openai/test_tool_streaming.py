"""A run that calls its tool: streamed tool-call deltas as OpenAI sends them, read back by the official `openai`
client's stream helper, and a later turn's prompt that starts with exactly the ids the first turn saw and wrote.

The tiny model's text is random, so a run on it (the Hermes tool template, tests/conftest.py's tool_server) first
learns one call by heart: cross-entropy on the rendered prompt followed by the call's ids, until its loss is near 0."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from transformers import AutoTokenizer

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer

pytestmark = pytest.mark.timeout(600)

ADD: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "add", "description": "Add two integers", "strict": False,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2+3?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def taught(tool_server: LiveServer, tiny_model_dir: str) -> Iterator[tuple[openai.OpenAI, str]]:
    """A client and a run on tiny-hermes that answers QUESTION with CALL (greedy)."""
    key = tool_server.new_user()
    run = SignalClient(api_key=key, base_url=tool_server.url).create_run(
        base_model="tiny-hermes", lora_r=16, lora_alpha=32, train_mlp=True, train_unembed=True, seed=3)
    client = openai.OpenAI(api_key=key, base_url=f"{tool_server.url}/v1", max_retries=0)
    seen = client.chat.completions.create(model=run.id, messages=QUESTION, tools=[ADD], max_tokens=1,
                                          extra_body={"return_token_ids": True})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = (seen.model_extra or {})["prompt_token_ids"] + tokenizer(CALL, add_special_tokens=False)["input_ids"] + \
        [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    answer_from = len((seen.model_extra or {})["prompt_token_ids"]) - 1
    datum = {"model_input": tokens[:-1], "loss_fn_inputs": {
        "target_tokens": tokens[1:], "weights": [0.0] * answer_from + [1.0] * (len(tokens) - 1 - answer_from)}}
    losses = []
    for _ in range(100):  # until the call is learnt by heart
        losses.append(run.forward_backward([datum]).loss)
        run.optim_step(learning_rate=0.005)
        if losses[-1] < 0.05:
            break
    assert losses[-1] < 0.05, losses
    yield client, run.id


def test_a_whole_answer_reads_the_learnt_call(taught: tuple[openai.OpenAI, str]) -> None:
    client, model = taught
    answer = client.chat.completions.create(model=model, messages=QUESTION, tools=[ADD], max_tokens=40,
                                            temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}


def test_a_streamed_call_sends_its_name_then_its_arguments_in_pieces(taught: tuple[openai.OpenAI, str]) -> None:
    client, model = taught
    stream = client.chat.completions.create(model=model, messages=QUESTION, tools=[ADD], max_tokens=40,
                                            temperature=0, stream=True)
    deltas: list[Any] = []
    finishes = []
    for chunk in stream:
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    first, rest = deltas[0], deltas[1:]
    assert first.id and first.id.startswith("call_") and first.function.name == "add"
    assert first.function.arguments == ""  # the name goes first, alone
    assert len(rest) >= 2 and all(d.id is None and d.function.name is None for d in rest)  # then arguments in pieces
    assert json.loads("".join(d.function.arguments for d in rest)) == {"a": 2, "b": 3}


def test_the_openai_stream_helper_reassembles_the_call(taught: tuple[openai.OpenAI, str]) -> None:
    client, model = taught
    kinds = set()
    with client.chat.completions.stream(model=model, messages=QUESTION, tools=[ADD], max_tokens=40,
                                        temperature=0) as stream:
        for event in stream:
            kinds.add(event.type)
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    calls = final.choices[0].message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].function.name == "add"
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}


@pytest.fixture(scope="module")
def base_client(tool_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(api_key=tool_server.new_user(), base_url=f"{tool_server.url}/v1", max_retries=0)


def test_a_later_turns_prompt_starts_with_the_ids_of_the_first(base_client: openai.OpenAI) -> None:
    client, model = base_client, "tiny-hermes"  # the call forced: its arguments are the random model's
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=[ADD], max_tokens=6, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           extra_body={"return_token_ids": True})
    seen, wrote = (first.model_extra or {})["prompt_token_ids"], (first.choices[0].model_extra or {})["token_ids"]
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]  # forced: a call
    assistant: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
                                 "prompt_token_ids": seen, "token_ids": wrote}  # Signal's extension: the ids sampled
    history: Any = [*QUESTION, assistant, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = client.chat.completions.create(model=model, messages=history, tools=[ADD], max_tokens=2,
                                            extra_body={"return_token_ids": True})
    ids = (second.model_extra or {})["prompt_token_ids"]
    assert ids[:len(seen) + len(wrote)] == seen + wrote and len(ids) > len(seen) + len(wrote)
    plain: Any = [*QUESTION, {**assistant, "prompt_token_ids": None, "token_ids": None}, history[2]]
    without = client.chat.completions.create(model=model, messages=plain, tools=[ADD], max_tokens=2,
                                             extra_body={"return_token_ids": True})
    redrawn = (without.model_extra or {})["prompt_token_ids"]  # the call re-rendered from its text: not as sampled
    assert redrawn[:len(seen) + len(wrote)] != seen + wrote


@pytest.mark.parametrize("carried, param", [
    ({"prompt_token_ids": [1, 2]}, "messages[1].token_ids"),
    ({"prompt_token_ids": [1, -2], "token_ids": [3]}, "messages[1].prompt_token_ids"),
    ({"prompt_token_ids": [1], "token_ids": "3"}, "messages[1].token_ids"),
])
def test_bad_carried_ids_are_400s_naming_the_field(base_client: openai.OpenAI, carried: dict[str, Any],
                                                   param: str) -> None:
    client, model = base_client, "tiny-hermes"
    messages = [*QUESTION, {"role": "assistant", "content": "Hi", **carried}, {"role": "user", "content": "Again"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/chat/completions", cast_to=object, body={"model": model, "messages": messages, "max_tokens": 2})
    assert json.loads(caught.value.response.text)["error"]["param"] == param
