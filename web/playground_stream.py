"""The playground's stream (issue 18 §4). POST /playground/stream validates a sample, one per pane (each model
compared side by side), and keeps them under one one-time id, in this server process's memory (EventSource is
GET-only, and a prompt in a URL would land in the access log); GET /playground/stream/{id} starts them all through
RunService.sample with a `progress` callback, the one function /v1 streams through, and sends each decode chunk's
settled text as it is made, every pane's in this one stream. Closing it cancels the generations in the runtime; the
samples are still kept in the history, with finish_reason "cancelled", as /v1 keeps them."""

from __future__ import annotations

import asyncio
import functools
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
from app.services.streams import hold
from gpu_runtime.contract import SampleChunk
from web.playground import Model, prepared, sample_form
from web.render import page, services, signed_in

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import Run, User

PENDING_TTL_S = 300  # a stream not opened by then is dropped: the page opens it at once
STREAM_ID = "playground-{}"  # the runtime request id: what a cancel names


@dataclass(frozen=True)
class Pending:
    user_id: str
    panes: list[tuple[Model, SampleParams]]  # each model compared, with its sample (rendered for it)
    made: float


@dataclass(frozen=True)
class Started:
    run: Run | None
    model: Model
    request_id: str
    task: asyncio.Future[Any]


# One-time ids, in this process only: a deployment running several server processes must route a page's POST and its
# GET to the same one (a sticky session), or the GET finds nothing and answers 404.
_PENDING: dict[str, Pending] = {}


@signed_in
async def start_stream(request: Request, user: User) -> Response:
    """Validate the form (the contract's bounds and the server's per-call ones) and each pane's model (the user's,
    rendered with its chat template when asked); answer the result card whose script opens the one stream."""
    form = sample_form(await request.form())
    panes = await prepared(services(request), user, form)
    now = time.monotonic()
    for key in [key for key, held in _PENDING.items() if now - held.made > PENDING_TTL_S]:
        del _PENDING[key]
    ident = secrets.token_urlsafe(16)
    _PENDING[ident] = Pending(user.id, panes, now)
    return page(request, "_play_stream.html", user=user, form=form, models=[model for model, _ in panes],
                stream=f"/playground/stream/{ident}", count=form.params.num_samples)


@signed_in
async def stream(request: Request, user: User) -> Response:
    """Every pane's sample at once, their chunks in one event stream as they come, each event naming its pane."""
    ident = request.path_params["ident"]
    held = _PENDING.get(ident)
    if held is None or held.user_id != user.id:  # another user's id is unknown to them, and stays the owner's
        raise NotFound("This sample was started already, or has expired: press Sample again.")
    del _PENDING[ident]
    runs = services(request).runs
    # Each run still the user's (and not archived) before any sample starts: none is left running unwatched.
    owned = [await runs.get(user, model.run.id) if model.run is not None else None for model, _ in held.panes]
    arrived: asyncio.Queue[tuple[int, SampleChunk | None]] = asyncio.Queue()  # (pane, chunk); None: it ended
    started = []
    for pane, ((model, params), run) in enumerate(zip(held.panes, owned, strict=True)):
        request_id = STREAM_ID.format(secrets.token_hex(16))
        task = hold(runs.sample(user, run.id if run else None, params, request_id=request_id, snapshot=model.snapshot,
                                base_model=model.base_model, progress=functools.partial(_arrived, arrived, pane)))
        # After the sample's last chunk: its progress calls all come before its answer.
        task.add_done_callback(functools.partial(_ended, arrived, pane))
        started.append(Started(run, model, request_id, task))

    async def events() -> AsyncIterator[ServerSentEvent]:
        left = len(started)
        try:
            while left:
                pane, chunk = await arrived.get()
                if chunk is not None:
                    # Only settled text: the runtime's detokeniser holds back incomplete UTF-8 and stop-string prefixes.
                    pieces = [{"text": s["text"], "tokens": len(s["tokens"])} for s in chunk.sequences[0]]
                    yield ServerSentEvent(data=json.dumps({"pane": pane, "pieces": pieces}), event="progress")
                    continue
                left -= 1
                try:
                    result = started[pane].task.result()
                except SignalError as error:
                    yield ServerSentEvent(data=json.dumps({"pane": pane, "message": error.message}), event="failed")
                    continue
                done = [{"text": s["text"], "tokens": len(s["tokens"]), "stop_reason": s["stop_reason"]}
                        for s in result.sequences[0]]
                yield ServerSentEvent(data=json.dumps({"pane": pane, "sequences": done}), event="done")
        finally:
            for one in started:  # the page closed the stream (Cancel, or left): stop the generations, keep what they made
                if not one.task.done():
                    hold(runs.cancel_sample(user, one.request_id, one.run, one.model.base_model))

    return EventSourceResponse(events(), ping=15, send_timeout=30)


def _arrived(queue: asyncio.Queue[tuple[int, SampleChunk | None]], pane: int, chunk: SampleChunk) -> None:
    queue.put_nowait((pane, chunk))


def _ended(queue: asyncio.Queue[tuple[int, SampleChunk | None]], pane: int, _: asyncio.Future[Any]) -> None:
    queue.put_nowait((pane, None))


routes = [
    Route("/playground/stream", start_stream, methods=["POST"]),
    Route("/playground/stream/{ident}", stream, methods=["GET"]),
]
