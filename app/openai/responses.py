"""`POST /v1/responses`: OpenAI's Responses API over the chat pipeline, enough for the OpenAI Agents SDK's default
path. Input items (messages, function calls, their outputs), `instructions`, function `tools` and `tool_choice`
become one chat request (rendered by the base's template, calls parsed as on chat: app/openai/tool_answers.py); its
answer becomes output items (`message`, `function_call`), whole or as the Responses stream's events.

`previous_response_id` continues a stored conversation: each answered response is kept for its user in the database
(app/services/stored_responses.py: bounded per user, expiring, deleted with its run); instructions are not carried
over, as on OpenAI. Signal's extras: `prompt_token_ids` (the whole rendered history the model saw) and
`output_token_ids` on the response, for training on exactly what was sampled; the stored answer keeps both, so a
continuation's prompt starts with exactly those ids (app/openai/params.py's carried token ids).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from starlette.responses import JSONResponse, Response, StreamingResponse

from app.openai import tool_answers
from app.openai.errors import OpenAIError, bad
from app.services.stored_responses import StoredResponses
from app.tables import User
from gpu_runtime.contract.json_types import (
    JSON,
    JSONObject,
    as_json_object,
    as_object,
    get_int,
    get_list,
    get_object,
    get_str,
    opt_str,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
IGNORED = {"include", "truncation", "reasoning", "metadata", "user", "store", "background", "service_tier",
           "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "context_management"}
PASSED = {"model", "temperature", "top_p", "parallel_tool_calls", "seed", "stop", "top_logprobs"}

ChatAnswer = Callable[[JSONObject], Awaitable[JSONObject]]  # a chat completion's body in, its answer out
RunOf = Callable[[str], Awaitable[str | None]]  # a model's run id (None: a base model alone)


def _text(content: object, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad(param, f"{param} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise bad(f"{param}[{j}]", f"{param}[{j}]: only text parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def messages_of(items: object) -> list[JSONObject]:
    """Input items as chat messages: consecutive function calls join the assistant turn before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad("input", "input must be a string or a list of items")
    out: list[JSONObject] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise bad(f"{param}.role", f"{param}.role must be user, system, developer or assistant")
            out.append({"role": item["role"], "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call: JSONObject = {"id": str(item.get("call_id") or ""), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [*tool_answers.calls_of(out[-1]), call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, f"{param}.output")})
        elif kind != "reasoning":  # a reasoning item carries nothing a template renders here
            raise bad(param, f"{param}: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output)")
    return out


def _tools(tools: object) -> list[JSONObject] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list")
    out: list[JSONObject] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"tools[{i}]", f"tools[{i}]: only function tools are supported, not {kind!r}")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                                      if tool.get(k) is not None}})
    return out


def chat_body(body: JSONObject, history: list[JSONObject]) -> tuple[JSONObject, list[JSONObject]]:
    """A Responses request as a chat completion's body (with return_token_ids), and its messages."""
    for name in ("prompt", "conversation"):
        if body.get(name) is not None:
            raise bad(name, f"{name} is not supported: give input (and previous_response_id)")
    text = body.get("text")
    form = (text.get("format") if isinstance(text, Mapping) else None) or {"type": "text"}
    if text is not None and (not isinstance(text, Mapping) or not isinstance(form, Mapping) or form.get("type")
                             != "text"):
        raise bad("text", "text.format must be {'type': 'text'}: structured output is not supported")
    unknown = set(body) - IGNORED - PASSED - {"input", "instructions", "tools", "tool_choice", "max_output_tokens",
                                              "previous_response_id", "stream", "text"}
    if unknown:
        name = sorted(unknown)[0]
        raise bad(name, f"{name} is not supported on /v1/responses")
    messages = list(history) + messages_of(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("instructions", "instructions must be a string")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: JSONObject = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat.update(messages=messages, return_token_ids=True, tools=_tools(body.get("tools")))
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = body["tool_choice"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat, messages


def _choice(answer: Mapping[str, object]) -> JSONObject:
    """A chat answer's one choice (the Responses API asks for one)."""
    return as_json_object(get_list(answer, "choices")[0], "choices[0]")


def _renamed(error: OpenAIError) -> OpenAIError:
    """A chat parameter as the Responses request's: messages → input, max_tokens → max_output_tokens."""
    if error.param and error.param.startswith("messages"):
        error.param = "input"
    elif error.param == "max_tokens":
        error.param = "max_output_tokens"
    return error


def output_items(message: Mapping[str, object]) -> list[JSONObject]:
    items: list[JSONObject] = []
    content = opt_str(message, "content")
    if content:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": content, "annotations": [], "logprobs": []}]})
    for call in tool_answers.calls_of(message):
        function = get_object(call, "function")
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": get_str(function, "name"), "arguments": get_str(function, "arguments"),
                      "status": "completed"})
    return items


