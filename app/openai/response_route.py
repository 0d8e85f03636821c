"""The /v1/responses route: the Responses API (app/openai/responses.py) answered by the chat completions handler it
is given (a sub-request with the translated body: one pipeline for rendering, sampling, billing and records), its
stored responses in the database (app/services/stored_responses.py)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from app.openai import responses, targets
from app.openai.errors import OpenAIError, bad
from app.security import bearer_from_header
from gpu_runtime.contract.json_types import JSONObject, as_json_object

Handler = Callable[[Request], Awaitable[Response]]


def _sub_request(request: Request, body: JSONObject) -> Request:
    """`request` carrying `body` instead: its own receive after that, so the client leaving still withdraws."""
    data, sent = json.dumps(body).encode(), False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await request.receive()
    return Request(request.scope, receive)


def handler(chat_completions: Handler) -> Handler:
    async def create_response(request: Request) -> Response:
        state = request.app.state
        user = await state.services.keys.authenticate(bearer_from_header(request.headers.get("authorization")))
        try:
            raw = json.loads(await request.body())
        except HTTPException as exc:  # the body limit, met while streaming it in
            raise OpenAIError(413, f"the request body is over {state.settings.max_request_bytes} bytes",
                              code="request_too_large") from exc
        except ValueError:
            raise bad("body", "the request body is not valid JSON") from None

        async def chat_answer(body: JSONObject) -> JSONObject:
            answer = await chat_completions(_sub_request(request, body))
            return as_json_object(json.loads(bytes(answer.body)), "answer")  # the chat handler's JSON object

        async def run_of(model: str) -> str | None:  # the answered model: it resolves
            target = await targets.resolve(state.services, user, model)
            return target.run.id if target.run is not None else None

        return await responses.create(user, raw, state.services.responses, chat_answer, run_of)
    return create_response
