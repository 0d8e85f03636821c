"""A chat choice's message with its tool calls read out of the text (app/openai/tool_parsers.py), in OpenAI's shapes:
the whole message, and its stream delta (every call in one delta, each with its index, as OpenAI's clients merge)."""

from __future__ import annotations

from collections.abc import Mapping

from app.openai import tool_parsers
from app.openai.params import CompletionRequest
from app.openai.tools import Tools
from app.services.runs import RunService
from app.tables import Run
from gpu_runtime.contract.json_types import JSONObject, as_json_object, opt_str


def message(text: str, finish_reason: str, tools: Tools) -> tuple[JSONObject, str, dict[str, str]]:
    """The assistant message, the finish reason ("tool_calls" when it calls), and the choice's `tool_parse_error`
    when text that looked like a call stayed text (it is said, never a 5xx)."""
    if not tools.parsing:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason, {}
    family = tools.family or tool_parsers.DEFAULT_FAMILY
    if tools.forced is not None:
        parsed = tool_parsers.forced(family, tools.forced, text, tools.names, tools.named)
    else:
        parsed = tool_parsers.parse(family, text, tools.names, tools.parallel)
    body: JSONObject = {"role": "assistant", "content": parsed.content, "refusal": None}
    said = {"tool_parse_error": parsed.malformed} if parsed.malformed else {}
    if not parsed.calls:
        return body, finish_reason, said
    body["tool_calls"] = [call.wire() for call in parsed.calls[:None if tools.parallel else 1]]
    return body, "tool_calls", said


def calls_of(body: Mapping[str, object]) -> list[JSONObject]:
    """A message's tool calls as `message` wrote them, each a JSON object."""
    calls = body.get("tool_calls")
    return [as_json_object(call, "tool_calls") for call in calls] if isinstance(calls, list) else []


def delta(body: Mapping[str, object]) -> JSONObject:
    """A whole message as one stream delta after the role's."""
    out: JSONObject = {"content": opt_str(body, "content")}
    if body.get("tool_calls"):
        out["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls_of(body))]
    return out


async def forced_opening(runs: RunService, run: Run | None, params: CompletionRequest, base_model: str | None
                         ) -> str | None:
    """With tool definitions, the call format the base's template teaches (`tools.family`: the stream's reader and the
    answer's parser pick on it; kept per base by RunSampling.tool_format, so only a base's first such request
    renders apart from its sample), and a forced call's opening in it, which the prompt ends with."""
    tools: Tools = params.tools
    if not tools.definitions:
        return None
    tools.family = await runs.tool_format(run, base_model, params.messages or [], tools.definitions, params.history)
    if tools.choice in ("named", "required"):
        tools.forced = tools.head(tools.family)
    return tools.forced
