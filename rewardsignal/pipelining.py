"""Pipelining: the order of a client's calls on each run, a large batch in parts, and one future for the parts.

Each primitive on a run is numbered when it is made (`seq` 1, 2, ... with a `session` id per client, run and
pipeline), and the server applies a session's calls on a run in that order whatever order they arrive in
(docs/ORDERING.md). So `Run.forward_backward_async(...)` and `Run.optim_step_async()` (futures), or two AsyncRun
calls gathered, can be in flight together and still apply as written. A batch over the server's
`limits.maxBatchSize` is sent as consecutive calls and answered as one result.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

from rewardsignal.calls import Call
from rewardsignal.operations import document

# A sample or forward on a snapshot or checkpoint is ordered after the call that made its source and nothing else
# (issue 15 §4): it never joins its run's queue, so it takes no number there (a number nobody admits is a gap).
OFF_THE_QUEUE = {"Sample", "Forward"}

Item = TypeVar("Item")


@dataclass
class Pipeline:
    """A run's calls from one client that overlap in time: one `session`, numbered 1, 2, ..."""

    session: str
    seq: int = 0
    unanswered: int = 0


@cache
def takes_seq(operation: str) -> bool:
    """Whether the operation's document passes `$seq` on: a number the server never sees would be a gap that the
    calls after it wait on."""
    return "$seq" in document(operation)


class Sequencer:
    """The ordering of one client's calls on each run (docs/ORDERING.md): per run, the session of the pipeline now
    going (calls in flight), its last number, and how many of its calls are unanswered. Thread-safe: the sync
    client's futures number calls from any thread."""

    def __init__(self) -> None:
        self._pipelines: dict[str, Pipeline] = {}
        self._lock = threading.Lock()

    def number(self, call: Call, pipelined: bool = True) -> Call:
        """Give a primitive on a run its place in this client's order on that run, now, as it is made: a retry
        sends the same Call (same requestId, same seq). A blocking call (`pipelined=False`: the sync client's
        plain methods) is numbered only behind pipelined calls still in flight on the run: blocking calls made
        at once from several threads have no order of their own to keep."""
        run_id = call.variables.get("runId")
        if call.operation in OFF_THE_QUEUE and any(call.variables.get(name) for name in ("snapshot", "checkpoint")):
            return call  # reads frozen weights: not queued on the run, so not in its order (docs/ORDERING.md)
        if call.retry and run_id is not None and "seq" not in call.variables and takes_seq(call.operation):
            with self._lock:
                pipeline = self._pipelines.get(run_id)
                if not pipelined and (pipeline is None or not pipeline.unanswered):
                    return call
                if pipeline is None or not pipeline.unanswered:
                    # Nothing in flight: no earlier call to wait for, so a new session, from 1. A server process
                    # that never saw this run's earlier calls (another worker, a restart) has nothing to wait on.
                    pipeline = self._pipelines[run_id] = Pipeline(uuid.uuid4().hex)
                pipeline.seq += 1
                pipeline.unanswered += 1
            call.variables.update(seq=pipeline.seq, session=pipeline.session)
        return call

    def answered(self, call: Call) -> None:
        """A numbered call is done (answered, or failed for good): its pipeline has one call fewer in flight."""
        session = call.variables.get("session")
        if session is None:
            return
        with self._lock:
            pipeline = self._pipelines.get(call.variables["runId"])
            if pipeline is not None and pipeline.session == session:
                pipeline.unanswered -= 1


def split(batch: Sequence[Item], most: int | None) -> list[Sequence[Item]]:
    """`batch` in parts of at most `most` items (None: the server's limit is not known), in order."""
    if not most or not isinstance(batch, list) or len(batch) <= most:
        return [batch]
    return [batch[start:start + most] for start in range(0, len(batch), most)]


def gathered(parts: list[Future[Any]], combine: Callable[[list[Any]], Any]) -> Future[Any]:
    """One future for `parts`: `combine` of their results once all are done, or the first part's error."""
    out: Future[Any] = Future()
    out.set_running_or_notify_cancel()
    left = [len(parts)]
    lock = threading.Lock()

    def done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result(combine([part.result() for part in parts]))
        except BaseException as error:  # noqa: BLE001 - handed to the caller through the future, as a part's own would be
            out.set_exception(error)

    for part in parts:
        part.add_done_callback(done)
    return out
