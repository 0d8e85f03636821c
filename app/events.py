"""Training events, per run, for the `metrics` subscription and the dashboard's stream, from every process.

`EventBroker` fans events out to this process's subscribers. `MetricFeed` feeds it: metric rows become events
whichever server process wrote them. On PostgreSQL a dedicated LISTEN connection (asyncpg) receives each
write's NOTIFY, whose payload carries ids only (NOTIFY stops at 8000 bytes), and the rows are read by id; on
(re)connecting it backfills by metrics.id. SQLite has no NOTIFY: there the feed reads rows after a cursor
(metrics.id), at once for this process's writes and every POLL_SECONDS for other processes': a fallback that
is fine on one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from datetime import datetime
from typing import TypeAlias

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Database
from app.pg_listen import listen
from app.tables import Metric

log = logging.getLogger("signal.events")

CHANNEL = "signal_metrics"
POLL_SECONDS = 0.5  # SQLite only: how soon points written by another server process reach this one's subscribers
RECENT_IDS = 10_000  # ids already published, remembered so a NOTIFY and a backfill never send a point twice
# Each metric's event kind: the names RunService records for each primitive.
# A loss is recorded as name:reduction (`loss:mean`, `loss:sum`); rows written before reductions are named `loss`.
LOSS_METRICS = ("loss:mean", "loss:sum", "loss")
METRIC_KINDS = {**dict.fromkeys(LOSS_METRICS, "forward_backward"), "num_tokens": "forward_backward",
                "num_examples": "forward_backward", "grad_norm": "optim_step", "learning_rate": "optim_step"}
COUNTS = {"num_tokens", "num_examples"}
# One recorded call's points: run_id, kind, step, created_at, and each metric the call wrote by its name.
MetricEvent: TypeAlias = dict[str, str | int | float | datetime]


class EventBroker:
    def __init__(self, queue_size: int = 1000) -> None:
        self._queue_size = queue_size
        self._subscribers: dict[str, set[asyncio.Queue[MetricEvent]]] = defaultdict(set)
        self._watchers: dict[str, set[asyncio.Event]] = defaultdict(set)  # woken by `touch`, not sent events

    def publish(self, run_id: str, event: MetricEvent) -> None:
        for queue in list(self._subscribers.get(run_id, ())):
            if queue.full():
                queue.get_nowait()  # a slow subscriber loses its oldest event, never blocks training
            queue.put_nowait(event)

    def touch(self, run_id: str) -> None:
        """This process just committed rows of the run that carry no metric event (a sample, a checkpoint): its
        watchers (the run page's streams) read them now rather than at their next poll."""
        for woken in list(self._watchers.get(run_id, ())):
            woken.set()

    @contextlib.contextmanager
    def watching(self, run_id: str, woken: asyncio.Event) -> Iterator[None]:
        """`woken` is set by each `touch` of the run while the block runs."""
        self._watchers[run_id].add(woken)
        try:
            yield
        finally:
            self._watchers[run_id].discard(woken)
            if not self._watchers[run_id]:
                del self._watchers[run_id]

    def subscriber_count(self, run_id: str) -> int:
        return len(self._subscribers.get(run_id, ()))

    def watched_runs(self) -> list[str]:
        return list(self._subscribers)

    async def subscribe(self, run_id: str) -> AsyncIterator[MetricEvent]:
        queue: asyncio.Queue[MetricEvent] = asyncio.Queue(self._queue_size)
        self._subscribers[run_id].add(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers[run_id].discard(queue)
            if not self._subscribers[run_id]:
                del self._subscribers[run_id]


class MetricFeed:
    """Metric rows → events in this process's broker, whichever process wrote them (see the module's doc)."""

    def __init__(self, db: Database, broker: EventBroker) -> None:
        self.db = db
        self.broker = broker
        self.notifies = db.url.startswith("postgresql")
        self._written = asyncio.Event()
        self._cursor = 0  # every row up to here was published (or had no subscriber then)
        self._recent: deque[int] = deque(maxlen=RECENT_IDS)
        self._recent_set: set[int] = set()
        self._task: asyncio.Task[None] | None = None

    async def announce(self, session: AsyncSession, run_id: str, ids: list[int]) -> None:
        """Inside the writer's transaction: PostgreSQL delivers the NOTIFY at commit, to every process."""
        if self.notifies and ids:
            await session.execute(select(func.pg_notify(CHANNEL, json.dumps({"run": run_id, "ids": ids}))))

    def written(self, run_id: str | None = None) -> None:
        """After the writer's commit: on SQLite, this process's subscribers need not wait for the next poll; the run's
        dashboard streams read its new samples and checkpoints now (they are no metric events)."""
        self._written.set()
        if run_id is not None:
            self.broker.touch(run_id)

    async def start(self) -> None:
        self._cursor = await self._top()
        self._task = asyncio.create_task(self._listen() if self.notifies else self._poll())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- SQLite: read after the cursor -----------------------------------------------------

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._written.wait(), POLL_SECONDS)
            self._written.clear()
            try:
                await self._catch_up()
            except SQLAlchemyError as error:
                log.warning("live metrics: reading new points failed (%s); trying again", error)

    async def _catch_up(self) -> None:
        """Publish rows after the cursor for the runs watched here; the cursor moves past all rows either way."""
        top = await self._top()
        runs = self.broker.watched_runs()
        if runs and top > self._cursor:
            query = (select(Metric).where(Metric.id > self._cursor, Metric.id <= top, Metric.run_id.in_(runs))
                     .order_by(Metric.id))
            async with self.db.session() as session:
                self._publish(await session.scalars(query))
        self._cursor = max(self._cursor, top)

    async def _top(self) -> int:
        async with self.db.session() as session:
            return int(await session.scalar(select(func.max(Metric.id))) or 0)

    # ---- PostgreSQL: LISTEN, read by id, backfill on (re)connect -----------------------------

    async def _listen(self) -> None:
        await listen(self.db.url, CHANNEL, self._catch_up, lambda payload: self._deliver(json.loads(payload)),
                     "live metrics")

    async def _deliver(self, notice: Mapping[str, object]) -> None:
        # PostgreSQL's NOTIFY payload, as _announce wrote it: {run, ids}.
        listed = notice.get("ids")
        ids = [int(i) for i in (listed if isinstance(listed, list) else []) if int(i) not in self._recent_set]
        if ids and self.broker.subscriber_count(str(notice.get("run"))):
            async with self.db.session() as session:
                self._publish(await session.scalars(select(Metric).where(Metric.id.in_(ids)).order_by(Metric.id)))
        self._cursor = max([self._cursor, *ids])

    # ---- both ------------------------------------------------------------------------------

    def _publish(self, rows: Iterable[Metric]) -> None:
        fresh = [row for row in rows if row.id not in self._recent_set]
        for row in fresh:
            if len(self._recent) == self._recent.maxlen:
                self._recent_set.discard(self._recent[0])
            self._recent.append(row.id)
            self._recent_set.add(row.id)
        for event in events_from_rows(fresh):
            self.broker.publish(str(event["run_id"]), event)


def events_from_rows(rows: Iterable[Metric]) -> list[MetricEvent]:
    """One event per recorded call: the rows one call wrote share run, kind, step and time."""
    events: dict[tuple[str, str, int, datetime], MetricEvent] = {}
    for row in rows:
        kind = METRIC_KINDS.get(row.name)
        if kind is None:
            continue
        key = (row.run_id, kind, row.step, row.created_at)
        event = events.setdefault(key, {"run_id": row.run_id, "kind": kind, "step": row.step, "created_at": row.created_at})
        event[row.name] = int(row.value) if row.name in COUNTS else row.value
        if row.name in LOSS_METRICS:  # a training event's `loss`, whichever reduction its call used
            event["loss"] = row.value
    return list(events.values())
