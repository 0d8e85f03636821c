"""A run's reads and labels (RunReads): the runs list, a run's metrics, samples and checkpoints, archiving and
labelling. Nothing here calls the runtime."""

from __future__ import annotations

import builtins
import math
import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update

from app.errors import BadInput
from app.services.run_calls import RunCalls
from app.services.run_specs import RUN_SORTS, RunLabels, search_clause
from app.tables import BaseSample, Checkpoint, Metric, Run, Sample, User, utcnow

USER_METRIC = "user:"  # a user-reported metric's prefix in `metrics.name`: apart from the runtime's (loss, grad_norm)
MAX_USER_METRICS = 32  # names in one logMetrics call
USER_METRIC_NAME = re.compile(r"[A-Za-z0-9_.\-/]{1,59}")  # 59: the column's 64 less the prefix


def check_user_metrics(values: object) -> dict[str, float]:
    """Each name a short identifier, each value a finite number; BAD_INPUT names `metrics.<name>`."""
    if not isinstance(values, dict) or not values:
        raise BadInput("metrics must be a non-empty object of name: number", field="metrics")
    if len(values) > MAX_USER_METRICS:
        raise BadInput(f"{len(values)} metrics in one call; at most {MAX_USER_METRICS}", field="metrics")
    checked: dict[str, float] = {}
    for name, value in values.items():
        if not USER_METRIC_NAME.fullmatch(str(name)):
            raise BadInput(f"metric name {name!r} must be 1-59 letters, digits or _ . - /", field=f"metrics.{name}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BadInput(f"metric {name} must be a finite number, got {value!r}", field=f"metrics.{name}")
        checked[str(name)] = float(value)
    return checked

MAX_METRICS_LIMIT = 10_000  # most metric rows one read returns (a run's curve; the dashboard asks for 1,000)


class RunReads:
    def __init__(self, calls: RunCalls) -> None:
        self.calls = calls

    # ---- reading -------------------------------------------------------------------------

    async def list(self, user: User, limit: int = 50, search: str = "", sort: str = "newest",
                   archived: bool | None = False, offset: int = 0) -> list[Run]:
        """The user's runs in `sort`'s order (RUN_SORTS), those whose name, base model or a tag contain `search`;
        `archived` False: those not archived (the default list), True: the archived ones, None: both. `offset`
        skips that many: the id breaks every tie, so consecutive pages never share or skip a run."""
        if sort not in RUN_SORTS:
            raise BadInput(f"sort must be one of {', '.join(RUN_SORTS)}, got {sort!r}", field="sort")
        query = self._listed(user, search, archived).order_by(*RUN_SORTS[sort], Run.id)
        async with self.calls.db.session() as session:
            rows = await session.scalars(query.offset(max(0, int(offset))).limit(_clamp(limit)))
            return list(rows)

    async def count(self, user: User, search: str = "", archived: bool | None = False) -> int:
        """How many runs `list` pages through with the same filters (the runs list's "of N")."""
        query = select(func.count()).select_from(self._listed(user, search, archived).subquery())
        async with self.calls.db.session() as session:
            return int(await session.scalar(query) or 0)

    def _listed(self, user: User, search: str, archived: bool | None) -> Any:
        query = select(Run).where(Run.user_id == user.id)
        if archived is not None:
            query = query.where(Run.archived_at.is_not(None) if archived else Run.archived_at.is_(None))
        if search.strip():
            query = query.where(search_clause(search.strip()))
        return query

    async def archive(self, user: User, run_id: str, archived: bool = True) -> Run:
        """Archive a run (or unarchive it): hidden from the default list, its training and sampling refused with
        FAILED_PRECONDITION until unarchived; its files, checkpoints and history are kept."""
        run = await self.calls.get(user, run_id)
        if (run.archived_at is not None) != archived:
            async with self.calls.db.session() as session:
                await session.execute(update(Run).where(Run.id == run.id)
                                      .values(archived_at=utcnow() if archived else None))
        return await self.calls.get(user, run.id)

    async def log_metrics(self, user: User, run_id: str, values: object, step: int | None = None) -> int:
        """The user's own numbers for a step (a DPO loss, a reward), stored with the run's metrics under
        `user:<name>` and drawn on its page; `step` defaults to the run's current step. Answers the step."""
        run = await self.calls.get(user, run_id)
        checked = check_user_metrics(values)
        if step is None:
            step = run.step
        elif step < 0:
            raise BadInput(f"step must be 0 or more, got {step}", field="step")
        async with self.calls.db.session() as session:
            await self.calls.metrics(session, run.id, step, {USER_METRIC + name: value for name, value in checked.items()})
        self.calls.feed.written(run.id)
        return step

    async def label(self, user: User, run_id: str, labels: RunLabels) -> Run:
        """Rename a run, set its tags or its note; another user's run is not found."""
        run = await self.calls.get(user, run_id)
        values = labels.checked()
        if values:
            async with self.calls.db.session() as session:
                await session.execute(update(Run).where(Run.id == run.id).values(**values))
        return await self.calls.get(user, run.id)

    async def metrics(self, run: Run, name: str | None = None, limit: int = 1000) -> builtins.list[Metric]:
        if not 1 <= limit <= MAX_METRICS_LIMIT:
            raise BadInput(f"limit must be an integer in 1..{MAX_METRICS_LIMIT}, got {limit}", field="limit")
        query = select(Metric).where(Metric.run_id == run.id)
        if name:
            query = query.where(Metric.name == name)
        async with self.calls.db.session() as session:
            newest = list(await session.scalars(query.order_by(Metric.id.desc()).limit(limit)))
        return newest[::-1]  # the latest `limit` rows, in the order they happened

    async def samples(self, run: Run, limit: int = 100) -> builtins.list[Sample]:
        async with self.calls.db.session() as session:
            query = select(Sample).where(Sample.run_id == run.id).order_by(Sample.id.desc()).limit(_clamp(limit))
            return list(await session.scalars(query))

    async def sample_marks(self, run: Run) -> builtins.list[tuple[int, datetime]]:
        """Each step the run was sampled at, with its first sample's time: the run page's sample markers."""
        async with self.calls.db.session() as session:
            query = (select(Sample.step, func.min(Sample.created_at)).where(Sample.run_id == run.id)
                     .group_by(Sample.step).order_by(Sample.step))
            return [(int(step), _aware(first)) for step, first in await session.execute(query)]

    async def base_samples(self, user: User, limit: int = 100) -> builtins.list[BaseSample]:
        """The user's samples of base models alone (no run), newest first: their history as `samples` is a run's."""
        async with self.calls.db.session() as session:
            query = (select(BaseSample).where(BaseSample.user_id == user.id).order_by(BaseSample.id.desc())
                     .limit(_clamp(limit)))
            return list(await session.scalars(query))

    async def checkpoints(self, run: Run) -> builtins.list[Checkpoint]:
        """The run's checkpoints and sampler snapshots; unnamed snapshots past their expiry are gone from the runtime,
        so they are not listed."""
        async with self.calls.db.session() as session:
            query = select(Checkpoint).where(Checkpoint.run_id == run.id).order_by(Checkpoint.id)
            now = utcnow()
            return [row for row in await session.scalars(query)
                    if row.expires_at is None or _aware(row.expires_at) > now]

    async def published(self, run_id: str) -> builtins.list[Checkpoint]:
        """A run's published, unexpired checkpoints: what any signed-in user may see of another user's run."""
        async with self.calls.db.session() as session:
            query = select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.public.is_(True))
            now = utcnow()
            return [row for row in await session.scalars(query.order_by(Checkpoint.id))
                    if row.expires_at is None or _aware(row.expires_at) > now]


def _aware(moment: datetime) -> datetime:
    """SQLite hands datetimes back naive (they were stored as UTC)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _clamp(limit: int, most: int = 1000) -> int:
    return max(1, min(int(limit), most))
