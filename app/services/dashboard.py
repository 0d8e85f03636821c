"""What the dashboard shows beyond the API's own reads: runs with their last loss, compare curves and checkpoint
archives. Every read goes through the run's ownership check first (the admin's view is app/services/admin.py)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from app.backends import Backend
from app.db import Database
from app.errors import BadInput, NotFound
from app.events import LOSS_METRICS, EventBroker
from app.services.runs import RunService
from app.tables import CallRecord, Checkpoint, Metric, Run, User
from app.tar_stream import TarStream, gzip_chunks


@dataclass
class RunSummary:
    run: Run
    last_loss: float | None
    tokens_trained: int = 0  # forward_backward's weighted target tokens, from the call records (as usage counts them)


@dataclass
class RunsPage:
    """One page of the runs list: its summaries, which page it is (1-based) and how many runs the filter matches."""

    summaries: list[RunSummary]
    number: int
    total: int
    size: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.size))

    @property
    def first(self) -> int:
        """The position of the page's first run in the whole list (1-based), 0 on an empty page."""
        return (self.number - 1) * self.size + 1 if self.summaries else 0

    @property
    def last(self) -> int:
        return (self.number - 1) * self.size + len(self.summaries)


RUNS_PAGE_SIZE = 50  # runs on one page of the list; the rest are a "Next" away
COMPARE_RUNS = (2, 8)  # how many runs the compare page overlays: fewer is no comparison, more is an unreadable chart


@dataclass
class RunCurve:
    """A run on the compare page: its loss at each step (the token-weighted mean of the step's forward_backward
    losses, as the run page's step axis draws it) and the learning rates its optim_steps used."""

    run: Run
    steps: list[int]
    losses: list[float]
    learning_rates: list[float]


@dataclass
class Archive:
    """A checkpoint's files as a tar archive, read as it is sent (no temporary file): from this server's disk, or as
    the .tar.gz bytes the runtime sent (Modal's files are on its Volume)."""

    name: str  # the archive's top-level folder, and its file name without the extension
    files: TarStream | None = None
    sent: bytes | None = None  # gzipped

    def tar(self) -> tuple[Iterator[bytes], int]:
        """The uncompressed tar and its exact length (blocking for the runtime's bytes: call off the event loop)."""
        if self.files is not None:
            return self.files.chunks(), self.files.size
        data = gzip.decompress(self.sent or b"")
        return iter([data]), len(data)

    def tar_gz(self) -> tuple[Iterator[bytes], int | None]:
        """The tar gzipped as it is sent (its length unknown up front), or the runtime's own bytes."""
        if self.files is not None:
            return gzip_chunks(self.files.chunks()), None
        data = self.sent or b""
        return iter([data]), len(data)


