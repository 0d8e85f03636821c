"""The /v1 routes: authenticate by API key (never the session cookie), resolve `model`, render the prompt in the
runtime, sample through RunService.sample (billed like any sample, and kept in the sample history on every source
unless the request says `store: false`), answer in OpenAI's shapes.

A pure ASGI app under Mount("/v1"): no BaseHTTPMiddleware, which would buffer the event stream and break
Starlette's disconnect detection.
"""

from __future__ import annotations

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

from app.errors import SignalError
from app.openai import answers
from app.openai.errors import OpenAIError, bad, from_signal, model_not_found
from app.openai.params import parse
from app.schema.context import bearer_from_header
from app.services import Services
from app.services.runs import SampleParams
from app.tables import Run, User
from app.tinker import paths as tinker_paths
from gpu_runtime.contract import MAX_TOKENS_LIMIT

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
    """The caller's runs and their sampler snapshots, and the catalogue's models this server can load."""
    user = await _user(request)
    services = _services(request)
    data = []
    for run in await services.runs.list(user, limit=1000):
        data.append(_model(Target(run.id, run)))
        for row in await services.runs.checkpoints(run):
            if row.mode == "sampler" and row.name:
                data.append(_model(Target(f"{run.id}@{row.name}", run, row.name)))
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
    run, base = target.run, target.base_model
    runs = services.runs
    prompt_param = "messages" if chat else "prompt"
    try:
        if chat:
            rendered = await runs.render_chat(run, messages=params.messages, base_model=base)
            prompt_ids = [rendered["prompt_tokens"]]
        elif isinstance(params.prompts[0], str):  # type: ignore[index]  # parse set prompts on completions
            rendered = await runs.render_chat(run, prompts=params.prompts, base_model=base)  # type: ignore[arg-type]  # strings here
            prompt_ids = rendered["prompts_tokens"]
        else:
            rendered = await runs.render_chat(run, base_model=base)
            prompt_ids = params.prompts  # type: ignore[assignment]  # token-id prompts
        room = rendered["context_length"] - max(len(ids) for ids in prompt_ids)
        if room < 1:
            raise bad(prompt_param, f"the prompt is {max(len(ids) for ids in prompt_ids)} tokens; the model's context "
                                    f"is {rendered['context_length']}")
        sample = SampleParams(
            prompt_tokens=prompt_ids, max_tokens=params.max_tokens or min(room, MAX_TOKENS_LIMIT),
            temperature=params.temperature, top_p=params.top_p, stop=params.stop, num_samples=params.n,
            seed=params.seed, prompt_logprobs=params.echo and params.logprobs is not None,
            topk_prompt_logprobs=(params.logprobs or 0) if params.echo else 0,
            topk_sample_logprobs=params.logprobs or 0, store=params.store)
        result = await runs.sample(user, run.id if run else None, sample, snapshot=target.snapshot, base_model=base)
        eos = set(rendered["eos_token_ids"])
        wanted = {t for seq in result["sequences"] for s in seq for t in s["tokens"]}
        wanted |= {t for ids in prompt_ids for t in ids}
        for seq in result["sequences"]:
            for s in seq:
                wanted |= {int(pair[0]) for top in s.get("topk_logprobs") or [] for pair in top}
        for tops in result.get("topk_prompt_logprobs") or []:
            wanted |= {int(pair[0]) for top in tops if top for pair in top}
        order = sorted(wanted)
        decoded = await runs.render_chat(run, decode=order, base_model=base)
    except SignalError as error:
        raise from_signal(error, prompt_param) from None
    pieces = dict(zip(order, decoded["pieces"]))
    picked = answers.choices(result, pieces, eos)
    prompt_texts = [p if isinstance(p, str) else "".join(pieces.get(t, "") for t in p) for p in
                    (params.prompts or prompt_ids)]
    usage = answers.usage(prompt_ids, picked)
    ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    head = {"id": ident, "created": created, "model": params.model}
    if chat:
        items = [_chat_choice(c, params, pieces) for c in picked]
        body = {**head, "object": "chat.completion", "choices": items, "usage": usage}
        if params.return_token_ids:
            body["prompt_token_ids"] = prompt_ids[0]
    else:
        items = [_completion_choice(c, params, pieces, prompt_ids, prompt_texts, result) for c in picked]
        body = {**head, "object": "text_completion", "choices": items, "usage": usage}
    if not params.stream:
        return JSONResponse(body)
    return StreamingResponse(_events(body, chat, params.include_usage), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def _chat_choice(choice: answers.Choice, params: Any, pieces: dict[int, str]) -> dict[str, Any]:
    item: dict[str, Any] = {"index": choice.index, "message": {"role": "assistant", "content": choice.text,
                                                               "refusal": None},
                            "logprobs": answers.chat_logprobs(choice, params, pieces),
                            "finish_reason": choice.finish_reason}
    if params.return_token_ids:
        item["token_ids"] = choice.ids
    return item


def _completion_choice(choice: answers.Choice, params: Any, pieces: dict[int, str], prompt_ids: list[list[int]],
                       prompt_texts: list[str], result: dict[str, Any]) -> dict[str, Any]:
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
    """The whole answer as events: per choice its content in one chunk, then its finish; usage last when asked.
    (The sample has completed before the first event: per-decode-chunk streaming needs a streamed sample in the
    engine contract, docs/OPENAI.md.) An error after the first event goes out as data: {"error": …}."""
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
