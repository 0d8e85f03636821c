"""A run's calls in one order, across server processes: each takes the run's next **ticket**, and the runtime
applies a run's calls in ticket order (scheduler.py). docs/ORDERING.md says the whole of it.

- **The ticket** is `runs.call_seq + 1`, taken in a committed transaction, so every server process draws from one
  sequence. A call without a number gets the next one as it comes (arrival order).
- **A caller's numbers.** The SDK numbers its pipelined calls (`session`, `seq` 1, 2, …; Tinker's `seq_id` maps onto
  them). The transaction that takes call `seq`'s ticket also records `seq` as its session's last in `run_sessions`,
  and it is refused while the session's last is below `seq - 1`: call 2, arriving first (on any server process),
  waits until call 1 holds a ticket, so the tickets follow the caller's numbers. A number at or below the session's
  last is a retry: it goes at once (the runtime's idempotency answers an applied one).
- **Hand-off in ticket order.** This process hands a run's calls to the runtime in their tickets' order: the run's
  turn is held from the ticket until the call has left (`sent`), not until it is answered, so a run's calls are
  pipelined to the runtime. That order matters where the runtime does not know the run yet (it started since, and
  takes the first ticket it sees as the run's start); once it knows the run it orders tickets itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.db import Database
from app.errors import BadInput, FailedPrecondition, RunNotFound
from app.tables import Run, RunSession, utcnow

log = logging.getLogger("signal.ordering")

# A number's predecessor is normally a request already on its way (sent together); a minute covers a large batch
# still uploading behind a small optim_step, and bounds what a lost predecessor holds up.
SEQ_WAIT_SECONDS = 60.0
# How often a waiting number looks again for a predecessor that another server process admits (this process's
# own admissions wake it at once).
SEQ_POLL_SECONDS = 0.05
SESSIONS_KEPT_CALLS = 4096  # a session whose last call is this many tickets behind its run's is forgotten
SESSION_LENGTH = 64


@dataclass(frozen=True)
class Numbered:
    """A call's place in its client session's order on a run: `seq` 1, 2, ... per session and run."""

    session: str
    seq: int

    @classmethod
    def of(cls, seq: int | None, session: str | None) -> Numbered | None:
        """From GraphQL's `seq` and `session` arguments: both or neither; errors name the field."""
        if seq is None and session is None:
            return None
        if seq is None or session is None:
            missing = "seq" if seq is None else "session"
            raise BadInput(f"{missing} is required with {'session' if missing == 'seq' else 'seq'}", field=missing)
        if seq < 1:
            raise BadInput(f"seq must be >= 1, got {seq}", field="seq")
        if not session or len(session) > SESSION_LENGTH:
            raise BadInput(f"session must be 1 to {SESSION_LENGTH} characters", field="session")
        return cls(session, seq)


