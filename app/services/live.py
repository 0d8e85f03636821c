"""Live training metrics for both front ends: the GraphQL subscription and the dashboard's event stream.

Ownership is checked here, before anything streams. The dashboard's stream reads metric rows after a
cursor (`metrics.id`, which the browser sends back as Last-Event-ID), so a reconnect never repeats a
point and points written by another server process still arrive: the in-process broker only wakes the
reader early, a slow poll covers the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import select

from app.db import Database
from app.events import EventBroker
from app.services.runs import RunService
from app.tables import Metric, Run, User

BATCH = 500


class LiveMetrics:
    def __init__(self, db: Database, broker: EventBroker, runs: RunService) -> None:
        self.db = db
        self.broker = broker
        self.runs = runs

    async def events(self, user: User, run_id: str) -> AsyncIterator[dict[str, Any]]:
        """The run's training events as they happen (this process's only); RunNotFound before the first."""
        run = await self.runs.get(user, run_id)
        return self.broker.subscribe(run.id)

    async def open_stream(self, user: User, run_id: str, after_id: int = 0, poll_s: float = 2.0) -> MetricStream:
        """A stream of the run's metric rows with id > after_id; RunNotFound here, before it starts."""
        run = await self.runs.get(user, run_id)
        return MetricStream(self.db, self.broker, run, after_id, poll_s)


class MetricStream:
    def __init__(self, db: Database, broker: EventBroker, run: Run, after_id: int, poll_s: float) -> None:
        self.db = db
        self.broker = broker
        self.run = run
        self.cursor = max(0, after_id)
        self.poll_s = poll_s

    async def batches(self) -> AsyncIterator[list[Metric]]:
        """Lists of new rows in id order, forever; an empty list after each quiet poll (a keep-alive)."""
        woken = asyncio.Event()
        listener = asyncio.create_task(self._listen(woken))
        try:
            while True:
                woken.clear()  # cleared before reading: a publish during the read wakes the next wait
                rows = await self._after(self.cursor)
                while rows:
                    self.cursor = rows[-1].id
                    yield rows
                    rows = await self._after(self.cursor) if len(rows) == BATCH else []
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(woken.wait(), self.poll_s)
                if not woken.is_set():
                    yield []
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