class DashboardService:
    def __init__(self, db: Database, backend: Backend, broker: EventBroker, runs: RunService, data_dir: Path) -> None:
        self.db = db
        self.backend = backend
        self.broker = broker
        self.runs = runs
        self.data_dir = Path(data_dir)

    async def runs_page(self, user: User, number: int = 1, search: str = "", sort: str = "newest",
                        archived: bool | None = False, size: int = RUNS_PAGE_SIZE) -> RunsPage:
        """Page `number` of the user's runs (RunService.list's filters and order). A number past the last page is
        the last page, one below 1 the first: a stale link still shows runs."""
        total = await self.runs.count(user, search=search, archived=archived)
        number = min(max(1, number), max(1, -(-total // size)))
        runs = await self.runs.list(user, limit=size, offset=(number - 1) * size, search=search, sort=sort,
                                    archived=archived)
        return RunsPage(await self._summaries(runs), number, total, size)

    async def run_summaries_of(self, user: User, run_ids: list[str]) -> list[RunSummary]:
        """The summaries of those of `run_ids` the user owns (unordered): the list's stream follows the runs a page
        shows wherever the order has moved them since."""
        if not run_ids:
            return []
        async with self.db.session() as session:
            runs = list(await session.scalars(select(Run).where(Run.user_id == user.id, Run.id.in_(run_ids))))
        return await self._summaries(runs)

    async def _summaries(self, runs: list[Run]) -> list[RunSummary]:
        losses = await self._last_losses([run.id for run in runs])
        trained = await self._tokens_trained([run.id for run in runs])
        return [RunSummary(run, losses.get(run.id), trained.get(run.id, 0)) for run in runs]

    async def _tokens_trained(self, run_ids: list[str]) -> dict[str, int]:
        if not run_ids:
            return {}
        async with self.db.session() as session:
            rows = await session.execute(
                select(CallRecord.run_id, func.sum(CallRecord.tokens_in))
                .where(CallRecord.run_id.in_(run_ids), CallRecord.operation == "forward_backward")
                .group_by(CallRecord.run_id))
            return {str(run_id): int(total or 0) for run_id, total in rows}

    async def _last_losses(self, run_ids: list[str]) -> dict[str, float]:
        if not run_ids:
            return {}
        async with self.db.session() as session:
            newest = (select(func.max(Metric.id)).where(Metric.run_id.in_(run_ids), Metric.name.in_(LOSS_METRICS))
                      .group_by(Metric.run_id))
            rows = await session.execute(select(Metric.run_id, Metric.value).where(Metric.id.in_(newest)))
            return {run_id: value for run_id, value in rows}

    async def compare(self, user: User, run_ids: list[str]) -> list[RunCurve]:
        """The user's runs `run_ids` (2-8, each once, in the given order) with their curves; another user's run is
        NotFound, as everywhere."""
        run_ids = list(dict.fromkeys(run_ids))
        low, high = COMPARE_RUNS
        if not low <= len(run_ids) <= high:
            raise BadInput(f"pick {low} to {high} runs to compare, got {len(run_ids)}", field="ids")
        runs = [await self.runs.get(user, run_id) for run_id in run_ids]
        async with self.db.session() as session:
            rows = (await session.execute(
                select(Metric.run_id, Metric.step, Metric.name, Metric.value, Metric.created_at)
                .where(Metric.run_id.in_(run_ids), Metric.name.in_((*LOSS_METRICS, "num_tokens", "learning_rate")))
                .order_by(Metric.id))).all()
        return [_curve(run, [row for row in rows if row.run_id == run.id]) for run in runs]

    async def checkpoint(self, user: User, run_id: str, checkpoint_id: int) -> Checkpoint:
        run = await self.runs.get(user, run_id)
        for checkpoint in await self.runs.checkpoints(run):
            if checkpoint.id == checkpoint_id:
                return checkpoint
        raise NotFound(f"checkpoint {checkpoint_id} of run {run_id!r} not found", field="checkpointId")

    async def checkpoint_archive(self, user: User, run_id: str, checkpoint_id: int) -> Archive:
        """The checkpoint's directory as an archive to stream; its files are listed (and sized) here, off the loop."""
        checkpoint = await self.checkpoint(user, run_id, checkpoint_id)
        source = Path(checkpoint.path).resolve()
        name = f"{run_id[:8]}-step{checkpoint.step}-{checkpoint.mode}"
        # The path comes from the runtime; never archive anything outside this server's data directory.
        if source.is_relative_to(self.data_dir.resolve()) and source.is_dir():
            return Archive(name, files=await asyncio.to_thread(TarStream.of_directory, source, name))
        if not self.backend.shares_disk:  # on Modal the files are on the Volume: the runtime sends them
            data = await self.runs.checkpoint_archive(run_id, checkpoint.mode, checkpoint.step, checkpoint.name or None)
            return Archive(name, sent=data)
        raise NotFound(f"checkpoint {checkpoint_id}'s files are not on this server", field="checkpointId")

    def pull_only(self, checkpoints: list[Checkpoint]) -> set[int]:
        """The checkpoints (ids) a download cannot serve: on a backend whose files are not on this server's disk
        (Modal), those past the runtime's export limit, which the runtime refuses to send. `signal pull` copies them."""
        if self.backend.shares_disk:
            return set()
        limit = self.runs.bounds.export_limit_bytes
        return {checkpoint.id for checkpoint in checkpoints if checkpoint.size_bytes > limit}


def _curve(run: Run, rows: list[Any]) -> RunCurve:
    """One call's rows share its step and time: its loss (weighted by its num_tokens; 1 when absent) goes into its
    step's mean. Learning rates are listed once each, in the order first used."""
    calls: dict[tuple[int, Any], list[float]] = {}  # (step, time) -> [loss, tokens]
    rates: dict[float, None] = {}
    for row in rows:
        if row.name == "learning_rate":
            rates[row.value] = None
            continue
        call = calls.setdefault((row.step, row.created_at), [0.0, 0.0])
        call[1 if row.name == "num_tokens" else 0] = row.value
    by_step: dict[int, list[float]] = {}
    for (step, _), (loss, tokens) in calls.items():
        total = by_step.setdefault(step, [0.0, 0.0])
        total[0] += loss * (tokens or 1)
        total[1] += tokens or 1
    steps = sorted(by_step)
    return RunCurve(run, steps, [by_step[s][0] / by_step[s][1] for s in steps], list(rates))
