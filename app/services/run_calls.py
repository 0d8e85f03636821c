"""The one skeleton every call on a run goes through (RunCalls, which each of RunService's parts holds).

Ownership first (another user's run is "not found", never data), its arguments checked, the ledger's credit check,
then in the run's order (its ticket: call_order.py) the runtime call, and the call recorded once: its call record, result
and compute seconds in one transaction (call_records.py), which a retry of an applied call completes if it never ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable
from datetime import UTC
from typing import Any, TypeVar

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import A, Backend, Progress
from app.catalog import Catalog
from app.db import Database
from app.errors import FailedPrecondition, RunNotFound, SignalError
from app.events import MetricFeed
from app.services.call_order import CallOrder, Numbered
from app.services.call_records import Caller, CallRecorder
from app.services.deadlines import Deadline, Streamed, answered
from app.services.ledger import Ledger
from app.services.run_specs import fields_renamed, graphql_field
from app.services.sample_shares import SampleShares
from app.services.throttle import sent_until_taken
from app.settings import DEADLINES_S, RECORD_RETRY_S
from app.tables import Checkpoint, Metric, Run, User, could_be_id, new_id, utcnow
from gpu_runtime.client.allocation import PoolKey
from gpu_runtime.contract import LOADABLE_KINDS, Call, Cancel, Ping, RuntimeOptions

T = TypeVar("T")
C = TypeVar("C", bound=Call)
# What a primitive records of its answer `A`, inside the call's one recording transaction (`fresh`: its first).
Record = Callable[[AsyncSession, Run, A, bool], Awaitable[T]]

FAILED = "failed"  # runs.status once the runtime no longer has the run (else "active", the column's default)


class RunCalls:
    """Every dependency of RunService, and the skeleton its primitives share (`_apply`)."""

    def __init__(self, db: Database, backend: Backend, catalog: Catalog, feed: MetricFeed,
                 default_model: str, ledger: Ledger, bounds: RuntimeOptions | None = None,
                 record_retry_s: float = RECORD_RETRY_S, deadlines: dict[str, float] | None = None) -> None:
        self.db = db
        self.deadlines = deadlines or DEADLINES_S  # each method's (SIGNAL_DEADLINES_S; deadlines.py)
        self.recorder = CallRecorder(db, ledger, record_retry_s)  # each applied call recorded once (issue 19 §5)
        # The per-call size bounds (SIGNAL_MAX_SAMPLE_ROWS…): checked here before a call leaves, by the runtime again.
        self.bounds = bounds or RuntimeOptions()
        self.ledger = ledger  # compute seconds, credits and the billing service (docs/BILLING.md)
        self.default_model = default_model
        self.backend = backend
        self.catalog = catalog
        self.feed = feed
        self.devices: dict[PoolKey, str] = {}  # pool → its runtime's device, for pricing base samples
        # A run's calls in one order across processes: tickets, in the callers' numbers (seq, session).
        self.order = CallOrder(db)
        # A check of another client's claim on the run before each primitive (Tinker's: app/services/tinker_sessions.py
        # refuses Signal's own calls on a run a live Tinker session drives); None: no check.
        self.claim: Callable[[Run, str], Awaitable[None]] | None = None
        # Each user's sample calls in flight, from every wire, within SIGNAL_MAX_USER_SAMPLES_IN_FLIGHT (sample_shares.py).
        self.shares = SampleShares()

    # ---- ownership -----------------------------------------------------------------------

    async def get(self, user: User, run_id: str) -> Run:
        async with self.db.session() as session:
            run = await session.get(Run, run_id) if could_be_id(run_id) else None
        if run is None or run.user_id != user.id:
            # Not echoed when it cannot be an id: the dashboard would print `/runs/%00` as '\x00'.
            raise RunNotFound(f"run {run_id!r} not found" if could_be_id(run_id) else "no run has that id",
                              field="runId")
        return run

    async def readable(self, user: User, run_id: str, snapshot: str | None, checkpoint: str | None) -> Run:
        """The run whose frozen weights a call reads: the caller's own, or another user's when the source is published:
        the row the runtime reads by that name (the snapshot; else state, then adapter, as it looks) is public and
        unexpired. Anything else is "not found", as another user's run always is."""
        async with self.db.session() as session:
            run = await session.get(Run, run_id) if could_be_id(run_id) else None
            if run is not None and run.user_id != user.id:
                kinds = ("sampler",) if snapshot is not None else LOADABLE_KINDS
                rows = {row.mode: row for row in await session.scalars(select(Checkpoint).where(
                    Checkpoint.run_id == run.id, Checkpoint.mode.in_(kinds),
                    Checkpoint.name == (snapshot if snapshot is not None else checkpoint)))}
                read = next((rows[kind] for kind in kinds if kind in rows), None)
                if read is None or not read.public or not unexpired(read) or (snapshot is None and checkpoint is None):
                    run = None
        if run is None:
            return await self.get(user, run_id)  # its "not found", worded as for any run
        return run

    # ---- one skeleton for the four primitives ----------------------------------------------

    async def apply(self, user: User, run_id: str, operation: str, request_id: str | None,
                     arguments: Callable[[Run], Call[A]], record: Record[A, T],
                     allowed: Callable[[], Awaitable[dict[str, object]]] | None = None, order: Numbered | None = None,
                     progress: Progress | None = None) -> T:
        """A primitive on the caller's run: its `arguments` checked (before anyone is asked about credits), the call
        allowed by the ledger, then in the run's order the runtime call, and the call recorded once: `record` writes
        what it records in that transaction (`fresh`: its first recording; call_records.py). A call without a
        request id gets one here, so its retries and its record have a key. `allowed` adds arguments that only a call allowed to run may fetch.
        `order`: the SDK's number for the call, which puts it in the run's order after its session's previous one.
        Its deadline counts from here, less its wait for its place in the run's order; the runtime counts from when
        the call can run (deadlines.py)."""
        deadline = Deadline.start(self.deadlines, operation)
        run = await self.get(user, run_id)
        if operation != "save_state":  # an archived run's weights can still be exported
            refuse_archived(run, operation)
        if self.claim is not None:
            await self.claim(run, operation)
        request = self.checked(sent_as(arguments(run), request_id=request_id))
        request_id = await self.ledger.allow(user, run, operation, request_id or new_id())
        request = sent_as(request, request_id=request_id, **(await allowed() if allowed is not None else {}))

        streamed = Streamed.of(progress)

        async def work(ticket: int, sent: Callable[[], None]) -> T:
            result = await self.answered(deadline, pool_of(run), user, request_id,
                                          self.on_run(run, request, streamed, ticket, sent), streamed)
            return await self.recorded(run, operation, request_id, result, record)

        return await self.in_order(run.id, work, order, deadline)

    async def recorded(self, run: Run, operation: str, request_id: str, result: A, record: Record[A, T]) -> T:
        """The applied call recorded once, with what `record` writes, in one transaction (call_records.py)."""
        return await self.recorder.record(Caller.of(run), operation, request_id, result,
                                          lambda session, fresh: record(session, run, result, fresh),
                                          after=lambda: self.feed.written(run.id))

    def checked(self, request: C) -> C:
        """The contract's checks and size bounds, here before the call leaves (the runtime runs both again); errors
        name the field as the client sent it."""
        with fields_renamed(lambda field: field):
            request.validate()
            request.check_size(self.bounds)
        return request

    async def on_run(self, run: Run, request: Call[A], progress: Progress | None = None,
                      ticket: int | None = None, sent: Callable[[], None] | None = None) -> A:
        """A runtime call on a run the database holds. The runtime answering that it has no such run means its
        files are gone for good: the run is marked failed (runs.status), and the caller gets NOT_FOUND."""
        try:
            return await self.engine(request, pool=pool_of(run), progress=progress, ticket=ticket, sent=sent)
        except RunNotFound:
            async with self.db.session() as session:
                await session.execute(update(Run).where(Run.id == run.id).values(status=FAILED))
            raise

    async def answered(self, deadline: Deadline, pool: PoolKey, user: User, request_id: str,
                        call: Awaitable[A], streamed: Streamed | None = None) -> A:
        """The runtime's answer to `call`; at its deadline the runtime is asked to withdraw it, or, for a stream whose
        client has read text, to stop it and answer with what it has (deadlines.py)."""
        return await answered(deadline, call, lambda: self.engine(
            Cancel(request_id=request_id, user_id=user.id, deadline=streamed is None or not streamed.sent,
                   deadline_s=deadline.seconds), pool=pool),
                              f"{deadline.operation} {request_id} of user {user.id}")

    # ---- bookkeeping ---------------------------------------------------------------------

    async def in_order(self, run_id: str, call: Callable[[int, Callable[[], None]], Awaitable[T]],
                        order: Numbered | None = None, deadline: Deadline | None = None) -> T:
        """`call(ticket, sent)` in the run's order (call_order.py): its place in line waited for (time that does not
        count against its `deadline`: the call could not run), its ticket taken, and the run's turn held until the
        call has left for the runtime (`sent`), not until its answer, so a run's calls are pipelined. Run to the end
        even if the caller goes away: a call the runtime has taken is always recorded."""
        async def in_order() -> T:
            began = asyncio.get_running_loop().time()
            turn = await self.order.enter(run_id, order)
            if deadline is not None:
                deadline.exclude(asyncio.get_running_loop().time() - began)
            try:
                ticket = await self.order.ticket(run_id, order)
                left = asyncio.Event()
                task = asyncio.ensure_future(call(ticket, left.set))
                leaving = asyncio.ensure_future(left.wait())
                await asyncio.wait([task, leaving], return_when=asyncio.FIRST_COMPLETED)
                leaving.cancel()
            finally:
                turn.release()
            return await task

        return await asyncio.shield(asyncio.ensure_future(in_order()))

    async def engine(self, request: Call[A], pool: PoolKey | None = None, progress: Progress | None = None,
                      ticket: int | None = None, sent: Callable[[], None] | None = None) -> A:
        async def call() -> A:
            return await self.backend.call(request, pool=pool, progress=progress, ticket=ticket, sent=sent)

        try:
            return await sent_until_taken(call)  # a refusal resent here only for callers that cannot (throttle.py)
        except SignalError as error:
            # The engine names fields as its contract does (max_tokens, base_model); clients sent maxTokens.
            if not error.field:
                raise
            raise type(error)(error.message, field=graphql_field(error.field)) from None

    async def off_the_queue(self, user: User, run_id: str, method: str, request_id: str | None,
                             arguments: Callable[[Run], Call[A]], record: Record[A, A],
                             progress: Progress | None = None,
                             frozen: tuple[str | None, str | None] | None = None) -> A:
        """A call on a run's frozen weights (a snapshot or checkpoint: docs/SNAPSHOTS.md): owned and billed like the
        run's calls, but it takes no ticket, so it waits for nothing queued on the run. `frozen` (snapshot, checkpoint)
        also lets another user read a published one (`readable`): allowed and billed as that reader's call on no run
        (as a base sample is), and nothing written to the owner's run."""
        deadline = Deadline.start(self.deadlines, method)
        run = await self.readable(user, run_id, *frozen) if frozen is not None else await self.get(user, run_id)
        refuse_archived(run, method)
        request = self.checked(sent_as(arguments(run), request_id=request_id))
        owner = run.user_id == user.id
        if owner:
            request_id = await self.ledger.allow(user, run, method, request_id or new_id())
        else:
            request_id = await self.ledger.allow_user(user, method, request_id or new_id(), run.base_model,
                                                      run.gpu_config)
        request = sent_as(request, request_id=request_id)

        streamed = Streamed.of(progress)

        async def work() -> A:
            result = await self.answered(deadline, pool_of(run), user, request_id,
                                          self.on_run(run, request, streamed), streamed)
            if owner:
                return await self.recorded(run, method, request_id, result, record)

            async def nothing_on_the_run(session: AsyncSession, fresh: bool) -> A:
                return result

            return await self.recorder.record(Caller(user.id, None, run.base_model, run.device, run.gpu_config),
                                              method, request_id, result, nothing_on_the_run)

        return await asyncio.shield(asyncio.ensure_future(work()))  # recorded even if the caller goes away

    async def device(self, pool: PoolKey) -> str:
        """The device a pool's runtime computes on (its ping), asked once per pool: what a base sample is priced by."""
        if pool not in self.devices:
            self.devices[pool] = (await self.backend.call(Ping(), pool=pool)).device
        return self.devices[pool]

    async def metrics(self, session: AsyncSession, run_id: str, step: int, values: dict[str, float]) -> None:
        """A call's metric rows, in its recording transaction; every server process's subscribers get them as one
        event once it commits (events.MetricFeed)."""
        now = utcnow()
        # NaN is no point on a curve, and SQLite would store it as NULL.
        rows = [Metric(run_id=run_id, step=int(step), name=name, value=float(value), created_at=now)
                for name, value in values.items() if math.isfinite(value)]
        session.add_all(rows)
        await session.flush()  # their ids, for the announcement
        await self.feed.announce(session, run_id, [row.id for row in rows])


def refuse_archived(run: Run, operation: str) -> None:
    if run.archived_at is not None:
        raise FailedPrecondition(f"run {run.id} is archived: unarchive it to {operation} (unarchiveRun, "
                                 "run.unarchive(), or the run's page)", field="runId")


def sent_as(request: C, **changes: Any) -> C:
    """The request with fields set after its checks: the request id a call gets once allowed, a Hub token."""
    return dataclasses.replace(request, **changes)


def pool_of(run: Run) -> PoolKey:
    """The run's pool: on Modal, the warm container its calls go to (base model, GPU configuration, quantization)."""
    return PoolKey.of(run.base_model, run.gpu_config, run.quantization or None)


def unexpired(row: Checkpoint) -> bool:
    """SQLite hands datetimes back naive (stored as UTC)."""
    if row.expires_at is None:
        return True
    moment = row.expires_at if row.expires_at.tzinfo is not None else row.expires_at.replace(tzinfo=UTC)
    return moment > utcnow()
