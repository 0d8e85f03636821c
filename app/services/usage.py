"""Usage (issue 18 §6): compute seconds, GPU-seconds, cost and tokens trained and sampled, per run, per day and per
user, read from `call_records` (one row per applied call, call_records.py). A user sees their own; an admin sees
every user's, and anyone's in detail.

Cost is in credits at the rates in force when each call was recorded (SIGNAL_GPU_SECOND_RATE, SIGNAL_CPU_SECOND_RATE).
Calls applied before call records existed (migration 0014) are not in it: the run's running total still counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from sqlalchemy import case, func, select

from app.db import Database
from app.errors import BadInput, NotFound
from app.services.users import require_admin
from app.tables import CallRecord, Run, User, could_be_id, utcnow

MAX_DAYS = 366  # the longest window the view adds up
DEFAULT_DAYS = 30


@dataclass(frozen=True)
class Usage:
    """One line of usage: a run's, a day's, a user's, or the whole window's."""

    key: str  # the run id, the day (YYYY-MM-DD), the user id; "" for totals
    label: str  # the run's name, the day, the user's email
    calls: int = 0
    compute_seconds: float = 0.0
    gpu_seconds: float = 0.0
    credits: float = 0.0
    tokens_trained: int = 0  # forward_backward's weighted target tokens
    tokens_sampled: int = 0  # sample's generated tokens
    tokens_prompted: int = 0  # sample's prompt tokens (each prompt once per sequence made from it)
    tokens_cached: int = 0  # of those, found in the decode cache rather than prefilled again


@dataclass(frozen=True)
class UsageReport:
    user: User  # whose usage it is
    days: int
    since: date
    total: Usage
    by_day: list[Usage]  # newest first
    by_run: list[Usage]  # most compute first
    run_id: str | None = None  # the one run the report is narrowed to (its days), or None for all the user's runs


def _sums() -> list[Any]:
    trained = case((CallRecord.operation == "forward_backward", CallRecord.tokens_in), else_=0)
    sampled = case((CallRecord.operation == "sample", CallRecord.tokens_out), else_=0)
    prompted = case((CallRecord.operation == "sample", CallRecord.tokens_in), else_=0)
    return [func.count(), func.coalesce(func.sum(CallRecord.compute_seconds), 0.0),
            func.coalesce(func.sum(CallRecord.gpu_seconds), 0.0), func.coalesce(func.sum(CallRecord.credits), 0.0),
            func.coalesce(func.sum(trained), 0), func.coalesce(func.sum(sampled), 0),
            func.coalesce(func.sum(prompted), 0), func.coalesce(func.sum(CallRecord.tokens_cached), 0)]


def _usage(key: Any, label: Any, sums: Any) -> Usage:
    calls, compute, gpu, credits, trained, sampled, prompted, cached = sums
    return Usage(str(key or ""), str(label or ""), int(calls), float(compute), float(gpu), float(credits), int(trained),
                 int(sampled), int(prompted), int(cached))


def _since(days: int) -> datetime:
    """The window's first moment: midnight UTC, `days - 1` days before today."""
    return datetime.combine(utcnow().date() - timedelta(days=days - 1), time(), tzinfo=UTC)


class UsageService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def report(self, viewer: User, user_id: str | None = None, days: int = DEFAULT_DAYS,
                     run_id: str | None = None) -> UsageReport:
        """`viewer`'s usage over the last `days` days (today included), or, for an admin, `user_id`'s; with `run_id`,
        that one run's (per run over time): only the user's own records are read, so another's run adds up to 0."""
        _check_days(days)
        user = viewer
        if user_id and user_id != viewer.id:
            require_admin(viewer, "read another user's usage")
            async with self.db.session() as session:
                found = await session.get(User, user_id) if could_be_id(user_id) else None
            if found is None:
                raise NotFound("no user has that id", field="user")
            user = found
        since = _since(days)
        mine = (CallRecord.user_id == user.id, CallRecord.created_at >= since,
                *((CallRecord.run_id == run_id,) if run_id else ()))
        day = func.date(CallRecord.created_at)
        async with self.db.session() as session:
            total = (await session.execute(select(*_sums()).where(*mine))).one()
            daily = await session.execute(select(day, *_sums()).where(*mine).group_by(day).order_by(day.desc()))
            runs = await session.execute(
                select(CallRecord.run_id, Run.name, *_sums()).outerjoin(Run, Run.id == CallRecord.run_id)
                .where(*mine).group_by(CallRecord.run_id, Run.name)
                .order_by(func.sum(CallRecord.compute_seconds).desc()))
            return UsageReport(
                user=user, days=days, since=since.date(), total=_usage("", "total", total),
                by_day=[_usage(row[0], row[0], row[1:]) for row in daily],
                by_run=[_usage(row[0], row[1] if row[0] else "base models (no run)", row[2:]) for row in runs],
                run_id=run_id or None)

    async def by_user(self, viewer: User, days: int = DEFAULT_DAYS) -> list[Usage]:
        """Every user's usage over the window, most compute first: the admin's view."""
        require_admin(viewer, "read every user's usage")
        _check_days(days)
        async with self.db.session() as session:
            rows = await session.execute(
                select(CallRecord.user_id, User.email, *_sums()).outerjoin(User, User.id == CallRecord.user_id)
                .where(CallRecord.created_at >= _since(days))
                .group_by(CallRecord.user_id, User.email).order_by(func.sum(CallRecord.compute_seconds).desc()))
            return [_usage(row[0], row[1] or row[0], row[2:]) for row in rows]


def _check_days(days: int) -> None:
    if not 1 <= days <= MAX_DAYS:
        raise BadInput(f"days must be in 1..{MAX_DAYS}, got {days}", field="days")
