"""Each template family's tool-call parser on fixed strings (a tiny random model never writes a valid call): calls
read out with their JSON arguments, text around them kept as content, anything malformed left as text."""

from __future__ import annotations

import json

import pytest

from app.openai import tool_parsers
from app.openai.tool_stream_forms import reader
from app.openai.tools import Tools

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


def _streamed(text: str, size: int, tools: Tools) -> tuple[str, list[tuple[str, object]], str, dict[str, str]]:
    """`text` fed to its family's reader `size` characters at a time, its deltas merged as OpenAI's clients merge
    them."""
    stream, deltas = reader(tools), []
    for at in range(0, len(text), size):
        deltas += stream.feed(text[at:at + size])
    rest, finish, said = stream.finish("stop")
    content, calls = "", {}  # type: ignore[var-annotated]
    for delta in deltas + rest:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            merged = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            assert ("id" in call) == (merged["name"] == "")  # the id and name come first, once
            merged["name"] += call.get("function", {}).get("name", "")
            merged["arguments"] += call.get("function", {}).get("arguments", "")
    return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], finish, said


HERMES_STREAMS = [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "", [("add", {"a": 1, "b": 2})]),
    ('Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "s": "}\\"{"}}</tool_call>\n<tool_call>'
     '{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>', "Let me add.",
     [("add", {"a": 1, "s": '}"{'}), ("weather", {"city": "Oslo"})]),  # a string's braces; string arguments whole
    ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>', "", [("add", {"a": 1})]),  # name last: whole
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),  # cut at EOS
    ("Just text with a < and <tool", "Just text with a < and <tool", []),
    ('So <tool_call>{"name": "nope", "arguments": {}}</tool_call>', 'So <tool_call>{"name": "nope", "arguments": {}}'
     '</tool_call>', []),  # not a declared tool: text, as the whole answer reads it
]


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("text, content, calls", HERMES_STREAMS)
def test_a_hermes_answer_streams_as_the_deltas_of_its_whole_reading(text: str, content: str,
                                                                     calls: list[tuple[str, object]],
                                                                     size: int) -> None:
    _streams_as_its_whole_reading("hermes", text, content, calls, size)


def _streams_as_its_whole_reading(family: str, text: str, content: str, calls: list[tuple[str, object]],
                                  size: int) -> None:
    tools = Tools(definitions=[{"type": "function", "function": {"name": name}} for name in sorted(NAMES)],
                  family=family)
    got_content, got_calls, finish, said = _streamed(text, size, tools)
    assert (got_content, got_calls, finish) == (content, calls, "tool_calls" if calls else "stop")
    whole = tool_parsers.parse(family, text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == got_calls
    assert (whole.content or "") == got_content
    assert ("tool_parse_error" in said) == (whole.malformed is not None)


OTHER_STREAMS = [
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ("llama3_json", ' <|python_tag|>{"name": "add", "parameters": {"a": 1, "s": "}\\"{"}}; {"name": "weather", '
                    '"parameters": {"city": "Oslo"}, "id": 7}', "", [("add", {"a": 1, "s": '}"{'}),
                                                                     ("weather", {"city": "Oslo"})]),
    ("llama3_json", '{"parameters": {"a": 1}, "name": "add"}', "", [("add", {"a": 1})]),  # name last: whole
    ("llama3_json", "The answer is 3.", "The answer is 3.", []),
    ("llama3_json", "<|python_tag|>print(3)", "<|python_tag|>print(3)", []),  # not JSON calls: text
    ("llama3_json", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),  # undeclared
    ("gpt_oss", '<|channel|>analysis<|message|>Need to add.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}<|call|>', "",
     [("add", {"a": 1, "b": 2})]),
    ("gpt_oss", 'analysisNeed to add.commentary to=functions.add json{"a": 1}', "", [("add", {"a": 1})]),
    ("gpt_oss", '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|><|start|>assistant'
                '<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
                "<|start|>assistant<|channel|>final<|message|>Asked both.<|return|>", "Asked both.",
     [("add", {"a": 1}), ("weather", {"city": "Oslo"})]),  # the final channel's content after the calls
    ("gpt_oss", "<|channel|>commentary to=functions.add <|constrain|>json<|message|>"
                '"{\\"a\\": 1}"<|call|>', "", [("add", {"a": 1})]),  # string arguments: whole
    ("gpt_oss", "<|channel|>final<|message|>It is 3.<|return|>", "It is 3.", []),
    ("gpt_oss", "It is 3.", "It is 3.", []),
    ("gpt_oss", 'commentary to=functions.nope json{"a": 1}<|call|>', 'commentary to=functions.nope json{"a": 1}'
                "<|call|>", []),  # undeclared: text
]


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("family, text, content, calls", OTHER_STREAMS)
def test_llama_and_gpt_oss_answers_stream_as_the_deltas_of_their_whole_reading(
        family: str, text: str, content: str, calls: list[tuple[str, object]], size: int) -> None:
    _streams_as_its_whole_reading(family, text, content, calls, size)


@pytest.mark.parametrize("family, text", [
    ("llama3_json", '{"name": "add", "parameters": {"a": 12, "b": 30}}'),
    ("gpt_oss", '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 12, "b": 30}<|call|>'),
])
def test_a_call_sends_its_name_before_its_arguments_are_written(family: str, text: str) -> None:
    stream = reader(Tools(definitions=[{"type": "function", "function": {"name": "add"}}], family=family))
    deltas = [delta for k in range(len(text)) for delta in stream.feed(text[k])]
    calls = [d["tool_calls"][0] for d in deltas]
    assert calls[0]["function"] == {"name": "add", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert len(calls) > 10 and all("id" not in c for c in calls[1:])  # then the arguments, piece by piece
    assert "".join(c["function"]["arguments"] for c in calls) == '{"a": 12, "b": 30}'
    assert stream.finish("stop") == ([], "tool_calls", {})


@pytest.mark.parametrize("family, text, why", [
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then some', "text after the calls"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', "cut short"),
    ("gpt_oss", "commentary to=functions.add json{\"a\": ", "cut short"),
    ("gpt_oss", 'commentary to=functions.add json{"a": 1}<|call|>commentary to=functions.nope json{}', "nope"),
])
def test_what_goes_wrong_after_a_streamed_call_is_said(family: str, text: str, why: str) -> None:
    tools = Tools(definitions=[{"type": "function", "function": {"name": name}} for name in sorted(NAMES)],
                  family=family)
    stream = reader(tools)
    deltas = [delta for k in range(0, len(text), 3) for delta in stream.feed(text[k:k + 3])]
    rest, finish, said = stream.finish("stop")
    assert [d["tool_calls"][0]["function"].get("name") for d in deltas + rest][0] == "add" and finish == "tool_calls"
    assert why in said["tool_parse_error"]


@pytest.mark.parametrize("family", tool_parsers.FAMILIES)
def test_a_forced_calls_arguments_stream_after_its_name(family: str) -> None:
    tools = Tools(definitions=[{"type": "function", "function": {"name": "add"}}], choice="named", named="add",
                  family=family)
    tools.forced = tools.head(family)
    stream = reader(tools)
    first = stream.feed('{"a": ')
    assert first[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}  # the name before any argument
    assert first[1:] == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}]
    end = {"hermes": "}\n</tool_call>", "llama3_json": "}", "gpt_oss": "<|call|>"}[family]
    assert stream.feed("2}" + end) == [{"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}]
    assert stream.finish("stop") == ([], "tool_calls", {})
