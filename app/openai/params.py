"""A /v1 request body checked into what one `sample` needs. Every refusal is a 400 naming the parameter.

Parameters are refused only when their value asks for something Signal does not do (a response format, penalties,
logit bias; tools are chat's, app/openai/tools.py); null values, `user` and `metadata` are accepted and change nothing. `store` says whether the
request is kept in the sample history (omitted or true: kept; false: not, for rollouts nobody will read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeGuard

from app.openai import tools as tooling
from app.openai.errors import bad
from gpu_runtime.contract import (
    MAX_SAMPLES,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOPK_LOGPROBS,
)
from gpu_runtime.contract.json_types import JSONObject

MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API's bound
MAX_CARRIED_TOKENS = 1 << 20  # an assistant turn's carried ids: beyond any context (the context bound refuses sooner)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class CompletionRequest:
    """One /v1 completion or chat request, checked. `prompts` or `messages` is set (not both)."""

    model: str
    chat: bool
    prompts: list[str] | list[list[int]] | None = None
    messages: list[JSONObject] | None = None
    tools: tooling.Tools = field(default_factory=tooling.Tools)  # chat's tools, tool_choice, parallel_tool_calls
    history: tuple[list[int], int] | None = None  # an assistant turn's carried ids and its index (_carried)
    max_tokens: int | None = None  # None: the room left in the context, up to MAX_TOKENS_LIMIT
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None  # completions: 0..5; chat: top_logprobs when logprobs is true
    echo: bool = False
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    store: bool = True  # kept in the sample history (the run's, or the user's for a base model)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: Mapping[str, object], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(name, f"{name} must be a number in {low}..{high}, got {value!r}")
    return float(value)


def _int(body: Mapping[str, object], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise bad(name, f"{name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


def _bool(body: Mapping[str, object], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {value!r}")
    return value


def _refusals(body: Mapping[str, object], chat: bool) -> None:
    """What Signal does not do, refused by name; the same parameters at their neutral values pass."""
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if not chat and body.get(name) not in (None, "none", []):
            raise bad(name, f"{name} is for chat completions (/v1/chat/completions)")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise bad("response_format", "response_format must be {'type': 'text'} or omitted: structured output is "
                                     "not supported")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise bad(name, f"{name} must be 0 or omitted: penalties are not supported")
    if body.get("logit_bias"):
        raise bad("logit_bias", "logit_bias must be empty or omitted: it is not supported")
    if body.get("suffix"):
        raise bad("suffix", "suffix is not supported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise bad("best_of", "best_of is not supported (leave it out, or equal to n)")


def _stop(body: Mapping[str, object]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
    return stops


def _prompts(prompt: object) -> list[str] | list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        strings = [p for p in prompt if isinstance(p, str)]
        if len(strings) == len(prompt):
            return strings
        ids = [t for t in prompt if _is_int(t) and t >= 0]
        if len(ids) == len(prompt):
            return [ids]
        if all(isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                        "none empty")


def _content(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}]: only text parts are supported"
                      + (f", not {kind!r}" if kind else ""))
        texts.append(part["text"])
    return "".join(texts)


def _ids(value: object, param: str) -> list[int]:
    if (not isinstance(value, list) or not value or len(value) > MAX_CARRIED_TOKENS
            or not all(_is_int(t) and t >= 0 for t in value)):
        raise bad(param, f"{param} must be a non-empty list of at most {MAX_CARRIED_TOKENS} token ids")
    return list(value)


def _carried(message: Mapping[str, object], i: int) -> list[int] | None:
    """An assistant message's ids as sampled, Signal's extension: the earlier answer's `prompt_token_ids` and its
    choice's `token_ids`, copied onto the message. The prompt then starts with them, not with that turn re-rendered
    from its text (the runtime's render_messages; where the messages before it render otherwise, it is re-rendered)."""
    prompt, completion = message.get("prompt_token_ids"), message.get("token_ids")
    if prompt is None and completion is None:
        return None
    if prompt is None or completion is None:
        missing = "prompt_token_ids" if prompt is None else "token_ids"
        raise bad(f"messages[{i}].{missing}", f"messages[{i}] carries token ids: give both prompt_token_ids and "
                                              "token_ids, as the earlier answer returned them")
    return _ids(prompt, f"messages[{i}].prompt_token_ids") + _ids(completion, f"messages[{i}].token_ids")


def _messages(messages: object) -> tuple[list[JSONObject], tuple[list[int], int] | None]:
    """The messages as the template takes them, and the last assistant turn's carried ids with its index."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    tooling.check_history(messages)
    rendered: list[JSONObject] = []
    call_names: dict[str, str] = {}  # a tool call's id: its function, for the tool message answering it
    history: tuple[list[int], int] | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role == "tool":
            rendered.append(tooling.tool_message(message, _content(message.get("content"), i), i, call_names))
            continue
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {sorted(ROLES)} or 'tool', "
                                             f"got {role!r}")
        if message.get("function_call"):
            raise bad(f"messages[{i}].function_call", f"messages[{i}]: function_call is deprecated: use tool_calls")
        item: JSONObject = {"role": ROLES[role], "content": _content(message.get("content"), i)}
        if role == "assistant" and message.get("tool_calls"):
            calls = tooling.assistant_calls(message["tool_calls"], i)
            item["tool_calls"] = calls
            call_names.update({str(c["id"]): tooling.function_name(c) for c in calls})
        carried = _carried(message, i) if role == "assistant" else None
        if carried is not None:
            history = (carried, i)
        rendered.append(item)
    return rendered, history


def parse(body: object, chat: bool) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required: a run id, a snapshot or a base model (see GET /v1/models)")
    _refusals(body, chat)
    request = CompletionRequest(model=model, chat=chat)
    if chat:
        request.messages, request.history = _messages(body.get("messages"))
        request.tools = tooling.from_body(body, tooling.definitions(body.get("tools")))
        if body.get("prompt") is not None:
            raise bad("prompt", "chat completions take messages, not prompt")
    else:
        if body.get("prompt") is None:
            raise bad("prompt", "prompt is required")
        request.prompts = _prompts(body["prompt"])
    max_tokens = _int(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    max_completion = _int(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad("max_completion_tokens", "max_tokens and max_completion_tokens differ; give one")
    request.max_tokens = max_tokens if max_tokens is not None else max_completion
    request.temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    request.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if body.get("top_p") is not None and request.top_p == 0:
        raise bad("top_p", "top_p must be greater than 0")
    request.n = _int(body, "n", 1, MAX_SAMPLES) or 1
    request.stop = _stop(body)
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise bad("seed", f"seed must be an integer in 0..{MAX_SEED}, got {seed!r}")
    request.seed = seed
    if chat:
        wants = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_TOPK_LOGPROBS)
        if top and not wants:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        request.logprobs = (top or 0) if wants else None
    else:
        request.logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        request.echo = _bool(body, "echo")
    request.return_token_ids = _bool(body, "return_token_ids")
    request.store = body.get("store") is None or _bool(body, "store")
    request.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", "stream_options must be an object")
        if not request.stream:
            raise bad("stream_options", "stream_options needs stream: true")
        request.include_usage = _bool(options, "include_usage")
    return request
