"""The Responses API (`POST /v1/responses`) with the official `openai` package, whole and streamed, on the tiny model
under a Hermes tool template (tests/conftest.py's tool_server). The call is forced with a named `tool_choice`."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.responses import FunctionToolParam

from tests.helpers.live_server import LiveServer

pytestmark = pytest.mark.timeout(600)

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ADD: FunctionToolParam = {"type": "function", "name": "add", "description": "Add two integers", "strict": False,
                          "parameters": SCHEMA}
FORCE_ADD: Any = {"type": "function", "name": "add"}


@pytest.fixture(scope="module")
def key(tool_server: LiveServer) -> str:
    return tool_server.new_user()


@pytest.fixture(scope="module")
def client(tool_server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{tool_server.url}/v1", max_retries=0)


def test_a_function_call_and_its_output_through_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny-hermes", instructions="Use the tools.", input="What is 2+3?",
                                    tools=[ADD], tool_choice=FORCE_ADD, max_output_tokens=6, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.object == "response" and len(calls) == 1 and calls[0].name == "add"
    assert isinstance(calls[0].arguments, str) and calls[0].call_id.startswith("call_")
    prompt = (first.model_extra or {})["prompt_token_ids"]
    assert first.usage is not None and first.usage.input_tokens == len(prompt)
    second = client.responses.create(model="tiny-hermes", previous_response_id=first.id, tools=[ADD],
                                     tool_choice="none", max_output_tokens=4, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "5"}])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert [item.type for item in second.output] in (["message"], [])  # the random model may say nothing
    history = (second.model_extra or {})["prompt_token_ids"]
    assert len(history) > len(prompt) - 8 and second.usage is not None and second.usage.input_tokens == len(history)


def test_a_streamed_response_sends_the_events_the_sdk_reads(client: openai.OpenAI) -> None:
    kinds, final = [], None
    with client.responses.create(model="tiny-hermes", input="What is 2+3?", tools=[ADD], tool_choice=FORCE_ADD,
                                 max_output_tokens=6, temperature=0, stream=True) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] in ("response.completed",
                                                                              "response.incomplete")
    assert final is not None and [item.type for item in final.output] == ["function_call"]


def test_previous_response_ids_are_the_users_own(tool_server: LiveServer, client: openai.OpenAI) -> None:
    mine = client.responses.create(model="tiny-hermes", input="Hi", max_output_tokens=2)
    stranger = openai.OpenAI(api_key=tool_server.new_user(), base_url=f"{tool_server.url}/v1", max_retries=0)
    for who, ident in [(stranger, mine.id), (client, "resp_unknown")]:
        with pytest.raises(openai.NotFoundError) as caught:
            who.responses.create(model="tiny-hermes", input="Hi", previous_response_id=ident, max_output_tokens=2)
        assert json.loads(caught.value.response.text)["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "image_generation_call"}]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input"),
])
def test_bad_responses_requests_are_400s_naming_the_parameter(client: openai.OpenAI, body: dict[str, Any],
                                                              param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", cast_to=object, body={"model": "tiny-hermes", "input": "Hi", **body})
    assert json.loads(caught.value.response.text)["error"]["param"] == param
