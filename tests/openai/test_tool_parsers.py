"""Each template family's tool-call parser on fixed strings (a tiny random model never writes a valid call): calls
read out with their JSON arguments, text around them kept as content, anything malformed left as text."""

from __future__ import annotations

import json

import pytest

from app.openai import tool_parsers

NAMES = {"add", "weather"}


@pytest.mark.parametrize("family, text, content, calls", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', None,
     [("add", {"a": 1, "b": 2})]),
    ("hermes", 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>'
               '{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>', "Let me add.",
     [("add", {"a": 1}), ("weather", {"city": "Oslo"})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', None, [("add", {"a": 1})]),  # cut at EOS
    ("hermes", "Just text.", "Just text.", []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "weather", "parameters": '
                    '{"city": "Oslo"}}', None, [("add", {"a": 1}), ("weather", {"city": "Oslo"})]),
    ("llama3_json", "The answer is 3.", "The answer is 3.", []),
    ("gpt_oss", '<|channel|>analysis<|message|>Need to add.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>', None,
     [("add", {"a": 1, "b": 2})]),
    ("gpt_oss", 'analysisNeed to add.commentary to=functions.add json{"a": 1}', None, [("add", {"a": 1})]),
    ("gpt_oss", "<|channel|>final<|message|>It is 3.<|return|>", "It is 3.", []),
])
def test_a_family_reads_calls_and_content(family: str, text: str, content: str | None,
                                          calls: list[tuple[str, dict]]) -> None:
    parsed = tool_parsers.parse(family, text, NAMES)
    assert parsed.malformed is None
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("family, text, why", [
    ("hermes", "<tool_call>{not json</tool_call>", "not JSON"),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "not one of the request's tools"),
    ("hermes", '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "not a JSON object"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}', "not JSON"),
    ("llama3_json", '{"answer": 3}', "a name"),
    ("gpt_oss", "commentary to=functions.add json{oops", "not JSON"),
])
def test_malformed_calls_stay_text(family: str, text: str, why: str) -> None:
    parsed = tool_parsers.parse(family, text, NAMES)
    assert parsed.calls == [] and parsed.content == text
    assert parsed.malformed is not None and why in parsed.malformed


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = ('<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>{"name": "weather", "arguments": {}}'
            "</tool_call>")
    assert [c.name for c in tool_parsers.parse("hermes", text, NAMES, parallel=False).calls] == ["add"]


@pytest.mark.parametrize("family", tool_parsers.FAMILIES)
def test_a_forced_named_call_is_a_call_even_when_its_arguments_are_not_json(family: str) -> None:
    head = tool_parsers.NAMED_HEADS[family] % "add"
    valid = '{"a": 1}' + ("}\n</tool_call>" if family == "hermes" else "}" if family == "llama3_json" else "<|call|>")
    parsed = tool_parsers.forced(family, head, valid, NAMES, "add")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 1})] and not parsed.malformed
    noise = tool_parsers.forced(family, head, " banana split", NAMES, "add")
    assert [(c.name, c.arguments) for c in noise.calls] == [("add", "banana split")] and noise.content is None


def test_a_forced_required_call_without_a_valid_name_stays_text() -> None:
    head = tool_parsers.ANY_HEADS["hermes"]
    parsed = tool_parsers.forced("hermes", head, 'add", "arguments": {"a": 2}}</tool_call>', NAMES, None)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 2})]
    noise = tool_parsers.forced("hermes", head, "zzz", NAMES, None)
    assert noise.calls == [] and noise.content == "zzz" and noise.malformed
