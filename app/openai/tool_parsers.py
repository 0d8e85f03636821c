"""A model's text read back as tool calls, one parser per chat-template family (the runtime names the family from the
template: RenderChatResult.tool_format):

- `hermes` (Qwen 2.5/3, Hermes, and the default for a tool template that names no family): `<tool_call>{"name": …,
  "arguments": {…}}</tool_call>` blocks, text before them as content;
- `llama3_json` (Llama 3.1+): the whole answer one or more JSON objects `{"name": …, "parameters": {…}}` (optionally
  after `<|python_tag|>`, several separated by `;`);
- `gpt_oss` (harmony): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}<|call|>`, the `final`
  channel's message as content (with the special tokens decoded away, as Signal's text has them, the same words).

Text that is not a complete, valid call to a declared function stays text: `parse` says `malformed` when it looked
like one (the route answers it as content, `finish_reason` "stop"/"length", and says so in `tool_parse_error`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpu_runtime.contract.json_types import JSONObject

FAMILIES = ("hermes", "llama3_json", "gpt_oss")
DEFAULT_FAMILY = "hermes"

# The opening of a call, for a forced `tool_choice`: the prompt ends with it, the model writes the arguments on.
NAMED_HEADS = {"hermes": '<tool_call>\n{"name": "%s", "arguments": ',
               "llama3_json": '{"name": "%s", "parameters": ',
               "gpt_oss": "<|channel|>commentary to=functions.%s <|constrain|>json<|message|>"}
ANY_HEADS = {"hermes": '<tool_call>\n{"name": "', "llama3_json": '{"name": "',
             "gpt_oss": "<|channel|>commentary to=functions."}
CLOSERS = {"hermes": "</tool_call>", "llama3_json": "", "gpt_oss": "<|call|>"}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's wire carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def wire(self, index: int | None = None) -> JSONObject:
        item: JSONObject = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return item if index is None else {"index": index, **item}


@dataclass
class Parsed:
    content: str | None
    calls: list[ToolCall]
    malformed: str | None = None  # why text that looked like a call stayed text


class NotACall(ValueError):
    pass


def _call(obj: Any, names: set[str], arguments_key: str = "arguments") -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise NotACall("a call is a JSON object with a name")
    if obj["name"] not in names:
        raise NotACall(f"{obj['name']!r} is not one of the request's tools")
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise NotACall("its arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise NotACall("its arguments are not a JSON object")
    return ToolCall(obj["name"], json.dumps(arguments))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise NotACall(f"not JSON: {text[:60]!r}") from None


HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def hermes(text: str, names: set[str]) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text, [])
    calls = [_call(_json(body.strip()), names) for body in HERMES.findall(text[start:])]
    return Parsed(text[:start].strip() or None, calls)


def llama3_json(text: str, names: set[str]) -> Parsed:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return Parsed(text, [])
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            raise NotACall(f"not JSON: {body[at:at + 60]!r}") from None
        calls.append(_call(obj, names, "parameters"))
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return Parsed(None, calls)


GPT_OSS_CALL = re.compile(r"(?:<\|channel\|>)?commentary to=functions\.([\w.\-]+)\s*(?:<\|constrain\|>)?\s*(?:json)?"
                          r"\s*(?:<\|message\|>)?(.*?)(?:<\|call\|>|<\|end\|>|<\|start\|>|$)", re.S)
GPT_OSS_FINAL = re.compile(r"(?:<\|channel\|>)?final\s*(?:<\|message\|>)(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)


def gpt_oss(text: str, names: set[str]) -> Parsed:
    final = GPT_OSS_FINAL.search(text)
    content = final.group(1).strip() if final else None
    found = GPT_OSS_CALL.findall(text)
    if not found:
        return Parsed(text if final is None else content, [])
    calls = [_call({"name": name, "arguments": _json(body.strip())}, names) for name, body in found]
    return Parsed(content, calls)


PARSERS = {"hermes": hermes, "llama3_json": llama3_json, "gpt_oss": gpt_oss}


def parse(family: str, text: str, names: set[str], parallel: bool = True) -> Parsed:
    """`text`'s tool calls in `family`'s format; text that is not a valid call to one of `names` stays text."""
    try:
        parsed = PARSERS[family](text, names)
    except NotACall as why:
        return Parsed(text, [], malformed=str(why))
    if not parallel:
        parsed.calls = parsed.calls[:1]
    return parsed


def forced(family: str, head: str, generated: str, names: set[str], name: str | None) -> Parsed:
    """A forced call's answer: the prompt ended with `head` (NAMED_HEADS or ANY_HEADS), the model wrote `generated`.
    A named call stays a call when its arguments are not valid JSON (OpenAI's own may not be: callers validate them);
    an unnamed one (`required`) whose name does not parse stays text."""
    parsed = parse(family, head + generated, names)
    if parsed.calls or name is None:
        return parsed if parsed.calls else Parsed(generated, [], parsed.malformed or "no call in the answer")
    arguments = generated.strip()
    closer = CLOSERS[family]
    if closer and closer in arguments:
        arguments = arguments[:arguments.index(closer)].rstrip()
    if family != "gpt_oss" and arguments.endswith("}"):
        arguments = arguments[:-1].rstrip()  # the call object's own brace, after the arguments'
    return Parsed(None, [ToolCall(name, arguments)], malformed=parsed.malformed)
