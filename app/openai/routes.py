"""The /v1 routes: authenticate by API key (never the session cookie), resolve `model` (targets.py), sample
(generation.py), answer in OpenAI's shapes (answers.py), whole or streamed (streaming.py).

A pure ASGI app under Mount("/v1"): no BaseHTTPMiddleware, which would buffer the event stream and break
Starlette's disconnect detection.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp

from app.errors import SignalError, Unauthenticated
from app.openai import response_route, streaming, targets, tool_stream_forms
from app.openai.errors import OpenAIError, answering_errors, bad, from_signal, too_large
from app.openai.generation import Sampling, prepared
from app.openai.params import parse
from app.security import bearer_from_header
from app.services import services_of
from app.services.streams import gone, hold
from app.tables import User

log = logging.getLogger("signal.openai")


async def _user(request: Request) -> User:
    return await services_of(request).keys.authenticate(bearer_from_header(request.headers.get("authorization")))


def _key_check(request: Request) -> Callable[[], Awaitable[object]]:
    """The request's key checked again (an open stream's, every SIGNAL_SESSION_RECHECK_S): UNAUTHENTICATED once it is
    revoked or its user disabled; a database away meanwhile is no reason to end a stream (checked next round)."""
    keys, secret = services_of(request).keys, bearer_from_header(request.headers.get("authorization"))

    async def check() -> None:
        try:
            await keys.authenticate(secret)
        except Unauthenticated:
            raise
        except SignalError as error:
            log.warning("/v1 stream: its key could not be checked: %s", error)

    return check


async def list_models(request: Request) -> Response:
    user = await _user(request)
    return JSONResponse({"object": "list", "data": await targets.listed(services_of(request), user)})


async def get_model(request: Request) -> Response:
    user = await _user(request)
    return JSONResponse(targets.entry(await targets.resolve(services_of(request), user,
                                                            request.path_params["model"])))


async def _body(request: Request) -> Any:
    try:
        raw = await request.body()
    except HTTPException as exc:  # the body limit, met while streaming it in
        raise too_large(services_of(request).settings.max_request_bytes) from exc
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad("body", "the request body is nested too deeply") from None
    except ValueError:  # UnicodeDecodeError included
        raise bad("body", "the request body is not valid JSON") from None


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def _generate(request: Request, chat: bool) -> Response:
    user = await _user(request)
    params = parse(await _body(request), chat)
    services = services_of(request)
    target = await targets.resolve(services, user, params.model)
    prompt_ids, sample, eos = await prepared(services.runs, target, params)
    call = Sampling(services.runs, user, target, params, prompt_ids, eos)
    if params.stream and params.logprobs is None and not params.echo and tool_stream_forms.streams(params.tools):
        return await streaming.streamed(call, sample, request, services.settings.session_recheck_s,
                                        _key_check(request))
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
    return streaming.event_stream(streaming.whole(body, chat, params.include_usage))


async def not_found(request: Request) -> Response:
    return OpenAIError(404, f"Unknown request URL: {request.method} {request.url.path}. Signal serves /v1/models, "
                            "/v1/completions, /v1/chat/completions and /v1/responses.", code="unknown_url").response()


def openai_app() -> ASGIApp:
    """The /v1 application, mounted by app/server.py. A Router, not a Starlette app, so `request.app` stays the
    server's (its services)."""
    routes = [("/models", list_models, ["GET"]), ("/models/{model:path}", get_model, ["GET"]),
              ("/completions", completions, ["POST"]), ("/chat/completions", chat_completions, ["POST"]),
              ("/responses", response_route.handler(chat_completions), ["POST"]),
              ("/{path:path}", not_found, ["GET", "POST", "PUT", "PATCH", "DELETE"])]
    return Router(routes=[Route(path, answering_errors(handler), methods=methods) for path, handler, methods in routes])
