"""A streamed chat answer's tool calls as OpenAI sends them: content until a call opens; then per call one delta with
its index, id, type and name (arguments ""), then its arguments in fragments as they are sampled; the finish
"tool_calls". OpenAI's clients merge the fragments by index. This is the reader's common part and Hermes' form; the
Llama 3.1 JSON and GPT-OSS forms read on it in app/openai/tool_stream_forms.py, which picks a reader per family.

Hermes' `<tool_call>{"name": …, "arguments": {…}}</tool_call>` streams piece by piece (a forced call's opening, in the
prompt, is read first and never sent). What the stream cannot read piece by piece goes whole once it can: a block whose
arguments come before its name, at its `</tool_call>`; any other answer (no call streamed) at the end, as the whole
answer reads it (tool_answers.message), its held text as content. Once a call's name is sent the call stands: arguments
that turn out not to be a JSON object are said in the finish's `tool_parse_error`, as a forced call's are.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TypedDict

from app.openai import tool_answers, tool_parsers
from app.openai.tools import Tools
from gpu_runtime.contract.json_types import as_object, get_object, get_str

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _held_back(text: str) -> int:
    """How much of `text`'s end may be the start of OPEN: held until the next text says."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


class Braces:
    """Where a JSON value's outermost brace closes, read piece by piece (strings' braces and escapes skipped)."""

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_string, self.escaped = depth, False, False

    def scan(self, text: str) -> int | None:
        """The end of the value in `text` (read on from where the last text left it), or None."""
        for k, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return k + 1
        return None


class FunctionDelta(TypedDict, total=False):
    name: str
    arguments: str  # a fragment: the client joins them


class ToolCallDelta(TypedDict, total=False):
    index: int  # always there: which call the fragment belongs to
    id: str
    type: str
    function: FunctionDelta


class Delta(TypedDict, total=False):
    """One chunk's `delta`: content, or a piece of the tool calls."""

    content: str
    tool_calls: list[ToolCallDelta]


@dataclass
class SentCall:
    """A call whose first delta went out: its arguments grow as their fragments are sent."""

    id: str
    name: str
    arguments: str


