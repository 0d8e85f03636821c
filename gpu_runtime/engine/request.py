"""A call as the scheduler queues it: its typed call, its reply, its run, user and ticket. Its own module so that the
scheduler and its tickets (gpu_runtime/engine/tickets.py) both read it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpu_runtime.contract import Call, CreateRun, Result, SampleChunk
from gpu_runtime.errors import SignalError

SYSTEM = "__system__"  # the lane of calls on no run (ping, runtime_state): answered at the next tick, first

Answer = Result | SignalError  # what a call is answered with: its call's result type, or a typed error
Reply = Callable[[Answer], None]


@dataclass(eq=False)  # compared and hashed by identity: the engine keys its work on requests
class Request:
    call: Call  # the typed, validated request; the scheduler reads only its kind and ids
    reply: Reply  # called once, with the call's result or its error
    user_id: str = SYSTEM
    run_id: str | None = None
    arrival: int = 0
    started: bool = False  # the engine has begun it (prepared rows, a decode group): later tickets queue behind it
    ticket: int | None = None  # the call's place in its run's order, from the server (runs.call_seq)
    since: float = 0.0  # time.monotonic() at submit: how long a ticket has waited for the ones before it
    frozen: bool = False  # a sample on frozen weights: in the free lane, outside every run's queue
    progress: Callable[[SampleChunk], None] | None = None  # a streamed sample's chunks, before its one reply
    counted: bool = False  # taken in under its user's bound on calls in flight (released when answered)
    runnable_since: float | None = None  # time.monotonic() once it could run: its run's calls before it answered
    deadline_s: float | None = None  # a deadline cancel came early: withdrawn once runnable this long (deadlines.py)

    @property
    def method(self) -> str:
        return self.call.method.value

    @property
    def request_id(self) -> str | None:
        value = getattr(self.call, "request_id", None)
        return value if isinstance(value, str) else None

    @property
    def answered(self) -> bool:
        return self.reply is _DONE

    def named(self, request_id: str) -> bool:
        """Whether a cancel of `request_id` means this call: its request id, or a create_run's run id (it has none)."""
        return self.request_id == request_id or (isinstance(self.call, CreateRun) and self.run_id == request_id)


def _DONE(answer: Answer) -> None:  # noqa: N802 - a sentinel: the request was answered
    raise RuntimeError("a request was answered twice")
