"""The /v1 routes: authenticate by API key (never the session cookie), resolve `model`, render the prompt in the
runtime, sample through RunService.sample (billed like any sample, and kept in the sample history on every source
unless the request says `store: false`), answer in OpenAI's shapes.

A pure ASGI app under Mount("/v1"): no BaseHTTPMiddleware, which would buffer the event stream and break
Starlette's disconnect detection.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from app.backends import Progress
from app.errors import SignalError
from app.openai import answers
from app.openai.errors import OpenAIError, bad, from_signal, model_not_found
from app.openai.params import parse
from app.schema.context import bearer_from_header
from app.services import Services
from app.services.runs import RunService, SampleParams
from app.services.streams import first_or_gone, gone, hold, next_chunk
from app.tables import Run, User
from app.tinker import paths as tinker_paths
from gpu_runtime.contract import MAX_TOKENS_LIMIT, SampleChunk, SampleResult

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]  # set by the outer app's lifespan


async def _user(request: Request) -> User:
    return await _services(request).keys.authenticate(bearer_from_header(request.headers.get("authorization")))


@dataclass(frozen=True)
class Target:
    """What `model` names: a run's current weights, a sampler snapshot of it (`{run_id}@{name}`), or a catalogue
    base model alone (`run` None)."""

    name: str
    run: Run | None = None
    snapshot: str | None = None
    base_model: str | None = None


async def _run(services: Services, user: User, name: str) -> Target:
    if name.startswith("tinker://"):
        run_id, snapshot = await _tinker_path(services, user, name)
    elif any(model.name == name for model in services.catalog.list()):
        return Target(name, base_model=name)
    else:
        run_id, _, snapshot = name.partition("@")
    try:
        run = await services.runs.get(user, run_id)  # another user's run: not found, like an unknown one
    except SignalError:
        raise model_not_found(name) from None
    if snapshot and snapshot not in {row.name for row in await services.runs.checkpoints(run) if row.mode == "sampler"}:
        raise model_not_found(name, f"run {run_id!r} has no sampler snapshot {snapshot!r}: make one with "
                                    "save_weights_for_sampler")
    return Target(name, run, snapshot or None)


async def _tinker_path(services: Services, user: User, name: str) -> tuple[str, str]:
    """`tinker://{model_id}/sampler_weights/{name}` (what Tinker's save_weights_for_sampler returns): the Tinker
    model's run and the snapshot's name, the snapshot `{run_id}@{name}` names. Another user's model is not found."""
    try:
        path = tinker_paths.parse(name, "model")
        model = await services.tinker_sessions.model(user, path.model_id)
    except SignalError:
        raise model_not_found(name) from None
    if path.kind != "sampler_weights" or not model.run_id:
        raise model_not_found(name, f"The model {name!r} is a Tinker training checkpoint; /v1 samples sampler "
                                    "weights: tinker://{model_id}/sampler_weights/{name} (save_weights_for_sampler)")
    return model.run_id, path.name


def _model(target: Target, created: int = 0) -> dict[str, Any]:
    run = target.run
    root = run.base_model if run is not None else target.base_model
    return {"id": target.name, "object": "model", "created": int(run.created_at.timestamp()) if run else created,
            "owned_by": "user" if run is not None else "signal", "root": root}


async def list_models(request: Request) -> Response:
    """The caller's runs and their sampler snapshots (as `{run_id}@{name}`, and as `tinker://` paths for a run a
    Tinker model drives), and the catalogue's models this server can load."""
    user = await _user(request)
    services = _services(request)
    tinker_models, _ = await services.tinker_sessions.models(user, limit=1000, offset=0)
    tinker_ids = {row.run_id: row.id for row in tinker_models if row.run_id}
    data = []
    for run in await services.runs.list(user, limit=1000):
        data.append(_model(Target(run.id, run)))
        for row in await services.runs.checkpoints(run):
            if row.mode == "sampler" and row.name:
                data.append(_model(Target(f"{run.id}@{row.name}", run, row.name)))
                if run.id in tinker_ids:
                    path = tinker_paths.TinkerPath(tinker_ids[run.id], "sampler_weights", row.name).path
                    data.append(_model(Target(path, run, row.name)))
    data += [_model(Target(model.name, base_model=model.name)) for model in services.catalog.list() if model.available]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    user = await _user(request)
    return JSONResponse(_model(await _run(_services(request), user, request.path_params["model"])))


async def _body(request: Request) -> Any:
    try:
        raw = await request.body()
    except HTTPException as exc:  # the body limit, met while streaming it in
        raise _too_large(request) from exc
    try:
        return json.loads(raw)
    except ValueError:
        raise bad("body", "the request body is not valid JSON") from None


def _too_large(request: Request) -> OpenAIError:
    limit = request.app.state.settings.max_request_bytes
    return OpenAIError(413, f"the request body is over {limit} bytes", code="request_too_large")


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    user = await _user(request)
    params = parse(await _body(request), chat)
    services = _services(request)
    target = await _run(services, user, params.model)
    prompt_ids, sample, eos = await _prepared(services.runs, target, params, chat)
    call = Sampling(services.runs, user, target, params, chat, prompt_ids, eos)
    if params.stream and params.logprobs is None and not params.echo:
        return await _streamed(call, sample, request)
    leaving = hold(gone(request.receive))
    try:
        result = await call.sample_unless_gone(sample, leaving)  # its client gone first: withdrawn, unbilled
        body, _ = await call.answer(result)
    except SignalError as error:
        raise from_signal(error, call.prompt_param) from None
    finally:
        leaving.cancel()
    if not params.stream:
        return JSONResponse(body)
    # Logprobs and echo in a stream: the whole answer after the sample (their per-token text needs a decode call).
    return StreamingResponse(_events(body, chat, params.include_usage), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _prepared(runs: RunService, target: Target, params: Any, chat: bool) -> tuple[list[list[int]], SampleParams,
                                                                                  set[int]]:
    """The prompts as token ids (chat rendered with the template), the sample's parameters, and the EOS ids."""
    run, base = target.run, target.base_model
    prompt_param = "messages" if chat else "prompt"
    try:
        if chat:
            rendered = await runs.render_chat(run, messages=params.messages, base_model=base)
            prompt_ids = [rendered.prompt_tokens or []]  # messages given: never None
        elif isinstance(params.prompts[0], str):
            rendered = await runs.render_chat(run, prompts=params.prompts, base_model=base)
            prompt_ids = rendered.prompts_tokens or []  # prompts given: never None
        else:
            rendered = await runs.render_chat(run, base_model=base)
            prompt_ids = params.prompts  # token-id prompts
    except SignalError as error:
        raise from_signal(error, prompt_param) from None
    room = rendered.context_length - max(len(ids) for ids in prompt_ids)
    if room < 1:
        raise bad(prompt_param, f"the prompt is {max(len(ids) for ids in prompt_ids)} tokens; the model's context "
                                f"is {rendered.context_length}")
    sample = SampleParams(
        prompt_tokens=prompt_ids, max_tokens=params.max_tokens or min(room, MAX_TOKENS_LIMIT),
        temperature=params.temperature, top_p=params.top_p, stop=params.stop, num_samples=params.n,
        seed=params.seed, prompt_logprobs=params.echo and params.logprobs is not None,
        topk_prompt_logprobs=(params.logprobs or 0) if params.echo else 0,
        topk_sample_logprobs=params.logprobs or 0, store=params.store)
    return prompt_ids, sample, set(rendered.eos_token_ids)


@dataclass
class Sampling:
    """One /v1 request's sample and its answer in OpenAI's shape."""

    runs: RunService
    user: User
    target: Target
    params: Any  # app.openai.params.Request
    chat: bool
    prompt_ids: list[list[int]]
    eos: set[int]

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def sample(self, sample: SampleParams, request_id: str | None = None,
               progress: Progress | None = None) -> Awaitable[SampleResult]:
        run = self.target.run
        return self.runs.sample(self.user, run.id if run else None, sample, request_id=request_id,
                                snapshot=self.target.snapshot, base_model=self.target.base_model, progress=progress,
                                latest=run is not None and self.target.snapshot is None)  # no ticket: off the run's order

    def sample_unless_gone(self, sample: SampleParams, gone: asyncio.Future[None]) -> Awaitable[SampleResult]:
        """`sample` for a client that waits for the whole answer: withdrawn wherever it is if the client leaves first
        (RunService.sample_unless_gone, as a GraphQL sample)."""
        run = self.target.run
        return self.runs.sample_unless_gone(self.user, run.id if run else None, sample, gone,
                                            request_id=f"v1-{uuid.uuid4().hex}", snapshot=self.target.snapshot,
                                            base_model=self.target.base_model,
                                            latest=run is not None and self.target.snapshot is None)

    async def answer(self, result: SampleResult) -> tuple[dict[str, Any], list[answers.Choice]]:
        """The whole answer's body and its choices (with logprobs or echo, the text of every id, prompt and top-k ones
        included, from the runtime's tokenizer; else only that of sequences cut at a stop string)."""
        params, prompt_ids = self.params, self.prompt_ids
        if params.logprobs is None and not params.echo:  # per-token text only to cut a sequence at its stop string
            wanted = {t for seq in result.sequences for s in seq if answers.cut_at_stop(s, self.eos)
                      for t in s.tokens}
        else:
            wanted = {t for seq in result.sequences for s in seq for t in s.tokens}
            wanted |= {t for ids in prompt_ids for t in ids}
            for seq in result.sequences:
                for s in seq:
                    wanted |= {int(pair[0]) for top in s.topk_logprobs or [] for pair in top}
            for tops in result.topk_prompt_logprobs or []:
                wanted |= {int(pair[0]) for top in tops if top for pair in top}
        order = sorted(wanted)
        pieces: dict[int, str] = {}
        if order:  # else no round trip to the runtime for nothing
            decoded = await self.runs.render_chat(self.target.run, decode=order, base_model=self.target.base_model)
            pieces = dict(zip(order, decoded.pieces))
        picked = answers.choices(result, pieces, self.eos)
        prompt_texts = [p if isinstance(p, str) else "".join(pieces.get(t, "") for t in p) for p in
                        (params.prompts or prompt_ids)]
        usage = answers.usage(prompt_ids, picked)
        ident, created = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        head = {"id": ident, "created": created, "model": params.model}
        if self.chat:
            items = [_chat_choice(c, params, pieces) for c in picked]
            body = {**head, "object": "chat.completion", "choices": items, "usage": usage}
            if params.return_token_ids:
                body["prompt_token_ids"] = prompt_ids[0]
        else:
            items = [_completion_choice(c, params, pieces, prompt_ids, prompt_texts, result) for c in picked]
            body = {**head, "object": "text_completion", "choices": items, "usage": usage}
        return body, picked


def _chat_choice(choice: answers.Choice, params: Any, pieces: dict[int, str]) -> dict[str, Any]:
    item: dict[str, Any] = {"index": choice.index, "message": {"role": "assistant", "content": choice.text,
                                                               "refusal": None},
                            "logprobs": answers.chat_logprobs(choice, params, pieces),
                            "finish_reason": choice.finish_reason}
    if params.return_token_ids:
        item["token_ids"] = choice.ids
    return item


def _completion_choice(choice: answers.Choice, params: Any, pieces: dict[int, str], prompt_ids: list[list[int]],
                       prompt_texts: list[str], result: SampleResult) -> dict[str, Any]:
    prompt_text = prompt_texts[choice.prompt]
    item: dict[str, Any] = {
        "index": choice.index, "text": (prompt_text if params.echo else "") + choice.text,
        "logprobs": answers.completion_logprobs(choice, params, pieces, prompt_ids[choice.prompt], prompt_text,
                                                result),
        "finish_reason": choice.finish_reason}
    if params.return_token_ids:
        item["prompt_token_ids"] = prompt_ids[choice.prompt]
        item["token_ids"] = choice.ids
    return item


async def _events(body: dict[str, Any], chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The whole answer as events (a stream asking for logprobs or echo): per choice its content in one chunk, then its
    finish; usage last when asked. An error after the first event goes out as data: {"error": …}."""
    head = {key: body[key] for key in ("id", "created", "model")}
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if include_usage else {}
    try:
        for choice in body["choices"]:
            index = choice["index"]
            if chat:
                parts: list[dict[str, Any]] = [
                    {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None},
                    {"index": index, "delta": {"content": choice["message"]["content"]},
                     "logprobs": choice["logprobs"], "finish_reason": None},
                    {"index": index, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}]
                if "token_ids" in choice:
                    parts[1]["token_ids"] = choice["token_ids"]
            else:
                parts = [{**choice, "finish_reason": None},
                         {"index": index, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}]
            for part in parts:
                chunk: dict[str, Any] = {**head, "object": kind, "choices": [part], **extra}
                if chat and "prompt_token_ids" in body and part is parts[0]:
                    chunk["prompt_token_ids"] = body["prompt_token_ids"]
                yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': body['usage']})}\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        yield f"data: {json.dumps(OpenAIError(500, str(exc), kind='api_error').body())}\n\n"
    yield "data: [DONE]\n\n"


async def _streamed(call: Sampling, sample: SampleParams, request: Request) -> Response:
    """A stream fed by the runtime's decode chunks. Errors met before its first chunk are answered as errors; the
    sample is recorded whatever the client does, and cancelled in the runtime when the client goes away, before its
    first chunk too (then, not begun, it is withdrawn: never applied, not billed, not recorded)."""
    chunks: asyncio.Queue[SampleChunk] = asyncio.Queue()
    request_id = f"v1-{uuid.uuid4().hex}"
    task = hold(call.sample(sample, request_id, chunks.put_nowait))
    try:
        came, first = await first_or_gone(task, chunks, request.receive)
    except SignalError as error:
        raise from_signal(error, call.prompt_param) from None
    if not came:
        hold(call.runs.cancel_sample(call.user, request_id, call.target.run, call.target.base_model))
        return Response(status_code=499)  # nginx's "client closed request": no one reads it
    return StreamingResponse(_chunk_events(call, task, chunks, request_id, first), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _chunk_events(call: Sampling, task: asyncio.Future[Any], chunks: asyncio.Queue[SampleChunk],
                        request_id: str, first: SampleChunk | None) -> AsyncIterator[str]:
    """Each decode chunk's settled text (and ids, with return_token_ids) as it comes; then per choice the rest of its
    answer and its finish, usage when asked, [DONE]. A client gone mid-stream cancels the sample within one chunk."""
    params, chat = call.params, call.chat
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": ident, "created": int(time.time()), "model": params.model,
            "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if params.include_usage else {}
    count = len(call.prompt_ids) * params.n
    sent_text, sent_ids = [0] * count, [0] * count

    def event(index: int, text: str, ids: list[int] | None, finish: str | None = None, opening: bool = False) -> str:
        part: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": finish}
        if chat:
            part["delta"] = ({"role": "assistant", "content": ""} if opening else {"content": text} if text or ids
                             else {})
        else:
            part["text"] = text
        if params.return_token_ids and ids is not None:
            part["token_ids"] = ids
            if opening and not chat:
                part["prompt_token_ids"] = call.prompt_ids[index // params.n]
        chunk = {**head, "choices": [part], **extra}
        if opening and chat and params.return_token_ids:
            chunk["prompt_token_ids"] = call.prompt_ids[0]
        return f"data: {json.dumps(chunk)}\n\n"

    try:
        if chat or params.return_token_ids:
            for index in range(count):
                yield event(index, "", [], opening=True)
        chunk = first
        while chunk is not None:
            for p, sequences in enumerate(chunk.sequences):
                for j, sequence in enumerate(sequences):
                    index = p * params.n + j
                    if sequence["text"] or sequence["tokens"]:
                        sent_text[index] += len(sequence["text"])
                        sent_ids[index] += len(sequence["tokens"])
                        yield event(index, sequence["text"], sequence["tokens"])
            chunk = await next_chunk(task, chunks)
        body, picked = await call.answer(task.result())
        for choice in picked:  # what no chunk sent: the end held back, a finished sequence's last tokens
            text, ids = choice.text[sent_text[choice.index]:], choice.ids[sent_ids[choice.index]:]
            if text or ids:
                yield event(choice.index, text, ids)
            yield event(choice.index, "", None, finish=choice.finish_reason)
        if params.include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': body['usage']})}\n\n"
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes in it
        error = from_signal(exc, call.prompt_param) if isinstance(exc, SignalError) else \
            OpenAIError(500, str(exc), kind="api_error")
        yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not task.done():  # the client went away (or the stream failed): stop the generation, keep what it made
            hold(call.runs.cancel_sample(call.user, request_id, call.target.run, call.target.base_model))


async def not_found(request: Request) -> Response:
    return OpenAIError(404, f"Unknown request URL: {request.method} {request.url.path}. Signal serves /v1/models, "
                            "/v1/completions and /v1/chat/completions.", code="unknown_url").response()


class OpenAIBodyLimit:
    """Pure ASGI, outside Starlette's own body limit (which answers a declared Content-Length over it as text): on
    /v1/, that 413 in OpenAI's shape. A body that grows past the limit unannounced is answered by `_body`."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            declared = dict(scope.get("headers") or []).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_bytes:
                error = OpenAIError(413, f"the request body is over {self.max_bytes} bytes", code="request_too_large")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _answering_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """OpenAIError and typed Signal errors as OpenAI's error responses (a Router has no exception handlers)."""
    @functools.wraps(handler)
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except OpenAIError as error:
            return error.response()
        except SignalError as error:
            return from_signal(error).response()
    return handle


def openai_app() -> ASGIApp:
    """The /v1 application, mounted by app/server.py. A Router, not a Starlette app, so `request.app` stays the
    server's (its services)."""
    routes = [("/models", list_models, ["GET"]), ("/models/{model:path}", get_model, ["GET"]),
              ("/completions", completions, ["POST"]), ("/chat/completions", chat_completions, ["POST"]),
              ("/{path:path}", not_found, ["GET", "POST", "PUT", "PATCH", "DELETE"])]
    return Router(routes=[Route(path, _answering_errors(handler), methods=methods) for path, handler, methods in routes])
