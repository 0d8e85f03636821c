"""The streamed tool-call readers of the other template families (app/openai/tool_stream.py has the common part and
Hermes'), and the pick of a reader per family. Each sends a call's name first, then its arguments as sampled:

- `llama3_json`: the answer is calls (`{"name": …, "parameters": {…}}`, after an optional `<|python_tag|>`, several
  separated by `;`) or it is text. Its first character says which: text streams as content from there; an object's
  name, once read, opens a call whose `parameters` stream. An object the head cannot read (its name last, an unknown
  name) goes whole once it closes, or, with no call sent yet, the answer goes at the end as the whole answer reads it.
- `gpt_oss` (harmony): each `commentary to=functions.NAME … {…}` streams its name, then its JSON arguments; what is
  not a call is held, and the final channel's message goes as content at the end (as the whole answer reads it).

As for Hermes, a call once named stands: what turns out wrong after it is said in the finish's `tool_parse_error`,
and nothing after a malformed call is read as one.
"""

from __future__ import annotations

import re

from app.openai import tool_parsers
from app.openai.tool_stream import HEAD, Braces, Delta, SentCall, ToolStream
from app.openai.tools import Tools

PYTHON_TAG = "<|python_tag|>"


class LlamaStream(ToolStream):
    """Llama 3.1's JSON calls."""

    def __init__(self, tools: Tools) -> None:
        super().__init__(tools)
        self.state = "start"  # start | text | head | arguments | closing | between | held

    def _step(self, deltas: list[Delta]) -> bool:
        pending = self.pending
        if self.state == "start":  # calls or text: the first character after the optional tag says
            body = pending.lstrip()
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):].lstrip()
            elif PYTHON_TAG.startswith(body):
                return False  # the tag's beginning, or only whitespace yet
            if not body:
                return False
            self.pending, self.state = body, "head" if body[0] == "{" else "text"
            return True
        if self.state == "text":  # the whole answer is content, as the whole answer reads it
            self._content(self.generated[self.content_sent:], deltas)
            self.pending = ""
            return False
        if self.state == "head":
            match = HEAD.match(pending)
            if match is not None and match.group(1) in self.tools.names:
                self._named(match.group(1), pending[match.end():], deltas)
                return True
            end = Braces().scan(pending)
            if end is None:
                return False  # the object is still open: its name may come yet
            self._whole_block(pending[:end], deltas)
            self.pending, self.state = pending[end:], "held" if self.malformed else "between"
            return True
        if self.state == "arguments":
            if self._arguments(deltas):
                self.state, self.braces = "closing", Braces(depth=1)  # inside the call's own object
                return True
            return False
        if self.state == "closing":
            end = self.braces.scan(pending)
            self.pending = "" if end is None else pending[end:]
            if end is not None:
                self.state = "between"
            return end is not None
        if self.state == "between":
            rest = pending.lstrip(" \t\r\n;")
            if not rest:
                self.pending = ""
                return False
            if rest[0] != "{":
                self.malformed = "text after the calls was left out"
            self.pending, self.state = rest, "head" if rest[0] == "{" and self.tools.parallel else "held"
            return True
        self.pending = ""  # held: nothing more is read as a call
        return False


HARMONY_MARK = "commentary to=functions."
HARMONY_HEAD = re.compile(r"([\w.\-]+)\s*(?:<\|constrain\|>)?\s*(?:json)?\s*(?:<\|message\|>)?\s*(?=\{)")
HARMONY_ENDS = re.compile(r"<\|call\|>|<\|end\|>|<\|start\|>|commentary to=functions\.")


class HarmonyStream(ToolStream):
    """GPT-OSS's harmony calls."""

    def _step(self, deltas: list[Delta]) -> bool:
        pending = self.pending
        if self.state == "content":  # not sent: only the final channel is content, read at the end
            at = pending.find(HARMONY_MARK)
            if at < 0:
                self.pending = pending[-(len(HARMONY_MARK) - 1):]  # may be the mark's beginning
                return False
            self.pending, self.state = pending[at + len(HARMONY_MARK):], "head"
            return True
        if self.state == "head":
            match = HARMONY_HEAD.match(pending)
            if match is not None and match.group(1) in self.tools.names:
                self._named(match.group(1), pending[match.end():], deltas)
                return True
            end = HARMONY_ENDS.search(pending)
            if end is None:
                return False  # its name or its arguments' opening may come yet
            self._harmony_block(pending[:end.start()], deltas)
            self.pending = pending[end.start():]
            return True
        if self.state == "arguments":
            if self._arguments(deltas):
                self.state = "content" if self.tools.parallel else "held"
                return True
            return False
        self.pending = ""  # held: nothing more is read as a call
        return False

    def _harmony_block(self, body: str, deltas: list[Delta]) -> None:
        """A call the head did not read (an unknown name, arguments not an object): whole, if the parser reads it."""
        try:
            parsed = tool_parsers.gpt_oss(HARMONY_MARK + body, self.tools.names)
        except tool_parsers.NotACall as why:
            self.malformed = f"a call that is not valid was left out: {why}"
        else:
            for found in parsed.calls:
                call = SentCall(found.id, found.name, found.arguments)
                self.calls.append(call)
                deltas.append(self._call_delta(call, found.arguments))
        self.state = "held" if self.malformed else "content" if self.tools.parallel else "held"

    def _flush(self, deltas: list[Delta]) -> None:
        if self.state == "head" and self.pending.strip():  # the end closes a call as <|call|> would
            self._harmony_block(self.pending, deltas)
            self.pending = ""

    def _late_content(self) -> str | None:
        final = tool_parsers.GPT_OSS_FINAL.search(self.generated)
        return final.group(1).strip() if final else None


READERS: dict[str, type[ToolStream]] = {"hermes": ToolStream, "llama3_json": LlamaStream, "gpt_oss": HarmonyStream}


def streams(tools: Tools) -> bool:
    """Whether a streamed answer with these tools goes out as it is sampled: no tools, or a family with a reader."""
    return not tools.parsing or (tools.family or tool_parsers.DEFAULT_FAMILY) in READERS


def reader(tools: Tools) -> ToolStream:
    """One choice's reader for the family the base's template teaches."""
    return READERS[tools.family or tool_parsers.DEFAULT_FAMILY](tools)
