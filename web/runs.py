"""Runs: the live table, a run's page (chart over server-sent events), save now, delete, downloads."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from datetime import UTC
from typing import TYPE_CHECKING, Any, TypedDict
from urllib.parse import urlencode

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from app.errors import BadInput
from app.services.dashboard import RUNS_PAGE_SIZE
from app.services.runs import RUN_SORTS, SEARCH_LENGTH, RunLabels
from web.render import ago, duration, hx_redirect, page, services, signed_in, signed_in_or_key
from web.session_streams import until_signed_out

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.services.dashboard import RunSummary
    from app.tables import Checkpoint, Metric, Run, Sample, User
    from gpu_runtime.contract.json_types import JSONObject  # an annotation: web/ imports no runtime module

SAVE_MODES = ("adapter", "merged", "state")
PUSH_MODES = ("adapter", "merged")  # what a Hub repo is for: a state checkpoint (AdamW's moments) resumes only here
# What each checkpoint kind is, in one line (issue 18 §8); its size is estimated by `_mode_sizes`.
MODE_HELP = {
    "adapter": "the LoRA weights alone: load them over the base model with PEFT, or share them.",
    "merged": "the base model with the LoRA folded in: a standalone model for transformers, vLLM or the Hub.",
    "state": "the LoRA weights and the optimizer's moments: resume training exactly (load_state, from_checkpoint).",
}
DEFAULT_VIEW = {"q": "", "sort": "newest", "show": ""}
# ?show=: which runs by archiving (RunService.list's `archived`); the default hides archived ones.
SHOW: dict[str, bool | None] = {"": False, "archived": True, "all": None}
SHOW_LABELS = {"": "Not archived", "archived": "Archived", "all": "All runs"}
SORT_LABELS = {"newest": "Newest first", "oldest": "Oldest first", "name": "Name (A–Z)",
               "activity": "Recently active", "step": "Most steps"}
RUNS_POLL_S = 1.0  # how soon /runs shows a step, a loss or a status: the stream reads the summaries this often


@signed_in
async def runs_page(request: Request, user: User) -> Response:
    """A page of the runs list (RUNS_PAGE_SIZE runs, ?page=N), its search, order and filter kept in every link."""
    view = _view(request)
    listed = await services(request).dashboard.runs_page(user, _int(request.query_params.get("page")),
                                                         search=view["q"], sort=view["sort"],
                                                         archived=SHOW[view["show"]])
    name = "_runs_table.html" if request.url.path.endswith("/table") else "runs.html"
    # The stream follows the runs shown (by id, wherever new runs or the order move them); on the first page it
    # also reads the first page's runs, so a run the page does not show is announced as new there and only there.
    stream = {**_query(view, listed.number), "ids": ",".join(s.run.id for s in listed.summaries)}
    return page(request, name, user=user, summaries=listed.summaries, listed=listed, view=view, sorts=SORT_LABELS,
                shows=SHOW_LABELS, events_url=f"/runs/events?{urlencode(stream)}",
                first_url=_runs_url(view, 1), previous_url=_runs_url(view, listed.number - 1),
                next_url=_runs_url(view, listed.number + 1))


def _query(view: dict[str, str], number: int) -> dict[str, str]:
    """The list's URL query: the view's non-default parts and the page past the first."""
    query = {key: value for key, value in view.items() if value != DEFAULT_VIEW[key]}
    return {**query, "page": str(number)} if number > 1 else query


def _runs_url(view: dict[str, str], number: int) -> str:
    query = _query(view, number)
    return f"/runs?{urlencode(query)}" if query else "/runs"


def _view(request: Request) -> dict[str, str]:
    """The list's search and order, from the URL's query (?q=&sort=), so a filtered view can be linked and reloaded.
    An unknown order is the default one: a stale bookmark still shows the runs."""
    sort, show = request.query_params.get("sort", "newest"), request.query_params.get("show", "")
    return {"q": request.query_params.get("q", "").strip()[:SEARCH_LENGTH],
            "sort": sort if sort in RUN_SORTS else "newest", "show": show if show in SHOW else ""}


@signed_in
async def new_run_page(request: Request, user: User) -> Response:
    """The New run form (issue 18 §1): the catalogue's models, LoRA settings, quantization, and the GPU picker where
    the backend offers GPUs (Modal); locally, the device runs train on."""
    return page(request, "run_new.html", user=user, choices=await services(request).run_form.choices(), values={})


@signed_in
async def create_run(request: Request, user: User) -> Response:
    """Create through RunService.create, as createRun does, then open the run's page. A refusal (a bad number, a model
    too large for the chosen GPU) comes back inside the form, next to its field, with what was typed kept."""
    svc = services(request)
    values = {key: str(value) for key, value in (await request.form()).items() if key != "csrf_token"}
    try:
        run = await svc.runs.create(user, svc.run_form.spec(values))
    except BadInput as error:
        return page(request, "_run_form.html", user=user, choices=await svc.run_form.choices(), values=values,
                    error=error.message, error_field=error.field)
    return hx_redirect(request, f"/runs/{run.id}")


@signed_in
async def runs_events(request: Request, user: User) -> Response:
    """The user's run rows, as one `runs` event each time any shown cell changes (issue 18 §3: the page updates cell
    text in place, static/runs.js, instead of replacing its table every few seconds and losing focus and selection).
    A server-side read of the summaries, not a browser poll: one connection per page, and nothing sent when quiet.
    ?ids= are the runs the page shows (followed wherever they move); on page 1 the first page's runs are read too,
    and those the page lacks are the "new runs" it announces. A later page gets only its own runs: a run new to its
    place was pushed down from the page before, not made, so it announces nothing."""
    svc = services(request)
    view = _view(request)  # the page's own filter: a run it hides is not "new"
    first_page = _int(request.query_params.get("page")) <= 1
    shown = [run_id for run_id in request.query_params.get("ids", "").split(",") if run_id][:RUNS_PAGE_SIZE]

    async def events() -> AsyncIterator[ServerSentEvent]:
        last: list[dict[str, str]] | None = None
        while True:
            summaries = await svc.dashboard.run_summaries_of(user, shown)
            if first_page:
                summaries += (await svc.dashboard.runs_page(user, 1, search=view["q"], sort=view["sort"],
                                                            archived=SHOW[view["show"]])).summaries
            rows = sorted({s.run.id: _cells(s) for s in summaries}.values(), key=lambda row: row["id"])
            if rows != last:
                yield ServerSentEvent(data=json.dumps(rows), event="runs")
                last = rows
            await asyncio.sleep(RUNS_POLL_S)

    return EventSourceResponse(until_signed_out(request, events()), ping=15, send_timeout=30)


def _cells(summary: RunSummary) -> dict[str, str]:
    """A run's row as the cells' text, formatted as _runs_table.html formats it."""
    run, loss = summary.run, summary.last_loss
    return {"id": run.id, "name": run.name or run.id[:8], "status": run.status, "step": str(run.step),
            "loss": "—" if loss is None else f"{loss:.4f}", "tokens": f"{summary.tokens_trained:,}",
            "activity": ago(run.updated_at), "duration": duration(run.updated_at - run.created_at)}


@signed_in
async def run_page(request: Request, user: User) -> Response:
    svc = services(request)
    run = await svc.runs.get(user, request.path_params["run_id"])
    marks = [{"step": step, "t": first.timestamp()} for step, first in await svc.runs.sample_marks(run)]
    checkpoints = await svc.runs.checkpoints(run)
    return page(request, "run.html", user=user, run=run, samples=await svc.runs.samples(run, limit=20),
                checkpoints=checkpoints, modes=SAVE_MODES, **_checkpoint_context(request, run, checkpoints),
                sample_marks=marks,
                tinker=await svc.tinker_sessions.of_run(run.id))  # a run a Tinker client made: its session


@signed_in
async def run_events(request: Request, user: User) -> Response:
    """The run page's one stream (issue 18 §3): metric rows, samples and checkpoints after three cursors. Each event's
    id is "<metric id>:<sample id>:<checkpoint id>", which the browser sends back as Last-Event-ID on a reconnect; a
    fresh stream from the page sends ?after=, ?samples_after= and ?checkpoints_after= instead."""
    resumed = (request.headers.get("last-event-id") or "").split(":")
    after = max(_int(resumed[0]), _int(request.query_params.get("after")))
    given = [resumed[1]] if len(resumed) > 1 else []
    given += [request.query_params["samples_after"]] if "samples_after" in request.query_params else []
    samples_after = max(map(_int, given)) if given else None  # none given: the samples made from now on
    checkpoints_after = max(_int(resumed[2] if len(resumed) > 2 else None),
                            _int(request.query_params.get("checkpoints_after")))
    # Opened before the response starts: another user's run is a plain 404, never an empty stream.
    stream = await services(request).live.open_stream(user, request.path_params["run_id"], after_id=after,
                                                      samples_after=samples_after,
                                                      checkpoints_after=checkpoints_after)

    async def events() -> AsyncIterator[ServerSentEvent]:
        async for batch in stream.batches():
            cursor = f"{stream.cursor}:{stream.sample_cursor}:{stream.checkpoint_cursor}"
            if batch.checkpoints:  # before the metrics: the chart places their markers as it draws
                yield ServerSentEvent(data=json.dumps([_checkpoint(row) for row in batch.checkpoints]),
                                      event="checkpoints", id=cursor)
            if batch.samples:
                yield ServerSentEvent(data=json.dumps([_sample(row) for row in batch.samples]), event="samples",
                                      id=cursor)
            if batch.metrics:
                yield ServerSentEvent(data=json.dumps([_point(row) for row in batch.metrics]), event="metrics",
                                      id=cursor)

    return EventSourceResponse(until_signed_out(request, events()), ping=15, send_timeout=30)


@signed_in
async def metrics_csv(request: Request, user: User) -> Response:
    """Every metric row of the run as CSV (the chart's export), streamed page by page."""
    run_id = request.path_params["run_id"]
    pages = await services(request).live.history(user, run_id)

    async def lines() -> AsyncIterator[str]:
        yield "id,step,name,value,created_at\r\n"
        async for rows in pages:
            yield "".join(f"{r.id},{r.step},{r.name},{r.value!r},{r.created_at.isoformat()}\r\n" for r in rows)

    return StreamingResponse(lines(), media_type="text/csv",
                             headers={"Content-Disposition": f'attachment; filename="{run_id[:8]}-metrics.csv"'})


@signed_in
async def update_labels(request: Request, user: User) -> Response:
    """The run page's name, tags and note form: tags are one comma-separated field."""
    form = await request.form()
    tags = [tag for tag in str(form.get("tags") or "").split(",")]
    labels = RunLabels(name=str(form.get("name") or ""), tags=tags, note=str(form.get("note") or ""))
    run = await services(request).runs.label(user, request.path_params["run_id"], labels)
    return page(request, "_run_labels.html", user=user, run=run, saved=True)


@signed_in
async def archive_run(request: Request, user: User) -> Response:
    """Archive (or with archived=0, unarchive) and show the run's page again, which says which it is now."""
    form = await request.form()
    run_id = request.path_params["run_id"]
    await services(request).runs.archive(user, run_id, archived=str(form.get("archived", "1")) != "0")
    return hx_redirect(request, f"/runs/{run_id}")


@signed_in
async def save_now(request: Request, user: User) -> Response:
    form = await request.form()
    mode = _mode(form, SAVE_MODES)
    name = str(form.get("name") or "").strip() or None  # none: step-N
    svc = services(request)
    run_id = request.path_params["run_id"]
    await svc.runs.save_state(user, run_id, mode, name=name)
    return await _checkpoints(request, user, run_id)


@signed_in
async def delete_checkpoint(request: Request, user: User) -> Response:
    run_id = request.path_params["run_id"]
    await services(request).runs.delete_checkpoint(user, run_id, str(request.path_params["checkpoint_id"]))
    return await _checkpoints(request, user, run_id)


@signed_in
async def push_to_hub(request: Request, user: User) -> Response:
    """Save and upload in one call, as saveState(pushToHub: true) does: the token is this call's argument only."""
    form = await request.form()
    mode = _mode(form, PUSH_MODES)
    run_id = request.path_params["run_id"]
    await services(request).runs.save_state(user, run_id, mode, push_to_hub=True,
                                            hub_model_id=str(form.get("hub_model_id") or "").strip(),
                                            hf_token=str(form.get("hf_token") or "").strip() or None)
    return await _checkpoints(request, user, run_id)


@signed_in
async def checkpoints_card(request: Request, user: User) -> Response:
    """The checkpoints card alone: the run page fetches it again when its stream brings one it does not list."""
    return await _checkpoints(request, user, request.path_params["run_id"])


def _mode(form: Mapping[str, Any], modes: tuple[str, ...]) -> str:
    """The posted checkpoint kind, one of `modes` (adapter when none is given)."""
    mode = str(form.get("mode", "adapter"))
    if mode not in modes:
        raise BadInput(f"mode must be one of {', '.join(modes)}", field="mode")
    return mode


async def _checkpoints(request: Request, user: User, run_id: str) -> Response:
    svc = services(request)
    run = await svc.runs.get(user, run_id)
    checkpoints = await svc.runs.checkpoints(run)
    return page(request, "_checkpoints.html", user=user, run=run, checkpoints=checkpoints,
                **_checkpoint_context(request, run, checkpoints))


class CheckpointContext(TypedDict):
    mode_help: dict[str, str]
    mode_sizes: dict[str, int]
    push_modes: tuple[str, ...]
    pull_only: set[int]  # checkpoint ids
    hub_integration: bool


def _checkpoint_context(request: Request, run: Run, checkpoints: list[Checkpoint]) -> CheckpointContext:
    """What _checkpoints.html needs beyond the rows: each kind explained and sized, the kinds the Hub takes, and the
    checkpoints only `signal pull` can copy (Modal, past the runtime's export limit)."""
    svc = services(request)
    return {"mode_help": MODE_HELP, "mode_sizes": _mode_sizes(run), "push_modes": PUSH_MODES,
            "pull_only": svc.dashboard.pull_only(checkpoints),
            "hub_integration": svc.billing is not None}  # the billing service may hold the user's token


def _mode_sizes(run: Run) -> dict[str, int]:
    """About how large each kind of checkpoint of `run` is, before it is saved: the LoRA in float32; a merged model in
    the base's dtype (float32 on a CPU, 16-bit on a GPU); state adds AdamW's two float32 moments per LoRA weight."""
    adapter = run.trainable_params * 4
    return {"adapter": adapter, "merged": run.total_params * (4 if (run.device or "cpu") == "cpu" else 2),
            "state": adapter * 3}


@signed_in
async def delete_run(request: Request, user: User) -> Response:
    await services(request).runs.delete(user, request.path_params["run_id"])
    return hx_redirect(request, "/runs")


@signed_in_or_key
async def download_checkpoint(request: Request, user: User) -> Response:
    """A checkpoint's files, streamed as they are read (bug 7). `Accept: application/x-tar` (the SDK) or ?format=tar
    (the page's link) gets the plain tar with its Content-Length, so a browser's download bar shows progress; anything
    else gets the .tar.gz that SDKs before that open with "r:gz" (gzipped as it is sent, so without a length)."""
    archive = await services(request).dashboard.checkpoint_archive(
        user, request.path_params["run_id"], int(request.path_params["checkpoint_id"]))
    plain = request.query_params.get("format") == "tar" or "application/x-tar" in request.headers.get("accept", "")
    body, size = await asyncio.to_thread(archive.tar) if plain else archive.tar_gz()
    extension, media_type = (".tar", "application/x-tar") if plain else (".tar.gz", "application/gzip")
    headers = {"Content-Disposition": f'attachment; filename="{archive.name}{extension}"', "Vary": "Accept"}
    if size is not None:
        headers["Content-Length"] = str(size)
    return StreamingResponse(body, media_type=media_type, headers=headers)  # a plain iterator: read in a thread


def _sample(row: Sample) -> JSONObject:
    """A sample as the run page's list shows it (templates/run.html, static/run.js)."""
    return {"id": row.id, "step": row.step, "prompt": row.prompt, "output": row.output,
            "temperature": row.params.get("temperature"), "t": row.created_at.replace(tzinfo=UTC).timestamp()}


def _checkpoint(row: Checkpoint) -> JSONObject:
    """A checkpoint as the chart's marker shows it (static/run.js)."""
    return {"id": row.id, "step": row.step, "name": row.name, "mode": row.mode,
            "t": row.created_at.replace(tzinfo=UTC).timestamp()}


def _point(row: Metric) -> JSONObject:
    # t: seconds since the epoch (the chart's wall-time axis); rows are stored in UTC without a zone.
    return {"id": row.id, "step": row.step, "name": row.name, "value": row.value,
            "t": row.created_at.replace(tzinfo=UTC).timestamp()}


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


routes = [
    Route("/runs", runs_page),
    Route("/runs/table", runs_page),
    Route("/runs/events", runs_events),
    Route("/runs/new", new_run_page, methods=["GET"]),  # before /runs/{run_id}, which would take "new" as an id
    Route("/runs/new", create_run, methods=["POST"]),
    Route("/runs/{run_id}", run_page, methods=["GET"]),
    Route("/runs/{run_id}", delete_run, methods=["DELETE"]),
    Route("/runs/{run_id}/events", run_events),
    Route("/runs/{run_id}/metrics.csv", metrics_csv),
    Route("/runs/{run_id}/save", save_now, methods=["POST"]),
    Route("/runs/{run_id}/push", push_to_hub, methods=["POST"]),
    Route("/runs/{run_id}/labels", update_labels, methods=["POST"]),
    Route("/runs/{run_id}/archive", archive_run, methods=["POST"]),
    Route("/runs/{run_id}/checkpoints", checkpoints_card),
    Route("/runs/{run_id}/checkpoints/{checkpoint_id:int}/archive", download_checkpoint),
    Route("/runs/{run_id}/checkpoints/{checkpoint_id:int}", delete_checkpoint, methods=["DELETE"]),
]

