"""The SDK's numbering of a run's calls: a session's call `seq` joins its run's queue only after `seq - 1` has.

The run's queue is RunService's FIFO lock (arrival order), under which each call takes its ticket, the order the
runtime applies calls in. A client that pipelines (sends call 2 before call 1 has been answered, on another
connection) numbers its calls; here call 2, arriving first, waits until call 1 has joined the queue, so arrival
order, and with it the tickets, become the client's order. Calls without a number keep plain arrival order.
docs/ORDERING.md says the whole of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass

from gpu_runtime.errors import BadInput, FailedPrecondition

log = logging.getLogger("signal.ordering")

# A number's predecessor is normally a request already on its way (sent together); a minute covers a large batch
# still uploading behind a small optim_step, and bounds what a lost predecessor holds up.
SEQ_WAIT_SECONDS = 60.0
SESSIONS_PER_RUN = 256  # the sessions remembered per run (oldest forgotten first); each is two small ints
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
    """Per run and session, the last number that joined the run's queue, in this server process."""

    def __init__(self, wait_seconds: float = SEQ_WAIT_SECONDS) -> None:
        self.wait_seconds = wait_seconds
        self._last: defaultdict[str, dict[str, int]] = defaultdict(dict)  # run → session → last admitted seq
        self._changed: defaultdict[str, asyncio.Condition] = defaultdict(asyncio.Condition)
        self._waking: set[asyncio.Future[None]] = set()

    async def admit(self, run_id: str, number: Numbered) -> None:
        """Return once `number` may join the run's queue, and count it as joined: the caller joins it (acquires
        the run's lock) before its next await, so the next number, woken now, runs only after it has.

        A number at or below the session's last is a retry of a call already queued: it goes at once (the ledger
        answers it). A number whose predecessor has not come within `wait_seconds` fails with FAILED_PRECONDITION
        naming `seq` when the session is known here (a gap: a lost call); a session this process has never seen
        (it restarted, or the session's earlier calls went to another server process) goes on as its start."""
        condition = self._changed[run_id]
        sessions = self._last[run_id]
        async with condition:
            if sessions.get(number.session, 0) < number.seq - 1:
                log.info("run %s: call %d of session %s waits for call %d", run_id, number.seq, number.session,
                         number.seq - 1)
                try:
                    await asyncio.wait_for(condition.wait_for(
                        lambda: sessions.get(number.session, 0) >= number.seq - 1), self.wait_seconds)
                except TimeoutError:
                    last = sessions.get(number.session)
                    if last is not None:
                        raise FailedPrecondition(
                            f"call {number.seq} of session {number.session} on run {run_id} waited "
                            f"{self.wait_seconds:.0f}s for call {number.seq - 1}, which never came (the last that "
                            f"did is {last}); send the calls in between, or start a new session", field="seq",
                        ) from None
                    log.warning("run %s: session %s unknown here; call %d goes on as its start", run_id,
                                number.session, number.seq)
            sessions[number.session] = max(sessions.pop(number.session, 0), number.seq)  # newest last (eviction)
            while len(sessions) > SESSIONS_PER_RUN:
                sessions.pop(next(iter(sessions)))
            condition.notify_all()

    def passed(self, run_id: str, number: Numbered) -> None:
        """`number` gave up waiting (its deadline): counted as joined, so its successors do not wait for it."""
        sessions = self._last[run_id]
        sessions[number.session] = max(sessions.get(number.session, 0), number.seq)
        condition = self._changed[run_id]

        async def wake() -> None:
            async with condition:
                condition.notify_all()

        task = asyncio.ensure_future(wake())
        self._waking.add(task)  # referenced until done (a bare task may be collected)
        task.add_done_callback(self._waking.discard)

    def forget(self, run_id: str) -> None:
        """A deleted run's sessions."""
        self._last.pop(run_id, None)
        self._changed.pop(run_id, None)
