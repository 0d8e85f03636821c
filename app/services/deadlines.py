"""Each method's deadline (issue 19 §3, SIGNAL_DEADLINES_S), counted from when the call can run (issue 34 #11), never
from its arrival. This server's timer runs from the call's arrival less the time it waited here for its place in
its run's order (its session's previous number, its run's turn to take a ticket: `Deadline.exclude`), during which
its run's previous call had not even left for the runtime. The runtime's clock starts when the call can run (its
run's calls before it answered): a cancel at this server's deadline carries the length (`Cancel.deadline_s`), and a
call able to run for less than that is withdrawn only once it has been, so a pipelined optim_step is not failed for
its forward_backward's time, wherever that time was spent. The wait here is bounded by the ordering's own bound
(call_order.py: a predecessor that never comes fails the call FAILED_PRECONDITION).

A call sent to the runtime is not abandoned: the runtime
is asked to cancel it by request id, and its own answer says what happened: withdrawn before it was applied
(DEADLINE_EXCEEDED, its ticket counted done, a split forward_backward's gradients put back, a sample stopped between
decode chunks), or applied (in a pass or journaled: answered and recorded as usual). Either way never abandoned half
way, and a withdrawn call is neither billed nor recorded: its compute seconds are logged here.

A stream whose client has already read text (`Streamed.sent`) is not withdrawn at its deadline, which would end it
with an error after text it was shown: the runtime stops it between decode chunks and answers with what it has
(stop_reason "cancelled", as when a pane is cancelled), recorded and billed as any answer. The deadline still bounds
it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from app.errors import Cancelled, DeadlineExceeded, SignalError

log = logging.getLogger("signal.deadlines")

T = TypeVar("T")


@dataclass
class Deadline:
    operation: str
    seconds: float
    at: float  # the event loop's clock (loop.time()); moved later by the time the call could not run (`exclude`)

    @classmethod
    def start(cls, deadlines: dict[str, float], operation: str) -> Deadline:
        """`operation`'s deadline from now, its arrival."""
        seconds = deadlines[operation]
        return cls(operation, seconds, asyncio.get_running_loop().time() + seconds)

    def exclude(self, seconds: float) -> None:
        """`seconds` the call spent unable to run (waiting here for its run's previous call) do not count."""
        self.at += seconds

    def left(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    def error(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"{self.operation} passed its deadline of {self.seconds:g} s (SIGNAL_DEADLINES_S) "
                                "before it was applied: it never was")


class Streamed:
    """A stream's `progress`, remembering whether any chunk went to its client (`sent`)."""

    def __init__(self, progress: Callable[[Any], None]) -> None:
        self.progress = progress
        self.sent = False

    def __call__(self, chunk: Any) -> None:
        self.sent = True
        self.progress(chunk)

    @classmethod
    def of(cls, progress: Callable[[Any], None] | None) -> Streamed | None:
        return None if progress is None else cls(progress)


async def answered(deadline: Deadline | None, call: Awaitable[T], cancel: Callable[[], Awaitable[Any]],
                   what: str) -> T:
    """The runtime's answer to `call`; at the deadline the runtime is asked to `cancel` it, and its answer then says
    whether it was withdrawn (DEADLINE_EXCEEDED) or had been applied (its result, recorded by the caller as usual)."""
    task = asyncio.ensure_future(call)
    if deadline is not None:
        await asyncio.wait([task], timeout=max(deadline.left(), 0.0))  # the answer's error is read below
        if not task.done():
            try:
                await cancel()
            except SignalError as error:  # the call's own answer still comes: it is waited for below
                log.warning("%s: the cancel at its deadline failed: %s", what, error)
    try:
        return await task
    except (DeadlineExceeded, Cancelled) as error:
        seconds = float(error.details.get("compute_seconds", 0.0))
        log.info("%s: withdrawn (%s), never applied, not billed; %.6f compute seconds used", what, error.code, seconds)
        if isinstance(error, DeadlineExceeded) and deadline is not None:
            raise deadline.error() from None
        raise type(error)(error.message) from None
