"""The playground's stream (issue 18 §4). POST /playground/stream validates a sample, one per pane (each model
compared side by side), and keeps them in the database under one one-time id (EventSource is GET-only, and a prompt
in a URL would land in the access log; any server process may answer the GET: app/services/playground_streams.py);
GET /playground/stream/{id} starts them all through RunService.sample with a `progress` callback, the one function
/v1 streams through, and sends each decode chunk's settled text as it is made, every pane's in this one stream.
POST /playground/stream/{id}/cancel/{pane} stops one pane's generation, the others go on; closing the stream stops
them all, and so does the session's end (the stream then says `signed-out`: web/session_streams.py). A cancelled
sample is still kept in the history, with finish_reason "cancelled", as /v1 keeps them."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import NotFound, SignalError
from app.services import Services
from app.services.runs import SampleParams
from app.services.streams import hold
from web.playground import Model, prepared, sample_form
from web.render import page, services, signed_in
from web.session_streams import until_signed_out

if TYPE_CHECKING:  # rows and chunks are only ever received from app.services: web imports no lower layer
    from app.tables import Pane, Run, User
    from gpu_runtime.contract import SampleChunk

STREAM_ID = "playground-{}"  # the runtime request id: what a cancel names


@dataclass(frozen=True)
class Started:
    run: Run | None
    model: Model
    request_id: str
    task: asyncio.Future[Any]


def _kept(model: Model, params: SampleParams) -> Pane:
    """One pane as its database row keeps it (JSON): the model, its sample, and the request id a Cancel names."""
    return {"model": model.value, "label": model.label, "run_id": model.run.id if model.run else None,
            "snapshot": model.snapshot, "base_model": model.base_model, "params": dataclasses.asdict(params),
            "request_id": STREAM_ID.format(secrets.token_hex(16))}


async def _run_of(svc: Services, user: User, pane: Pane) -> Run | None:
    """The pane's run, still the user's (another's is not found), or None for a base model alone."""
    return await svc.runs.get(user, pane["run_id"]) if pane["run_id"] else None


@signed_in
async def start_stream(request: Request, user: User) -> Response:
    """Validate the form (the contract's bounds and the server's per-call ones) and each pane's model (the user's,
    rendered with its chat template when asked); answer the result card whose script opens the one stream."""
    form = sample_form(await request.form())
    svc = services(request)
    panes = await prepared(svc, user, form)
    ident = await svc.playground.keep(user, [_kept(model, params) for model, params in panes])
    return page(request, "_play_stream.html", user=user, form=form, models=[model for model, _ in panes],
                stream=f"/playground/stream/{ident}", count=form.params.num_samples)


@signed_in
async def cancel_pane(request: Request, user: User) -> Response:
    """Stop one pane's generation (the runtime answers it with what it has, stop_reason "cancelled", in the stream);
    the other panes go on. The same cancel, by runtime request id, as closing the stream makes."""
    svc = services(request)
    panes = await svc.playground.streaming(user, request.path_params["ident"])
    index = request.path_params["pane"]
    if index >= len(panes):
        raise NotFound(f"This sample has no pane {index + 1}.")
    pane = panes[index]
    await svc.runs.cancel_sample(user, pane["request_id"], await _run_of(svc, user, pane), pane["base_model"])
    return Response(status_code=204)


@signed_in
async def stream(request: Request, user: User) -> Response:
    """Every pane's sample at once, their chunks in one event stream as they come, each event naming its pane."""
    ident = request.path_params["ident"]
    svc = services(request)
    kept = await svc.playground.open(user, ident)  # another user's id is unknown to them, and stays the owner's
    runs = svc.runs
    # Each run still the user's (and not archived) before any sample starts: none is left running unwatched.
    owned = [await _run_of(svc, user, pane) for pane in kept]
    arrived: asyncio.Queue[tuple[int, SampleChunk | None]] = asyncio.Queue()  # (pane, chunk); None: it ended
    started = []
    for index, (pane, run) in enumerate(zip(kept, owned, strict=True)):
        model = Model(pane["model"], pane["label"], run, pane["snapshot"], pane["base_model"])
        request_id = pane["request_id"]
        task = hold(runs.sample(user, run.id if run else None, SampleParams(**pane["params"]), request_id=request_id,
                                snapshot=model.snapshot, base_model=model.base_model,
                                progress=functools.partial(_arrived, arrived, index)))
        # After the sample's last chunk: its progress calls all come before its answer.
        task.add_done_callback(functools.partial(_ended, arrived, index))
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
                    # CANCELLED: the pane's Cancel came before its generation began (withdrawn, never run).
                    failed = {"pane": pane, "message": error.message, "code": error.code}
                    yield ServerSentEvent(data=json.dumps(failed), event="failed")
                    continue
                done = [{"text": s.text, "tokens": len(s.tokens), "stop_reason": s.stop_reason}
                        for s in result.sequences[0]]
                yield ServerSentEvent(data=json.dumps({"pane": pane, "sequences": done}), event="done")
        finally:
            for one in started:  # the page closed the stream (Cancel, or left): stop the generations, keep what they made
                if not one.task.done():
                    hold(runs.cancel_sample(user, one.request_id, one.run, one.model.base_model))
            hold(svc.playground.close(ident))  # nothing left to cancel by pane

    # Signed out elsewhere: the stream says so and ends, and its `finally` stops the generations.
    return EventSourceResponse(until_signed_out(request, events()), ping=15, send_timeout=30)


def _arrived(queue: asyncio.Queue[tuple[int, SampleChunk | None]], pane: int, chunk: SampleChunk) -> None:
    queue.put_nowait((pane, chunk))


def _ended(queue: asyncio.Queue[tuple[int, SampleChunk | None]], pane: int, _: asyncio.Future[Any]) -> None:
    queue.put_nowait((pane, None))


routes = [
    Route("/playground/stream", start_stream, methods=["POST"]),
    Route("/playground/stream/{ident}", stream, methods=["GET"]),
    Route("/playground/stream/{ident}/cancel/{pane:int}", cancel_pane, methods=["POST"]),
]
