"""/v1's server-sent events: a stream fed by the runtime's decode chunks, or (logprobs or echo asked) the whole
answer as events. Once a stream has started, an error goes in it as `data: {"error": …}`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from app.errors import SignalError, Unauthenticated
from app.openai import tool_answers, tool_stream_forms
from app.openai.errors import as_openai, from_signal
from app.openai.generation import Sampling
from app.openai.tool_stream import Delta
from app.rechecked import rechecked
from app.services.runs import SampleParams
from app.services.streams import first_or_gone, hold, next_chunk
from gpu_runtime.contract import SampleChunk
from gpu_runtime.contract.json_types import JSONObject, as_json_object, get_list, get_object

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def whole(body: JSONObject, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The whole answer as events (a stream asking for logprobs or echo): per choice its content in one chunk, then its
    finish; usage last when asked."""
    head: JSONObject = {key: body[key] for key in ("id", "created", "model")}
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra: JSONObject = {"usage": None} if include_usage else {}
    try:
        for choice in [as_json_object(item, "choices") for item in get_list(body, "choices")]:
            index = choice["index"]
            if chat:
                parts: list[JSONObject] = [
                    {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None},
                    {"index": index, "delta": tool_answers.delta(get_object(choice, "message")),
                     "logprobs": choice["logprobs"], "finish_reason": None},
                    {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]
                if "token_ids" in choice:
                    parts[1]["token_ids"] = choice["token_ids"]
            else:
                parts = [{**choice, "finish_reason": None},
                         {"index": index, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}]
            for part in parts:
                chunk: JSONObject = {**head, "object": kind, "choices": [part], **extra}
                if chat and "prompt_token_ids" in body and part is parts[0]:
                    chunk["prompt_token_ids"] = body["prompt_token_ids"]
                yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': body['usage']})}\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        yield f"data: {json.dumps(as_openai(exc).body())}\n\n"
    yield "data: [DONE]\n\n"


async def streamed(call: Sampling, sample: SampleParams, request: Request, recheck_s: float,
                   check: Callable[[], Awaitable[object]]) -> Response:
    """A stream fed by the runtime's decode chunks. Errors met before its first chunk are answered as errors; the
    sample is recorded whatever the client does, and cancelled in the runtime when the client goes away, before its
    first chunk too (then, not begun, it is withdrawn: never applied, not billed, not recorded). Its key is checked
    again every `recheck_s` (SIGNAL_SESSION_RECHECK_S), as a GraphQL subscription's: revoked, the stream ends with an
    error event and its sample is stopped."""
    chunks: asyncio.Queue[SampleChunk] = asyncio.Queue()
    request_id = f"v1-{uuid.uuid4().hex}"
    task = hold(call.sample(sample, request_id, chunks.put_nowait))
    try:
        came, first = await first_or_gone(task, chunks, request.receive)
    except SignalError as error:
        raise from_signal(error, call.prompt_param) from None
    if not came:
        hold(call.cancel(request_id))
        return Response(status_code=499)  # nginx's "client closed request": no one reads it
    return event_stream(_until_revoked(_chunk_events(call, task, chunks, request_id, first), recheck_s, check))


async def _until_revoked(events: AsyncIterator[str], recheck_s: float,
                         check: Callable[[], Awaitable[object]]) -> AsyncIterator[str]:
    """`events` while `check` passes (app/rechecked.py); once it raises, the events are closed (their sample cancelled)
    and the stream ends with the error as an event, then [DONE]."""
    try:
        async for event in rechecked(events, recheck_s, check):
            yield event
    except Unauthenticated as exc:
        yield f"data: {json.dumps(as_openai(exc).body())}\n\n"
        yield "data: [DONE]\n\n"


async def _chunk_events(call: Sampling, task: asyncio.Future[Any], chunks: asyncio.Queue[SampleChunk],
                        request_id: str, first: SampleChunk | None) -> AsyncIterator[str]:
    """Each decode chunk's settled text (and ids, with return_token_ids) as it comes, tool calls as their deltas
    (app/openai/tool_stream.py); then per choice the rest of its answer and its finish, usage when asked, [DONE]. A
    client gone mid-stream cancels the sample within one chunk."""
    params, chat = call.params, call.chat
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": ident, "created": int(time.time()), "model": params.model,
            "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if params.include_usage else {}
    # a chat's prompt ids came with its first chunk (or, with none, its result): the runtime rendered them
    prompt_ids = call.rendered(first.prompt_tokens if first is not None else task.result().prompt_tokens)
    count = len(prompt_ids) * params.n
    sent_text, sent_ids = [0] * count, [0] * count

    readers = [tool_stream_forms.reader(params.tools) if chat and params.tools.parsing else None for _ in range(count)]

    def event(index: int, text: str, ids: list[int] | None, finish: str | None = None, opening: bool = False,
              delta: Delta | None = None, said: dict[str, str] | None = None) -> str:
        part: JSONObject = {"index": index, "logprobs": None, "finish_reason": finish, **(said or {})}
        if chat:
            # a Delta is JSON by its fields' types; mypy sees a TypedDict only as a Mapping[str, object]
            part["delta"] = (cast(JSONObject, delta) if delta is not None else {"role": "assistant", "content": ""} if opening
                             else {"content": text} if text or ids else {})
        else:
            part["text"] = text
        if params.return_token_ids and ids is not None:
            part["token_ids"] = ids
            if opening and not chat:
                part["prompt_token_ids"] = prompt_ids[index // params.n]
        chunk = {**head, "choices": [part], **extra}
        if opening and chat and params.return_token_ids:
            chunk["prompt_token_ids"] = prompt_ids[0]
        return f"data: {json.dumps(chunk)}\n\n"

    def text_events(index: int, text: str, ids: list[int]) -> Iterator[str]:
        """A piece of one choice's answer: its text as content, or through its tool-call reader (ids with the first
        delta, or alone)."""
        reader = readers[index]
        if reader is None:
            if text or ids:
                yield event(index, text, ids)
            return
        deltas = reader.feed(text)
        for k, delta in enumerate(deltas):
            yield event(index, "", ids if k == 0 else None, delta=delta)
        if not deltas and ids and params.return_token_ids:
            yield event(index, "", ids, delta={})

    try:
        if chat or params.return_token_ids:
            for index in range(count):
                yield event(index, "", [], opening=True)
        chunk = first
        while chunk is not None:
            for p, sequences in enumerate(chunk.sequences):
                for j, sequence in enumerate(sequences):
                    index = p * params.n + j
                    sent_text[index] += len(sequence["text"])
                    sent_ids[index] += len(sequence["tokens"])
                    for out in text_events(index, sequence["text"], sequence["tokens"]):
                        yield out
            chunk = await next_chunk(task, chunks)
        body, picked = await call.answer(task.result())
        for choice in picked:  # what no chunk sent: the end held back, a finished sequence's last tokens
            text, ids = choice.text[sent_text[choice.index]:], choice.ids[sent_ids[choice.index]:]
            for out in text_events(choice.index, text, ids):
                yield out
            reader = readers[choice.index]
            if reader is None:
                yield event(choice.index, "", None, finish=choice.finish_reason)
                continue
            deltas, finish, said = reader.finish(choice.finish_reason)
            for delta in deltas:
                yield event(choice.index, "", None, delta=delta)
            yield event(choice.index, "", None, finish=finish, delta={}, said=said)
        if params.include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': body['usage']})}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        yield f"data: {json.dumps(as_openai(exc, call.prompt_param).body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not task.done():  # the client went away (or the stream failed): stop the generation, keep what it made
            hold(call.cancel(request_id))
