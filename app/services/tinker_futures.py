"""Tinker's futures (docs/TINKER.md): a row per submitted operation, inserted before it is dispatched, its result
stored once, encoded; polls long-wait on an in-process event and hold no database connection while they wait.

Keys: the row is unique on (key_kind, key_scope, key_seq) (tables.TinkerFuture says which kinds). A resubmission
(the SDK resubmits after timeouts and 5xx with a fresh idempotency header) loses the insert and gets the first
row's request_id; it dispatches nothing. Results are encoded once by the submitting process: protobuf bytes for
ForwardBackwardOutput and SampleResponse, JSON otherwise; a failure is stored as `{"error", "category"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import math
import os
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Database
from app.errors import BadInput, NotFound, SignalError, Unauthenticated, http_status
from app.pg_listen import listen
from app.services.streams import hold
from app.services.throttle import throttled
from app.services.tinker_sessions import SessionEnded, session_of, tinker_call
from app.tables import TinkerFuture, User, could_be_id, new_id, utcnow
from gpu_runtime.contract import MAX_SAMPLES

log = logging.getLogger("signal.tinker")

JSON_TYPE = "application/json"
PROTO_TYPE = "application/x-protobuf"
POLL_SECONDS = 30.0  # a pending poll answers try_again after this (SIGNAL_TINKER_POLL_S); the SDK's timeout is 45 s
POLL_SECONDS_MAX = 40.0
SHARED_POLL_SECONDS = 0.5  # SQLite: one query per process this often finds other processes' completions polls wait for
CHANNEL = "signal_tinker_futures"  # PostgreSQL: a completion's NOTIFY (payload: its request_id; RECHECK: look at all)
RECHECK = "*"
HEARTBEAT_SECONDS = 10.0  # each owner process marks its pending rows alive (and sweeps expired ones) this often…
OWNER_SILENCE = timedelta(seconds=60)  # …and a pending row whose owner has been silent this long fails (server)


Check = Callable[[], Awaitable[object]]
# The submitting request's credential check (app/tinker/endpoint.py sets it): a pending future's work runs it every
# SIGNAL_SESSION_RECHECK_S and fails once it raises UNAUTHENTICATED (the key revoked, its user disabled).
credential: contextvars.ContextVar[Check | None] = contextvars.ContextVar("credential", default=None)
_revoked: contextvars.ContextVar[asyncio.Future[None] | None] = contextvars.ContextVar("revoked", default=None)


def ended() -> asyncio.Future[None]:
    """Inside a future's work: done once its credential is revoked (a sample is then withdrawn where it is:
    RunSampling.sample_unless_gone); elsewhere, never."""
    revoked = _revoked.get()
    return revoked if revoked is not None else asyncio.get_running_loop().create_future()


@dataclass(frozen=True)
class Answer:
    """What retrieve_future answers: a stored result (bytes of `media_type`), or None while pending; or, while the
    runtime refuses the work for too many calls in flight and this process waits to send it again, a 429 that
    says when (the SDK backs off and polls again)."""

    media_type: str
    body: bytes
    status: int = 200
    retry_after_s: float | None = None


def failure(exc: BaseException) -> dict[str, str]:
    """A failed future's JSON: the user's fault (a typed 4xx error: bad datum, unknown checkpoint) or the server's."""
    if isinstance(exc, SignalError):
        return {"error": exc.message, "category": "user" if http_status(exc) < 500 else "server"}
    return {"error": f"internal error: {type(exc).__name__}", "category": "server"}


