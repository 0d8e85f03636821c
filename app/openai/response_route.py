"""The /v1/responses route: the Responses API (app/openai/responses.py) on the chat pipeline of app/openai/routes.py,
its stored responses one store per server."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.errors import SignalError
from app.openai import responses
from app.openai.errors import from_signal
from app.openai.routes import Sampling, _body, _prepared, _run, _services, _user
from app.services.streams import gone, hold
from app.tables import User


async def chat_answer(request: Request, user: User, params: Any) -> dict[str, Any]:
    """A checked chat request answered whole, as /v1/chat/completions answers it (the Responses API's core)."""
    services = _services(request)
    target = await _run(services, user, params.model)
    prompt_ids, sample, eos = await _prepared(services.runs, target, params, True)
    call = Sampling(services.runs, user, target, params, True, prompt_ids, eos)
    leaving = hold(gone(request.receive))
    try:
        return (await call.answer(await call.sample_unless_gone(sample, leaving)))[0]
    except SignalError as error:
        raise from_signal(error, call.prompt_param) from None
    finally:
        leaving.cancel()


async def create_response(request: Request) -> Response:
    state = request.app.state
    if getattr(state, "openai_responses", None) is None:  # one store per server, made on first use
        state.openai_responses = responses.ResponseStore(state.settings.openai_responses_ttl_s)
    return await responses.create(request, await _user(request), await _body(request), state.openai_responses,
                                  chat_answer)
