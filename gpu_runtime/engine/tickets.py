"""Tickets: one order for a run's calls across server processes (the overview is gpu_runtime/engine/scheduler.py's).

A server numbers each call on a run from the database (`runs.call_seq`). For each run, `Tickets` knows whose
turn it is and which later tickets were withdrawn (counted done when their turn comes). The scheduler asks it
whether a head may go, and tells it when a call is answered or withdrawn. It holds no lock of its own: the
scheduler calls it under its condition.
"""

from __future__ import annotations

import logging

from gpu_runtime.engine.request import Request

log = logging.getLogger("gpu_runtime.engine.scheduler")  # the scheduler's log: tickets are its bookkeeping

TICKET_WAIT_SECONDS = 30.0  # how long a call waits for an earlier ticket of its run before going on without it


class Tickets:
    def __init__(self, wait: float = TICKET_WAIT_SECONDS) -> None:
        self.wait = wait
        self._next: dict[str, int] = {}  # run → the ticket whose turn it is
        self._skipped: dict[str, set[int]] = {}  # run → withdrawn calls' tickets, counted done at their turn

    def turn(self, request: Request, now: float) -> bool:
        """Whether a head may go: no ticket, its run's turn (or a new run's first), or it has waited long enough."""
        return self._goes(request, self._next.get(request.run_id or ""), now)

    def turn_after(self, head: Request, request: Request, now: float) -> bool:
        """`turn` for the call behind its run's head, as the books will stand once `head` (not a create_run) is done."""
        run_id = request.run_id or ""
        expected = self._next.get(run_id)
        if head.ticket is not None:
            expected = head.ticket + 1 if expected is None else max(expected, head.ticket + 1)
        if expected is not None:
            expected = self._past_skipped(self._skipped.get(run_id, set()), expected)
        return self._goes(request, expected, now)

    def _goes(self, request: Request, expected: int | None, now: float) -> bool:
        """Whether `request` may go when `expected` is its run's turn (None: a run with no turn yet)."""
        if request.ticket is None or expected is None or request.ticket <= expected:
            return True
        return now - request.since >= self.wait

    @staticmethod
    def _past_skipped(skipped: set[int], expected: int) -> int:
        """The first ticket from `expected` on that was not withdrawn."""
        while expected in skipped:
            expected += 1
        return expected

    def done(self, request: Request, created: bool) -> None:
        """A call on a run was answered (`created`: a create_run that made its run, whose tickets start at 1)."""
        run_id = request.run_id
        if run_id is None:
            return
        if created:
            self._next[run_id] = 1  # the server's call_seq starts at 0: its first ticket is 1
        if request.ticket is not None:
            expected = self._next.get(run_id, request.ticket)
            if request.ticket > expected:
                log.warning("run %s: tickets %d..%d did not arrive within %.0f s; ticket %d went on without them",
                            run_id, expected, request.ticket - 1, self.wait, request.ticket)
            self._next[run_id] = max(expected, request.ticket + 1)
        self._settle(run_id)

    def skip(self, request: Request) -> None:
        """A withdrawn call's ticket counts as done: the run's next one need not wait for it."""
        if request.run_id is not None and request.ticket is not None:
            self.skip_ticket(request.run_id, request.ticket)

    def skip_ticket(self, run_id: str, ticket: int) -> None:
        self._skipped.setdefault(run_id, set()).add(ticket)
        self._settle(run_id)

    def _settle(self, run_id: str) -> None:
        """Move the run's turn past the withdrawn tickets it has reached."""
        skipped = self._skipped.get(run_id)
        expected = self._next.get(run_id)
        if not skipped or expected is None:
            return
        expected = self._next[run_id] = self._past_skipped(skipped, expected)
        for ticket in [t for t in skipped if t < expected]:
            skipped.discard(ticket)  # reached, or already passed (its wait ran out): nothing to skip any more
        if not skipped:
            del self._skipped[run_id]