class TinkerFutures:
    def __init__(self, db: Database, poll_seconds: float, result_ttl_s: float, recheck_s: float = 15.0) -> None:
        self.db = db
        self.recheck_s = recheck_s  # SIGNAL_SESSION_RECHECK_S: how soon a revoked key's pending futures fail
        self.poll_seconds = min(poll_seconds, POLL_SECONDS_MAX)
        self.result_ttl = timedelta(seconds=result_ttl_s)  # a finished future stays retrievable this long
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.notifies = db.url.startswith("postgresql")
        self._done: dict[str, asyncio.Event] = {}  # request_id → set when this process stored its result
        self._paused: dict[str, float] = {}  # request_id → when its refused work is sent again (loop time)
        self._remote: dict[str, asyncio.Event] = {}  # another process's pending futures that polls here wait on
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self.chores: list[Callable[[], Awaitable[object]]] = []  # run after each heartbeat (Services.build adds them)
        # A session id → SessionEnded once it is closed or lapsed (Services.build sets TinkerSessions.alive).
        self.alive: Callable[[str], Awaitable[None]] | None = None

    def start(self) -> None:
        """The owner heartbeat, and what wakes waits on other processes' futures: LISTEN on PostgreSQL, else the
        shared poll."""
        wake = listen(self.db.url, CHANNEL, self._check_remote, self._notified, "tinker futures") if self.notifies \
            else self._shared_poll()
        self._background = [asyncio.create_task(self._heartbeat()), asyncio.create_task(wake)]

    async def submit(self, user: User, key: tuple[str, str, int], request_type: str,
                     work: Callable[[str], Awaitable[tuple[str, bytes]]], samples: int = 0,
                     unsent: Callable[[], None] | None = None) -> TinkerFuture:
        """Insert the future's row, then dispatch `work(request_id)` (which returns (media type, bytes)) in the background; the
        loser of an insert race (or a resubmission) gets the winner's row and dispatches nothing (`unsent` is called)."""
        if not 0 <= samples <= MAX_SAMPLES:  # one id per sample is built below: bounded first, whatever the caller
            raise BadInput(f"num_samples must be in 1..{MAX_SAMPLES}, got {samples}", field="num_samples")
        request_id = new_id()
        row = TinkerFuture(request_id=request_id, user_id=user.id, key_kind=key[0], key_scope=key[1], key_seq=key[2],
                           request_type=request_type, owner=self.owner,
                           sample_sequence_ids=[f"{request_id}:{i}" for i in range(samples)])
        try:
            async with self.db.session() as session:
                session.add(row)
        except IntegrityError:
            async with self.db.session() as session:
                winner = await session.scalar(select(TinkerFuture).where(
                    TinkerFuture.key_kind == key[0], TinkerFuture.key_scope == key[1], TinkerFuture.key_seq == key[2]))
            if unsent is not None:
                unsent()
            if winner is None or winner.user_id != user.id:
                raise NotFound(f"{key[1]} not found", field="model_id") from None
            return winner
        self._done[request_id] = asyncio.Event()
        task = asyncio.create_task(self._run(request_id, work, self._check(credential.get(), session_of(key[1]))))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return row

    def _check(self, key: Check | None, session_id: str) -> Check | None:
        """What a pending future re-checks every recheck_s: its submitter's key, then its session."""
        alive = self.alive
        if alive is None:
            return key

        async def both() -> None:
            if key is not None:
                await key()
            await alive(session_id)

        return both

    async def _run(self, request_id: str, work: Callable[[str], Awaitable[tuple[str, bytes]]],
                   check: Check | None) -> None:
        state = "done"
        tinker_call.set(True)  # this task's calls on a run are the Tinker session's own (TinkerSessions.claim)
        throttled.set(lambda delay: self._pause(request_id, delay))  # its refused calls are resent (throttle.py)
        try:
            media_type, body = await self._unless_revoked(work, request_id, check)
        except Exception as exc:  # every failure is the future's answer, never a lost poll
            if not isinstance(exc, SignalError):
                log.exception("tinker future %s failed", request_id)
            state, media_type, body = "failed", JSON_TYPE, json.dumps(failure(exc)).encode()
        try:
            async with self.db.session() as session:
                await session.execute(update(TinkerFuture).where(TinkerFuture.request_id == request_id).values(
                    state=state, media_type=media_type, result=body, finished_at=utcnow()))
                await self._announce(session, request_id)
        finally:
            self._paused.pop(request_id, None)
            event = self._done.pop(request_id, None)
            if event is not None:
                event.set()

    async def _unless_revoked(self, work: Callable[[str], Awaitable[tuple[str, bytes]]], request_id: str,
                              check: Check | None) -> tuple[str, bytes]:
        """`work`'s answer, or UNAUTHENTICATED (CANCELLED: its session ended) once `check` (the submitter's key and
        session, every recheck_s) raises it: the work hears it through `ended()` (a sample is withdrawn) and is left
        to end on its own (a training call the runtime has taken is still recorded), while the future fails now."""
        if check is None:
            return await work(request_id)
        revoked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        _revoked.set(revoked)  # this task's context, which the work's task copies
        task = asyncio.ensure_future(work(request_id))
        while True:
            done, _ = await asyncio.wait([task], timeout=self.recheck_s)
            if done:
                return task.result()
            try:
                await check()
            except (Unauthenticated, SessionEnded) as error:
                log.info("tinker future %s: %s; the future fails", request_id, error.message)
                revoked.set_result(None)
                hold(task)  # referenced until it ends (a bare task may be collected)
                task.add_done_callback(lambda ended: ended.cancelled() or ended.exception())  # its end is not news
                if isinstance(error, SessionEnded):
                    raise error from None
                raise Unauthenticated(f"{error.message}: this operation was stopped") from None
            except (SignalError, SQLAlchemyError, OSError) as error:  # the database away: asked again next round
                log.warning("tinker future %s: its key could not be checked: %s", request_id, error)

    def _pause(self, request_id: str, delay: float | None) -> None:
        if delay is None:
            self._paused.pop(request_id, None)
        else:
            self._paused[request_id] = asyncio.get_running_loop().time() + delay

    def _throttled(self, request_id: str) -> Answer | None:
        """A 429 while this process waits to send the future's refused work again (None: it is not waiting)."""
        until = self._paused.get(request_id)
        if until is None:
            return None
        seconds = max(until - asyncio.get_running_loop().time(), 0.0)
        body = {"detail": f"too many calls in flight: this operation is sent again in {seconds:.1f} s",
                "category": "server"}
        return Answer(JSON_TYPE, json.dumps(body).encode(), status=429, retry_after_s=seconds)

    async def retrieve(self, user: User, request_id: str) -> Answer | None:
        """The future's stored answer, waiting up to `poll_seconds` while it is pending (then None: try_again).
        NotFound for ids unknown, expired or another user's. The wait holds no database connection: it is woken by
        this process's completion, or another process's: its NOTIFY (PostgreSQL) or the shared poll (SQLite)."""
        deadline = asyncio.get_running_loop().time() + self.poll_seconds
        while True:
            # The event before the read: a completion announced after the read still wakes this wait.
            event = self._done.get(request_id) or self._remote.setdefault(request_id, asyncio.Event())
            row = await self._row(request_id)
            if row is None or row.user_id != user.id or (
                    row.finished_at is not None and utcnow() - row.finished_at > self.result_ttl):
                self._wake(request_id)
                raise NotFound(f"future {request_id!r} not found", field="request_id")
            if row.state != "pending":
                self._wake(request_id)  # another poll may wait on the same event: it reads the row again
                return Answer(row.media_type, row.result or b"")
            if (paused := self._throttled(request_id)) is not None:
                return paused
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0 or self._closing.is_set():
                return None
            waits = [asyncio.ensure_future(self._closing.wait()), asyncio.ensure_future(event.wait())]
            _, pending = await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()

    async def _announce(self, session: AsyncSession, request_id: str) -> None:
        """Inside the writer's transaction: PostgreSQL delivers the NOTIFY at commit, to every process."""
        if self.notifies:
            await session.execute(select(func.pg_notify(CHANNEL, request_id)))

    def _wake(self, request_id: str) -> None:
        if (event := self._remote.pop(request_id, None)) is not None:
            event.set()

    async def _notified(self, payload: str) -> None:
        if payload == RECHECK:
            await self._check_remote()
        else:
            self._wake(payload)

    async def _shared_poll(self) -> None:
        """SQLite: one query per SHARED_POLL_SECONDS for every future polled here that another process runs."""
        while not self._closing.is_set():
            await asyncio.sleep(SHARED_POLL_SECONDS)
            try:
                await self._check_remote()
            except (SQLAlchemyError, OSError) as exc:  # a locked database: the next round asks again
                log.warning("tinker futures: shared poll failed: %s", exc)

    async def _check_remote(self) -> None:
        """Wake the waits on other processes' futures that have finished (one query for all of them)."""
        waited = list(self._remote)
        if not waited:
            return
        async with self.db.session() as session:
            finished = set(await session.scalars(select(TinkerFuture.request_id).where(
                TinkerFuture.request_id.in_(waited), TinkerFuture.state != "pending")))
        for request_id in finished:
            self._wake(request_id)

    async def _heartbeat(self) -> None:
        """Mark this process's pending rows alive; fail the pending rows of owners silent for OWNER_SILENCE; delete
        the rows finished more than result_ttl ago (any process's: the delete is idempotent)."""
        lost = json.dumps({"error": "the server process running this operation stopped", "category": "server"})
        while not self._closing.is_set():
            try:
                now = utcnow()
                async with self.db.session() as session:
                    await session.execute(update(TinkerFuture).where(
                        TinkerFuture.owner == self.owner, TinkerFuture.state == "pending").values(heartbeat_at=now))
                    failed = await session.execute(update(TinkerFuture).where(
                        TinkerFuture.state == "pending", TinkerFuture.heartbeat_at < now - OWNER_SILENCE).values(
                        state="failed", media_type=JSON_TYPE, result=lost.encode(), finished_at=now))
                    if failed.rowcount:  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult
                        await self._announce(session, RECHECK)
                    await session.execute(delete(TinkerFuture).where(
                        TinkerFuture.finished_at < now - self.result_ttl))
            except (SQLAlchemyError, OSError) as exc:  # the next round tries again
                log.warning("tinker futures: heartbeat failed: %s", exc)
            for chore in self.chores:  # other housekeeping on the same clock (expired checkpoints)
                try:
                    await chore()
                except (SignalError, SQLAlchemyError, OSError) as exc:  # a runtime away, a locked database: next round
                    log.warning("tinker futures: housekeeping %s failed: %s", getattr(chore, "__name__", chore), exc)
            # A TTL shorter than the heartbeat (tests) is swept at its own pace, so rows never outlive it by much.
            await asyncio.sleep(min(HEARTBEAT_SECONDS, self.result_ttl.total_seconds()))

    async def _row(self, request_id: str) -> TinkerFuture | None:
        if not could_be_id(request_id):
            return None
        async with self.db.session() as session:
            return await session.get(TinkerFuture, request_id)

    async def close(self) -> None:
        """Shutdown: pending polls answer try_again at once; running operations are left to finish or fail (their
        rows fail OWNER_SILENCE after this process's last heartbeat, if it never stores them)."""
        self._closing.set()
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def json_answer(value: Mapping[str, object]) -> tuple[str, bytes]:
    """A JSON result as stored: non-finite numbers left out (JSON has none; the SDK would refuse NaN)."""
    return JSON_TYPE, json.dumps(_finite(value), allow_nan=False).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items() if not (isinstance(v, float) and not math.isfinite(v))}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