class CallOrder:
    """Tickets for a run's calls, in its callers' numbers, handed to the runtime in ticket order."""

    def __init__(self, db: Database, wait_seconds: float = SEQ_WAIT_SECONDS) -> None:
        self.db = db
        self.wait_seconds = wait_seconds
        self._turns: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)  # run → its hand-off (FIFO)
        self._admitted: defaultdict[str, asyncio.Condition] = defaultdict(asyncio.Condition)  # run → a number admitted
        self._passing: set[asyncio.Task[None]] = set()

    async def enter(self, run_id: str, number: Numbered | None) -> asyncio.Lock:
        """Wait for the call's place in line: its predecessor's ticket (a numbered call), then the run's turn to hand
        a call to the runtime. The caller takes its `ticket` and releases the returned turn once its call has left.
        Cancelled (its deadline), it takes no ticket, and its session's next number goes on without it."""
        try:
            if number is not None:
                await self._admit(run_id, number)
            turn = self._turns[run_id]
            await turn.acquire()
        except asyncio.CancelledError:
            if number is not None:
                task = asyncio.ensure_future(self._pass(run_id, number))
                self._passing.add(task)  # referenced until done (a bare task may be collected)
                task.add_done_callback(self._passing.discard)
            raise
        return turn

    async def ticket(self, run_id: str, number: Numbered | None) -> int:
        """The run's next ticket, committed at once (every process sees it), with the session's last number in the
        same transaction, so no process sees `seq` admitted before its ticket exists. Taken holding the turn."""
        ticket = await self._admitted_with(run_id, number, tickets=1)
        if ticket is None:
            raise RunNotFound(f"run {run_id!r} not found", field="runId")
        return ticket

    async def _admitted_with(self, run_id: str, number: Numbered | None, tickets: int) -> int | None:
        """Take `tickets` (1, or 0 for a number that passes without one) and count `number` admitted, in one committed
        transaction; waiting numbers are woken. The run's last ticket, or None: no such run."""
        async with self.db.session() as session:
            # The run's row first: its lock (PostgreSQL) serialises every ticket and session write of the run.
            ticket = await session.scalar(update(Run).where(Run.id == run_id)
                                          .values(call_seq=Run.call_seq + tickets).returning(Run.call_seq))
            if ticket is not None and number is not None:
                await _write_last(session, run_id, number, int(ticket))
        if ticket is not None and number is not None:
            condition = self._admitted[run_id]
            async with condition:
                condition.notify_all()
        return None if ticket is None else int(ticket)

    async def skip(self, run_id: str, number: Numbered) -> None:
        """A numbered call refused before it took a ticket (a bad datum): once its predecessor is admitted (bounded
        as any wait), counted as admitted without a ticket, so its successor does not wait for it."""
        await self._admit(run_id, number)
        await self._pass(run_id, number)

    async def _admit(self, run_id: str, number: Numbered) -> None:
        """Return once the session's last admitted number is at least `number.seq - 1`. A known session whose
        predecessor does not come within `wait_seconds` is a gap: FAILED_PRECONDITION naming `seq`. A session no
        process has admitted a number of (its start went elsewhere and was forgotten) goes on as its start."""
        if number.seq == 1:
            return
        last = await self._last(run_id, number.session)
        if last is not None and last >= number.seq - 1:
            return
        log.info("run %s: call %d of session %s waits for call %d", run_id, number.seq, number.session,
                 number.seq - 1)
        give_up = time.monotonic() + self.wait_seconds
        condition = self._admitted[run_id]
        while (left := give_up - time.monotonic()) > 0:
            # asyncio.timeout, not wait_for: 3.11's wait_for runs wait() in a task of its own, and a cancel met while
            # it re-acquires (a server shutting down) left the lock unheld: "Lock is not acquired" at the exit.
            with contextlib.suppress(TimeoutError):
                async with condition, asyncio.timeout(min(SEQ_POLL_SECONDS, left)):
                    await condition.wait()  # woken by this process's admissions; others' are seen at the next look
            last = await self._last(run_id, number.session)
            if last is not None and last >= number.seq - 1:
                return
        if last is not None:
            raise FailedPrecondition(
                f"call {number.seq} of session {number.session} on run {run_id} waited {self.wait_seconds:.0f}s for "
                f"call {number.seq - 1}, which never came (the last that did is {last}); send the calls in between, "
                "or start a new session", field="seq")
        log.warning("run %s: session %s unknown; call %d goes on as its start", run_id, number.session, number.seq)

    async def _last(self, run_id: str, session_id: str) -> int | None:
        async with self.db.session() as session:
            return await session.scalar(select(RunSession.last_seq).where(
                RunSession.run_id == run_id, RunSession.session == session_id))

    async def _pass(self, run_id: str, number: Numbered) -> None:
        """`number` gave up waiting (its deadline): counted as admitted without a ticket, so its successors do not
        wait for it."""
        try:
            await self._admitted_with(run_id, number, tickets=0)
        except Exception:  # its deadline's answer goes out regardless; its successors then wait their bound
            log.exception("run %s: could not pass call %d of session %s", run_id, number.seq, number.session)

    def forget(self, run_id: str) -> None:
        """A deleted run's turns (its sessions' rows go with the run)."""
        self._turns.pop(run_id, None)
        self._admitted.pop(run_id, None)


async def _write_last(session: AsyncSession, run_id: str, number: Numbered, ticket: int) -> None:
    """The session's last admitted number (never lowered: a retry keeps it), and, now and then, the run's sessions
    that have been silent for SESSIONS_KEPT_CALLS tickets forgotten."""
    row = await session.get(RunSession, (run_id, number.session))
    if row is None:
        session.add(RunSession(run_id=run_id, session=number.session, last_seq=number.seq, ticket=ticket,
                               updated_at=utcnow()))
        if ticket % 256 == 0:
            await session.execute(delete(RunSession).where(RunSession.run_id == run_id,
                                                           RunSession.ticket < ticket - SESSIONS_KEPT_CALLS))
    elif row.last_seq < number.seq:
        row.last_seq, row.ticket, row.updated_at = number.seq, ticket, utcnow()