class ToolStream:
    """One choice's text in, its deltas out (`feed`, then `finish`): Hermes' form."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.pending = tools.forced or ""  # read, not yet sent or dropped: a forced call's opening first
        self.generated = ""  # the model's text, all of it
        self.content_sent = 0  # how much of `generated` went out as content
        self.state = "content"  # content | head | arguments | closing | block | done
        self.calls: list[SentCall] = []
        self.braces = Braces()
        self.malformed: str | None = None

    def feed(self, text: str) -> list[Delta]:
        self.generated += text
        self.pending += text
        deltas: list[Delta] = []
        while self.pending and self._step(deltas):
            pass
        return deltas

    def _step(self, deltas: list[Delta]) -> bool:
        """One move of the reader over `pending`; False when it needs more text."""
        pending = self.pending
        if self.state == "content":
            at = pending.find(OPEN)
            if at < 0:
                keep = len(pending) - _held_back(pending)
                if not self.calls:  # text after a call is not content (nor is it in the whole answer)
                    sent = len(pending[:keep].rstrip())  # whitespace before a call is stripped: held until known
                    self._content(pending[:sent], deltas)
                    keep = sent
                self.pending = pending[keep:]
                return False
            if not self.calls:
                self._content(pending[:at].rstrip(), deltas)
            self.pending, self.state = pending[at + len(OPEN):], "head"
            return True
        if self.state == "head":
            match = HEAD.match(pending)
            if match is None or match.group(1) not in self.tools.names:
                if CLOSE in pending or (match is not None):
                    self.state = "block"
                    return True
                return False
            self._named(match.group(1), pending[match.end():], deltas)
            return True
        if self.state == "arguments":
            if self._arguments(deltas):
                self.state = "closing"
                return True
            return False
        if self.state in ("closing", "block"):
            at = pending.find(CLOSE)
            if at < 0:
                return False
            if self.state == "block":
                self._whole_block(pending[:at], deltas)
            self.pending = pending[at + len(CLOSE):]
            self.state = "content" if self.tools.parallel else "done"
            return True
        self.pending = ""  # done: one call asked for, the rest dropped
        return False

    def _named(self, name: str, rest: str, deltas: list[Delta]) -> None:
        """A call whose name is read: its first delta, then its arguments from `rest` on."""
        call = SentCall(f"call_{uuid.uuid4().hex[:24]}", name, "")
        self.calls.append(call)
        deltas.append(self._call_delta(call, ""))
        self.pending, self.state, self.braces = rest, "arguments", Braces()

    def _arguments(self, deltas: list[Delta]) -> bool:
        """The pending part of the last call's arguments sent; True once their JSON value closed."""
        end = self.braces.scan(self.pending)
        part = self.pending if end is None else self.pending[:end]
        if part:
            self.calls[-1].arguments += part
            deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": part}}]})
        self.pending = "" if end is None else self.pending[end:]
        return end is not None

    def _whole_block(self, body: str, deltas: list[Delta]) -> None:
        """A block the head did not read (arguments first, an unknown name, not JSON): whole, if it is a call."""
        try:
            parsed = tool_parsers._call(json.loads(body.strip()), self.tools.names)
        except (ValueError, tool_parsers.NotACall) as why:
            self.malformed = f"a call that is not valid was left out: {why}"
            return
        call = SentCall(parsed.id, parsed.name, parsed.arguments)
        self.calls.append(call)
        deltas.append(self._call_delta(call, parsed.arguments))

    def _content(self, text: str, deltas: list[Delta]) -> None:
        if text:
            self.content_sent += len(text)
            deltas.append({"content": text})

    def _call_delta(self, call: SentCall, arguments: str) -> Delta:
        return {"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": arguments}}]}

    def _flush(self, deltas: list[Delta]) -> None:
        """At the end, what a form reads only once it knows nothing follows (Hermes: nothing)."""

    def _late_content(self) -> str | None:
        """Content a form sends after its calls, at the end (Hermes: none, its content went first)."""
        return None

    def finish(self, finish_reason: str) -> tuple[list[Delta], str, dict[str, str]]:
        """The deltas left, the finish reason, and the choice's `tool_parse_error` if any."""
        deltas: list[Delta] = []
        self._flush(deltas)
        if not self.calls:  # nothing streamed as a call: the whole answer's reading, the content not yet sent
            body, finish, said = tool_answers.message(self.generated, finish_reason, self.tools)
            content, calls = body.get("content"), body.get("tool_calls")
            held = content[self.content_sent:] if isinstance(content, str) else ""
            deltas += [{"content": held}] if held and not calls else []
            for index, wire in enumerate(as_object(c, "tool_calls") for c in (calls if isinstance(calls, list) else [])):
                function = get_object(wire, "function")  # as ParsedCall.wire wrote it
                deltas.append({"tool_calls": [{"index": index, "id": get_str(wire, "id"), "type": get_str(wire, "type"),
                                               "function": {"name": get_str(function, "name"),
                                                            "arguments": get_str(function, "arguments")}}]})
            return deltas, finish, said
        late = self._late_content()
        if late:
            deltas.append({"content": late})
        if self.state == "arguments":
            self.malformed = "the call's arguments were cut short"
        elif self.state in ("head", "block") and self.pending.strip():
            self.malformed = "a call was cut short and left out"
        for call in self.calls:
            try:
                ok = isinstance(json.loads(call.arguments), dict)
            except ValueError:
                ok = False
            if not ok and self.malformed is None:
                self.malformed = f"the arguments of {call.name!r} are not a JSON object"
        said = {"tool_parse_error": self.malformed} if self.malformed else {}
        return deltas, "tool_calls" if finish_reason == "stop" else finish_reason, said
