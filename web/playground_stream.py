"""The playground's streams (issue 18 §4). POST /playground/stream validates a sample and keeps each pane's (one per
model compared side by side) under a one-time id, in this server process's memory (EventSource is GET-only, and a
prompt in a URL would land in the access log); GET /playground/stream/{id} starts one through RunService.sample with
a `progress` callback, the one function /v1 streams through, and sends each decode chunk's settled text as it is
made. Closing the stream cancels the generation in the runtime; the sample is still kept in the history, with
finish_reason "cancelled", as /v1 keeps it."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import NotFound, SignalError
from app.services.runs import SampleParams
from app.services.streams import hold, next_chunk
from web.playground import Model, prepared, sample_form
from web.render import page, services, signed_in

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User

PENDING_TTL_S = 300  # a stream not opened by then is dropped: the page opens it at once
STREAM_ID = "playground-{}"  # the runtime request id: what a cancel names


@dataclass(frozen=True)
class Pending:
    user_id: str
    model: Model
    params: SampleParams
    made: float


# One-time ids, in this process only: a deployment running several server processes must route a page's POST and its
# GET to the same one (a sticky session), or the GET finds nothing and answers 404.
_PENDING: dict[str, Pending] = {}


@signed_in
async def start_stream(request: Request, user: User) -> Response:
    """Validate the form (the contract's bounds and the server's per-call ones) and each pane's model (the user's,
    rendered with its chat template when asked); answer the result card whose script opens one stream per pane."""
    form = sample_form(await request.form())
    panes = await prepared(services(request), user, form)
    now = time.monotonic()
    for key in [key for key, held in _PENDING.items() if now - held.made > PENDING_TTL_S]:
        del _PENDING[key]
    streams = []
    for model, params in panes:
        ident = secrets.token_urlsafe(16)
        _PENDING[ident] = Pending(user.id, model, params, now)
        streams.append((model, f"/playground/stream/{ident}"))
    return page(request, "_play_stream.html", user=user, form=form, streams=streams, count=form.params.num_samples)


@signed_in
async def stream(request: Request, user: User) -> Response:
    ident = request.path_params["ident"]
    held = _PENDING.get(ident)
    if held is None or held.user_id != user.id:  # another user's id is unknown to them, and stays the owner's
        raise NotFound("This sample was started already, or has expired: press Sample again.")
    del _PENDING[ident]
    runs, model = services(request).runs, held.model
    run = await runs.get(user, model.run.id) if model.run is not None else None  # still the user's, not archived
    chunks: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    request_id = STREAM_ID.format(secrets.token_hex(16))
    task = hold(runs.sample(user, run.id if run else None, held.params, request_id=request_id,
                            snapshot=model.snapshot, base_model=model.base_model, progress=chunks.put_nowait))

    async def events() -> AsyncIterator[ServerSentEvent]:
        try:
            while True:
                chunk = await next_chunk(task, chunks)
                if chunk is None:
                    break
                # Only settled text: the runtime's detokeniser holds back incomplete UTF-8 and stop-string prefixes.
                pieces = [{"text": s["text"], "tokens": len(s["tokens"])} for s in chunk["sequences"][0]]
                yield ServerSentEvent(data=json.dumps(pieces), event="progress")
            done = [{"text": s["text"], "tokens": len(s["tokens"]), "stop_reason": s["stop_reason"]}
                    for s in task.result()["sequences"][0]]
            yield ServerSentEvent(data=json.dumps(done), event="done")
        except SignalError as error:
            yield ServerSentEvent(data=error.message, event="failed")
        finally:
            if not task.done():  # the page closed the stream (Cancel, or left): stop the generation, keep what it made
                hold(runs.cancel_sample(user, request_id, run, model.base_model))

    return EventSourceResponse(events(), ping=15, send_timeout=30)


routes = [
    Route("/playground/stream", start_stream, methods=["POST"]),
    Route("/playground/stream/{ident}", stream, methods=["GET"]),
]
