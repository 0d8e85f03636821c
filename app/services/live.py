"""Live training metrics for both front ends: the GraphQL subscription and the dashboard's event stream.

Ownership is checked here, before anything streams. The dashboard's stream reads metric, sample and checkpoint rows
after three cursors (`metrics.id`, `samples.id`, `checkpoints.id`, which the browser sends back in Last-Event-ID), so
a reconnect never repeats a point, a sample or a checkpoint, and rows written by another server process still arrive:
this process's writes wake the reader at once (a metric's event, or the broker's `touch` after a sample or checkpoint
is recorded), and a slow poll covers the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sqlalchemy import func, select

from app.db import Database
from app.events import EventBroker, MetricEvent
from app.services.runs import RunService
from app.tables import Checkpoint, Metric, Run, Sample, User, utcnow

BATCH = 500


class LiveMetrics:
    def __init__(self, db: Database, broker: EventBroker, runs: RunService, poll_s: float) -> None:
        self.db = db
        self.broker = broker
        self.runs = runs
        self.poll_s = poll_s  # SIGNAL_LIVE_POLL_S: how soon another server process's rows reach a stream

    async def events(self, user: User, run_id: str) -> AsyncIterator[MetricEvent]:
        """The run's training events as they happen (this process's only); RunNotFound before the first."""
        run = await self.runs.get(user, run_id)
        return self.broker.subscribe(run.id)

    async def history(self, user: User, run_id: str) -> AsyncIterator[list[Metric]]:
        """Every metric row of the run, in id order, a page at a time (the CSV export); RunNotFound before the first."""
        stream = MetricStream(self.db, self.broker, await self.runs.get(user, run_id), 0, 0.0)

        async def pages() -> AsyncIterator[list[Metric]]:
            while rows := await stream._after(stream.cursor):
                stream.cursor = rows[-1].id
                yield rows

        return pages()

    async def open_stream(self, user: User, run_id: str, after_id: int = 0, samples_after: int | None = None,
                          checkpoints_after: int = 0) -> MetricStream:
        """A stream of the run's metric rows with id > after_id, sample rows with id > samples_after (None: those
        made from now on) and checkpoint rows with id > checkpoints_after; RunNotFound here, before it starts."""
        run = await self.runs.get(user, run_id)
        if samples_after is None:
            async with self.db.session() as session:
                samples_after = await session.scalar(select(func.max(Sample.id)).where(Sample.run_id == run.id)) or 0
        return MetricStream(self.db, self.broker, run, after_id, self.poll_s, samples_after,
                            checkpoints_after)


@dataclass
class Batch:
    """New rows of each kind, in id order; both empty after a quiet poll (a keep-alive)."""

    metrics: list[Metric]
    samples: list[Sample]
    checkpoints: list[Checkpoint]


class MetricStream:
    def __init__(self, db: Database, broker: EventBroker, run: Run, after_id: int, poll_s: float,
                 samples_after: int = 0, checkpoints_after: int = 0) -> None:
        self.db = db
        self.broker = broker
        self.run = run
        self.cursor = max(0, after_id)
        self.sample_cursor = max(0, samples_after)
        self.checkpoint_cursor = max(0, checkpoints_after)
        self.poll_s = poll_s

    async def batches(self) -> AsyncIterator[Batch]:
        """New metric, sample and checkpoint rows, forever; an empty batch after each quiet poll (a keep-alive)."""
        woken = asyncio.Event()
        listener = asyncio.create_task(self._listen(woken))
        try:
            with self.broker.watching(self.run.id, woken):  # also woken by samples and checkpoints recorded here
                while True:
                    woken.clear()  # cleared before reading: a publish during the read wakes the next wait
                    rows, samples = await self._after(self.cursor), await self._samples_after(self.sample_cursor)
                    checkpoints = await self._checkpoints_after(self.checkpoint_cursor)
                    while rows or samples or checkpoints:
                        self.cursor = rows[-1].id if rows else self.cursor
                        self.sample_cursor = samples[-1].id if samples else self.sample_cursor
                        self.checkpoint_cursor = checkpoints[-1].id if checkpoints else self.checkpoint_cursor
                        yield Batch(rows, samples, checkpoints)
                        rows = await self._after(self.cursor) if len(rows) == BATCH else []
                        samples = await self._samples_after(self.sample_cursor) if len(samples) == BATCH else []
                        checkpoints = []  # a run has few: one read takes them all
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(woken.wait(), self.poll_s)
                    if not woken.is_set():
                        yield Batch([], [], [])
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _listen(self, woken: asyncio.Event) -> None:
        async for _ in self.broker.subscribe(self.run.id):
            woken.set()

    async def _after(self, cursor: int) -> list[Metric]:
        async with self.db.session() as session:
            query = (select(Metric).where(Metric.run_id == self.run.id, Metric.id > cursor)
                     .order_by(Metric.id).limit(BATCH))
            return list(await session.scalars(query))

    async def _samples_after(self, cursor: int) -> list[Sample]:
        async with self.db.session() as session:
            query = (select(Sample).where(Sample.run_id == self.run.id, Sample.id > cursor)
                     .order_by(Sample.id).limit(BATCH))
            return list(await session.scalars(query))

    async def _checkpoints_after(self, cursor: int) -> list[Checkpoint]:
        """Checkpoints saved after `cursor`, but not unnamed sampler snapshots already expired (the page lists none)."""
        async with self.db.session() as session:
            query = select(Checkpoint).where(Checkpoint.run_id == self.run.id, Checkpoint.id > cursor).order_by(Checkpoint.id)
            now = utcnow().replace(tzinfo=None)
            return [row for row in await session.scalars(query)
                    if row.expires_at is None or row.expires_at.replace(tzinfo=None) > now]
