"""GraphQL types of the caller's account: users, API keys, and usage reports."""

from __future__ import annotations

from datetime import date, datetime

import strawberry

from app import tables
from app.services import usage


@strawberry.type
class User:
    id: strawberry.ID
    email: str
    name: str
    is_admin: bool
    created_at: datetime

    @classmethod
    def from_row(cls, row: tables.User) -> User:
        return cls(id=strawberry.ID(row.id), email=row.email, name=row.name, is_admin=row.is_admin,
                   created_at=row.created_at)


@strawberry.type
class ApiKey:
    id: strawberry.ID
    name: str
    prefix: str = strawberry.field(description="First characters of the secret, for recognising it")
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @strawberry.field
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_row(cls, row: tables.ApiKey) -> ApiKey:
        return cls(id=strawberry.ID(row.id), name=row.name, prefix=row.prefix, created_at=row.created_at,
                   last_used_at=row.last_used_at, revoked_at=row.revoked_at)


@strawberry.type
class CreatedApiKey:
    secret: str = strawberry.field(description="The key itself; shown this once, never stored")
    api_key: ApiKey


@strawberry.type(description="One line of usage: a run's, a day's, or the window's total, from the call records")
class UsageLine:
    key: str = strawberry.field(description="The run id (empty: base models alone), the day (YYYY-MM-DD), or empty")
    label: str = strawberry.field(description="The run's name, the day, or 'total'")
    calls: int
    compute_seconds: float
    gpu_seconds: float
    credits: float = strawberry.field(description="At the rates in force when each call was recorded")
    tokens_trained: int = strawberry.field(description="forwardBackward's weighted target tokens")
    tokens_sampled: int = strawberry.field(description="sample's generated tokens")
    tokens_prompted: int = strawberry.field(
        description="sample's prompt tokens, each prompt counted once per sequence made from it")
    tokens_cached: int = strawberry.field(
        description="of sample's prompt tokens, those found in the decode cache rather than prefilled again")

    @classmethod
    def of(cls, line: usage.Usage) -> UsageLine:
        return cls(key=line.key, label=line.label, calls=line.calls, compute_seconds=line.compute_seconds,
                   gpu_seconds=line.gpu_seconds, credits=line.credits, tokens_trained=line.tokens_trained,
                   tokens_sampled=line.tokens_sampled, tokens_prompted=line.tokens_prompted,
                   tokens_cached=line.tokens_cached)


@strawberry.type(description="A user's usage over the last `days` days (UTC, today included)")
class UsageReport:
    user_id: strawberry.ID
    days: int
    since: date
    total: UsageLine
    by_day: list[UsageLine] = strawberry.field(description="Newest day first; days without calls are left out")
    by_run: list[UsageLine] = strawberry.field(description="Most compute first")

    @classmethod
    def of(cls, report: usage.UsageReport) -> UsageReport:
        return cls(user_id=strawberry.ID(report.user.id), days=report.days, since=report.since,
                   total=UsageLine.of(report.total), by_day=[UsageLine.of(line) for line in report.by_day],
                   by_run=[UsageLine.of(line) for line in report.by_run])
