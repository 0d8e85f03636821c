"""Tool calling on /v1/chat/completions with the official `openai` package, sync and streaming, on a live server whose
catalogue has the tiny model under three tool templates (tests/fixtures/chat_templates: Hermes, Llama 3.1 JSON,
GPT-OSS harmony). The tiny model's text is random, so the round trips force the call with a named `tool_choice`
(the prompt ends with the call's opening; the model writes the arguments): call → tool message → final answer."""

from __future__ import annotations

import json
from typing import Any, cast

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from app.openai.tools import MAX_MESSAGES, MAX_TOOL_BYTES, MAX_TOOLS
from tests.helpers.live_server import TINY_MODEL, LiveServer

pytestmark = pytest.mark.timeout(600)

FAMILIES = ("hermes", "llama3_json", "gpt_oss")  # tests/openai/conftest.py: tiny-{family}
ADD: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def client(tool_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(api_key=tool_server.new_user(), base_url=f"{tool_server.url}/v1", max_retries=0)


def extra(obj: Any) -> dict[str, Any]:
    return obj.model_extra or {}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_call_round_trip(client: openai.OpenAI, family: str) -> None:
    model = f"tiny-{family}"
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=[ADD], max_tokens=6, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           extra_body={"return_token_ids": True})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert isinstance(call.function.arguments, str)
    prompt = extra(first)["prompt_token_ids"]
    assert first.usage is not None and first.usage.prompt_tokens == len(prompt)
    history: list[ChatCompletionMessageParam] = [*QUESTION, {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": call.id, "type": "function",
                        "function": {"name": "add", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    final = client.chat.completions.create(model=model, messages=history, tools=[ADD], tool_choice="none",
                                           max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and isinstance(answer.message.content, str)
    assert not answer.message.tool_calls
    whole = extra(final)["prompt_token_ids"]  # the whole rendered history: the call and its result in it
    assert len(whole) > len(prompt) and final.usage is not None and final.usage.prompt_tokens == len(whole)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_streamed_tool_call(client: openai.OpenAI, family: str) -> None:
    stream = client.chat.completions.create(model=f"tiny-{family}", messages=QUESTION, tools=[ADD], max_tokens=6,
                                            temperature=0, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "add"}})
    names, arguments, finishes = [], "", []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                if delta.function and delta.function.name:
                    names.append(delta.function.name)
                arguments += (delta.function.arguments or "") if delta.function else ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert names == ["add"] and finishes == ["tool_calls"]
    same = client.chat.completions.create(model=f"tiny-{family}", messages=QUESTION, tools=[ADD], max_tokens=6,
                                          temperature=0, tool_choice={"type": "function", "function": {"name": "add"}})
    calls = same.choices[0].message.tool_calls
    assert calls and calls[0].type == "function" and arguments == calls[0].function.arguments


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tool_choice_variants(client: openai.OpenAI, choice: str) -> None:
    answer = client.chat.completions.create(model="tiny-hermes", messages=QUESTION, tools=[ADD], max_tokens=6,
                                            temperature=0, tool_choice=cast(Any, choice))
    message, finish = answer.choices[0].message, answer.choices[0].finish_reason
    if message.tool_calls:  # the random model wrote a valid call (auto) or named a tool (required)
        assert choice != "none" and finish == "tool_calls" and {c.function.name for c in message.tool_calls if c.type == "function"} == {"add"}
        return
    assert finish in ("stop", "length") and isinstance(message.content, str)
    if choice == "required":  # forced open, but the random model's name is no tool's: its text, and why
        assert extra(answer.choices[0])["tool_parse_error"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [ADD], "model": TINY_MODEL}, "tools"),  # SmolLM2's own template takes no tools
    ({"tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [ADD] * (MAX_TOOLS + 1)}, "tools"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "big", "description": "x" * MAX_TOOL_BYTES}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, "messages"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]},
     "messages[0].tool_calls[0]"),
])
def test_bad_tool_requests_are_400s_naming_the_parameter(client: openai.OpenAI, body: dict[str, Any],
                                                         param: str) -> None:
    request = {"model": "tiny-hermes", "messages": QUESTION, "tools": [ADD], "max_tokens": 2, **body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/chat/completions", cast_to=object, body=request)
    assert caught.value.status_code == 400 and json.loads(caught.value.response.text)["error"]["param"] == param
