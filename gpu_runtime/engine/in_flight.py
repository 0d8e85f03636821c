"""Calls begun and not yet answered, and how they end early.

The tick (gpu_runtime/engine/engine.py) fills `prepared` (forward_backward heads rendered before they are priced)
and `planned` (this tick's frozen samples, off the scheduler's lanes until they begin). A call in flight
ends early in two ways:

- **withdrawn** by a cancel (a deadline, or a client gone) before it is applied: taken off whichever lane
  holds it, a split forward_backward's gradients put back, answered CANCELLED or DEADLINE_EXCEEDED;
- **failed** with its run, when the run leaves memory unsaved (a failed journal write, a call failed after
  its pass, a rank failure): a split forward_backward part-done fails, one not yet begun starts again on the
  restored run, and the decode groups reading the run's adapters fail.
"""

from __future__ import annotations

import time

from gpu_runtime.contract import Cancel, CancelResult
from gpu_runtime.engine.request import Answer, Request
from gpu_runtime.engine.sampling_calls import Sampling
from gpu_runtime.engine.scheduler import cancel_error
from gpu_runtime.engine.shared import Answered, Shared
from gpu_runtime.engine.training_calls import FbProgress
from gpu_runtime.errors import SignalError


class InFlight:
    def __init__(self, shared: Shared, sampling: Sampling) -> None:
        self.shared = shared
        self.sampling = sampling
        self.prepared: dict[Request, FbProgress] = {}  # forward_backward heads, rendered before they are priced
        self.planned: list[Request] = []  # this tick's frozen samples, off the scheduler's lanes until they begin

    def finish(self, request: Request, answer: Answer | None) -> None:
        assert answer is not None
        self.prepared.pop(request, None)
        self.shared.scheduler.finish(request, answer)

    # ---- withdrawn ----------------------------------------------------------------------------

    def cancel(self, call: Cancel) -> CancelResult:
        """Withdraw the call `call` names if it has not begun, or stop its decoding (contract: Cancel). Runs with the
        tick's system calls, so no pass is under way: a split forward_backward is between parts."""
        scheduler = self.shared.scheduler
        if self.sampling.stop(call):
            return CancelResult(found=True)
        request = scheduler.find(call.user_id, call.request_id) or next(
            (r for r in self.planned if r.user_id == call.user_id and r.named(call.request_id)), None)
        if request is None:
            if not self._answered(call):  # else applied already: a retry of it must get its answer, not a refusal
                scheduler.refuse_on_arrival(call.user_id, call.request_id, call.deadline)
            return CancelResult(found=False)
        progress = self.prepared.get(request)
        if request.started and progress is None:
            return CancelResult(found=True)  # under way outside the passes (a Hub upload): it completes
        since = request.runnable_since
        if call.deadline and call.deadline_s is not None and progress is None and (
                since is None or time.monotonic() - since < call.deadline_s):
            request.deadline_s = call.deadline_s  # its time counts from when it could run: withdrawn then, if unbegun
            return CancelResult(found=True, deferred=True)
        self.withdraw(request, call.deadline)
        return CancelResult(found=True)

    def expire_deadlines(self) -> None:
        """Withdraw the calls whose deferred deadline ran out before they began (each tick, before its picks)."""
        for request in self.shared.scheduler.past_deadline():
            self.withdraw(request, deadline=True)

    def withdraw(self, request: Request, deadline: bool) -> None:
        progress = self.prepared.get(request)
        seconds = 0.0
        if progress is not None:
            self.shared.compute.restore_grads(progress)  # between parts of a split call, on every rank: undone
            seconds = progress.compute_seconds
            del self.prepared[request]
        if request in self.planned:
            self.planned.remove(request)
        self.shared.scheduler.withdraw(request, cancel_error(deadline, seconds))

    def _answered(self, call: Cancel) -> bool:
        """Whether a resident run of the caller's remembers an answer to the call `call` names (or is the run it
        would create)."""
        runs = self.shared.residency.runs
        return call.request_id in runs or any(
            state.user_id == call.user_id and (call.request_id in state.answered or call.request_id in state.sampled)
            for state in runs.values())

    # ---- failed with their runs ---------------------------------------------------------------

    def forget_unwritten(self, errors: dict[str, SignalError], answers: list[Answered]) -> list[Answered]:
        """Runs whose journal write failed this tick (recovery's `drop_unwritten` gave their errors): each of their
        calls in it fails, none is answered as applied."""
        self._fail_runs(errors, answers)
        return [(request, errors[request.run_id]) if request.run_id in errors else (request, answer)
                for request, answer in answers]

    def discard(self, answers: list[Answered]) -> None:
        """Runs a call of which failed after its pass: their memory holds its gradients, their journals do not. Each
        leaves memory unsaved (the tick's other calls are synced) and comes back from snapshot + journal on its next
        call."""
        discarded, self.shared.discarded = self.shared.discarded, {}
        self._fail_runs(discarded, answers)
        for run_id in discarded:
            self.shared.residency.detach(run_id)

    def _fail_runs(self, errors: dict[str, SignalError], answers: list[Answered]) -> None:
        """Runs about to leave memory unsaved: their split forward_backwards part-done fail (a part not yet begun
        starts again on the restored run), and so do their decode groups, which lose the adapters they read."""
        answering = {request for request, _ in answers}
        for request in self.shared.scheduler.queued():
            if request.run_id in errors and request in self.prepared and request not in answering:
                if self.prepared.pop(request).done > 0:
                    self.shared.scheduler.finish(request, errors[request.run_id])
                else:
                    request.started = False
        self.sampling.fail_all(next(iter(errors.values())), self.sampling.failing_runs(set(errors)))

    def fail_all(self, error: SignalError) -> None:
        """Every run leaves memory unsaved (a rank failed): what was mid-flight fails; calls still queued start
        afresh, resolved again against the restored runs."""
        self.sampling.fail_all(error)
        for request in self.shared.scheduler.queued():
            progress = self.prepared.pop(request, None)
            if progress is not None and progress.done > 0:
                self.shared.scheduler.finish(request, error)  # part of it went with the dropped state
            else:
                request.started = False