def response_of(body: JSONObject, chat: JSONObject, answer: JSONObject) -> JSONObject:
    choice = _choice(answer)
    usage = get_object(answer, "usage")
    incomplete = choice["finish_reason"] == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": answer["created"],
        "status": "incomplete" if incomplete else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": answer["model"], "output": output_items(get_object(choice, "message")),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "temperature": chat.get("temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": chat.get("top_p", 1.0), "truncation": "disabled", "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}}, "store": True,
        "usage": {"input_tokens": get_int(usage, "prompt_tokens"), "input_tokens_details": {
                      "cached_tokens": get_int(get_object(usage, "prompt_tokens_details"), "cached_tokens")},
                  "output_tokens": get_int(usage, "completion_tokens"),
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": get_int(usage, "total_tokens")},
        "prompt_token_ids": answer.get("prompt_token_ids"), "output_token_ids": choice.get("token_ids"),
        **({"tool_parse_error": choice["tool_parse_error"]} if "tool_parse_error" in choice else {}),
    }


async def create(user: User, raw: object, store: StoredResponses, chat_answer: ChatAnswer, run_of: RunOf) -> Response:
    history: list[JSONObject] = []
    if not isinstance(raw, dict):
        raise bad("body", "the request body must be a JSON object")
    body = as_json_object(raw, "body")
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = await store.get(user, previous) if isinstance(previous, str) else None
        if stored is None:
            raise OpenAIError(404, f"no stored response {previous!r} (unknown, expired or another user's)",
                              param="previous_response_id", code="previous_response_not_found")
        history = stored
    chat, messages = chat_body(body, history)
    try:
        answer = await chat_answer(chat)
    except OpenAIError as error:
        raise _renamed(error) from None
    response = response_of(body, chat, answer)
    choice = _choice(answer)
    message = get_object(choice, "message")
    # The ids the model saw and wrote: the continuation's prompt starts with them (no re-rendering drift).
    turn: JSONObject = {"role": "assistant", "content": opt_str(message, "content"), "prompt_token_ids": answer["prompt_token_ids"],
            "token_ids": choice["token_ids"]}
    if message.get("tool_calls"):
        turn["tool_calls"] = tool_answers.calls_of(message)
    kept = messages if body.get("instructions") is None else messages[1:]
    await store.keep(user, str(response["id"]), await run_of(str(chat.get("model"))), kept + [turn])
    if not body.get("stream"):
        return JSONResponse(response)
    return StreamingResponse(events(response), media_type="text/event-stream", headers=SSE_HEADERS)


async def events(response: JSONObject) -> AsyncIterator[str]:
    """The whole response as the Responses stream's events (sampled first: the events follow each other at once)."""
    sequence = 0

    def event(kind: str, **fields: JSON) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **fields})}\n\n"

    opening: JSONObject = {**response, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    for index, item in enumerate([as_json_object(o, "output") for o in get_list(response, "output")]):
        ident = item["id"]
        if item["type"] == "message":
            text = get_str(as_object(get_list(item, "content")[0], "content[0]"), "text")
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            part: JSONObject = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=ident, output_index=index, content_index=0, part=part)
            yield event("response.output_text.delta", item_id=ident, output_index=index, content_index=0, delta=text,
                        logprobs=[])
            yield event("response.output_text.done", item_id=ident, output_index=index, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=ident, output_index=index, content_index=0,
                        part={**part, "text": text})
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=ident, output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=ident, output_index=index,
                        arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                response=response)
