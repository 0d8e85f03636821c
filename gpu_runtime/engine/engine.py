"""The multi-tenant engine: calls in through `submit`, one tick at a time, answers out through each call's reply.

Calls arrive through `submit` (any thread), typed and validated by the contract, and are answered through
their `reply`. The engine's own thread runs ticks (`serve_forever`, or `call`, which pumps ticks in-process).
One tick:

1. resolves the eligible heads: each head's run is found (an evicted run is restored, at most
   `RESTORES_PER_TICK` per tick) and each forward_backward is rendered, so that it has a price;
2. asks the scheduler for this tick's work, given those prices: at most one call per run, users in fair
   order, forward_backward rows bounded by `tick_tokens`;
3. runs system calls (ping, runtime_state, a forward on a base model alone) and control calls (create_run,
   optim_step, save_state, forward, render_datums, …); a forward is its own pass with no autograd;
4. runs every picked forward_backward on one base as **one** forward and backward pass, each row routed
   to its run's LoRA; losses, normalisers and gradients stay per run;
   an optim_step queued right behind a forward_backward this pass completed steps now, in one more optimizer tick;
5. fsyncs the journals of the calls it applied (one group fsync per tick), then answers;
6. starts a decode group for the sample calls picked, and advances every decode group by one chunk;
7. evicts least recently used idle runs past the memory budget, and unloads idle bases.

Each call is isolated: an exception in its preparation, pass or completion fails that call alone, with a
typed error and a log line naming its request id; the tick goes on. The rooms: training_calls.py,
sampling_calls.py, control_calls.py, recovery.py; calls begun and ended early (cancelled, or failed with their
run): in_flight.py; where tensors run: compute.py.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from gpu_runtime.client.protocol import Heartbeat
from gpu_runtime.compute.decoding import SampleJob
from gpu_runtime.compute.devices import resolve_device
from gpu_runtime.compute.hardware import RankCompute
from gpu_runtime.compute.ranks import RankGroup
from gpu_runtime.contract import (
    Call,
    Cancel,
    CloseRun,
    CreateRun,
    DeleteCheckpoint,
    DeleteRun,
    ExportCheckpoint,
    Forward,
    ForwardBackward,
    ForwardBackwardResult,
    Lane,
    LoadRun,
    LoadState,
    OptimStep,
    OptimStepResult,
    Ping,
    RenderChat,
    RenderDatums,
    RunInfo,
    RuntimeOptions,
    RuntimeState,
    RuntimeStateResult,
    Sample,
    SampleChunk,
    SaveState,
    SaveWeightsForSampler,
    Tokenizer,
)
from gpu_runtime.contract.calls import A
from gpu_runtime.engine import weights_sources
from gpu_runtime.engine.control_calls import Control
from gpu_runtime.engine.disk import FreeSpace, disk_full_error
from gpu_runtime.engine.handlers import Handlers
from gpu_runtime.engine.in_flight import InFlight
from gpu_runtime.engine.inprocess import InProcess
from gpu_runtime.engine.off_tick import OffTick
from gpu_runtime.engine.recovery import RESTORES_PER_TICK, Recovery
from gpu_runtime.engine.request import SYSTEM, Answer, Reply, Request
from gpu_runtime.engine.residency import open_hardware
from gpu_runtime.engine.run_state import RunState
from gpu_runtime.engine.sampling_calls import Sampling
from gpu_runtime.engine.scheduler import Scheduler, TickPlan
from gpu_runtime.engine.shared import Answered, Shared, TickStats, internal, isolated
from gpu_runtime.engine.snapshots import Snapshots
from gpu_runtime.engine.training_calls import FbPart, FbProgress, StepCall, Training
from gpu_runtime.errors import SignalError, WorkerFailed


class Engine(InProcess):
    def __init__(
        self,
        data_dir: str | Path,
        device: str = "auto",
        options: RuntimeOptions | None = None,
        allow_downloads: bool = False,
        faults: set[str] | None = None,
        after_sync: Callable[[], None] | None = None,
        **overrides: Any,
    ) -> None:
        # `overrides` are RuntimeOptions fields (Engine(dir, max_batch_size=2) in tests and benchmarks).
        options = RuntimeOptions.from_dict({**(options or RuntimeOptions()).to_dict(), **overrides})
        root = Path(data_dir).resolve()
        torch_device, dtype = resolve_device(device)
        faults = faults or set()
        hardware = open_hardware(root, torch_device, dtype, options, allow_downloads, faults)
        self.shared = Shared(root, torch_device, dtype, options, faults, hardware.models, hardware.residency,
                             hardware.compute, Scheduler(options.tick_tokens, user_calls=options.max_user_calls_in_flight,
                                                       user_queue=options.max_user_calls_waiting), after_sync)
        self.training = Training(self.shared)
        self.snapshots = Snapshots(root, hardware.residency, options.unnamed_snapshot_seconds)
        self.sampling = Sampling(self.shared, self.snapshots)
        self.off_tick = OffTick(hardware.residency)
        self.recovery = Recovery(self.shared, self.training.replay)
        self.control = Control(self.shared, self.recovery, self.sampling, self.snapshots)
        self.last_tick = TickStats()
        self.ticking_since: float | None = None  # monotonic start of the tick running now (the heartbeat reads it)
        self._stepping: list[tuple[Request, StepCall]] = []  # this tick's optim_steps, for its one optimizer tick
        self.free_space = FreeSpace(self.shared.data_dir)  # read afresh each tick; a tick's submits share it
        self.in_flight = InFlight(self.shared, self.sampling)  # begun, not yet answered: withdrawn or failed early
        self.handlers = self._handlers()

    # What the rooms share, read by transports, tests and benchmarks.
    options = property(lambda self: self.shared.options)
    data_dir = property(lambda self: self.shared.data_dir)
    device = property(lambda self: self.shared.device)
    dtype = property(lambda self: self.shared.dtype)
    models = property(lambda self: self.shared.models)
    residency = property(lambda self: self.shared.residency)
    scheduler = property(lambda self: self.shared.scheduler)
    totals = property(lambda self: self.shared.totals)
    compute = property(lambda self: self.shared.compute)

    @property
    def runs(self) -> dict[str, RunState]:
        return self.shared.residency.runs

    @property
    def ranks(self) -> RankGroup | None:
        return self.compute.ranks if isinstance(self.compute, RankCompute) else None

    # ---- calls ----------------------------------------------------------------------------

    def submit(self, call: Call[A], reply: Callable[[A | SignalError], None],
               progress: Callable[[SampleChunk], None] | None = None, ticket: int | None = None) -> None:
        """Queue one typed, validated call (thread-safe; gpu_runtime/client/protocol.py:read_call builds it from the
        wire); `reply` gets its result or its error exactly once, and before it a streamed sample's `progress` gets
        each SampleChunk (a transport without progress passes None). `ticket`: its place in its run's order across
        servers."""
        # The engine answers a call only with its own answer type (Handlers.answer checks it) or an error.
        answer = cast(Reply, reply)
        try:
            call.check_size(self.options)  # the server checked its own bounds; these are the runtime's
            if call.kind.writes:
                self._check_disk()
            run_id = call.run
            # off its run's queue (gpu_runtime/engine/weights_sources.py)
            frozen = call.kind.lane is Lane.FREE and call.frozen and self._copies_latest(call)
            if run_id is None or isinstance(call, CreateRun):
                user = call.caller() or SYSTEM  # a new run's owner, a base-model call's user, or the runtime's own
            else:
                user = self.recovery.owner(run_id)
        except SignalError as exc:
            self.scheduler.release_ticket(call.run, ticket)  # never queued: its ticket is released, not waited for
            answer(exc)
            return
        rendered = self.off_tick.render_chat(call) if isinstance(call, RenderChat) else None
        if rendered is not None:  # its base resident: no tick to wait for (gpu_runtime/engine/off_tick.py)
            answer(rendered)
            return
        streamed = progress if isinstance(call, Sample) and call.stream else None
        self.scheduler.submit(Request(call, answer, user_id=user, run_id=None if frozen else run_id,
                                      ticket=None if frozen else ticket, frozen=frozen, progress=streamed))

    def _check_disk(self) -> None:
        """Refuse a writing call before any state changes while free space is under the margin (sampling goes on)."""
        if self.free_space.below(self.options.min_free_disk_bytes):
            raise disk_full_error(self.shared.data_dir)

    def serve_forever(self) -> None:
        """Run ticks until the scheduler is closed and nothing is left; then snapshot and return."""
        while True:
            busy = self.sampling.busy
            woken = self.scheduler.wait_for_work(timeout=min(self.options.base_idle_seconds, 60.0), also_busy=busy)
            if self.scheduler.closed and not self.scheduler.has_work() and not self.sampling.busy:
                break
            if not woken:
                self.in_flight.expire_deadlines()  # a deferred deadline ran out on a call still held (its ticket)
                self._housekeeping()
                continue
            self.tick()
        self.shutdown()

    # ---- one tick -------------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """Read from another thread without a lock: two attribute reads, so it answers while a tick runs."""
        since = self.ticking_since
        return {"tick": self.last_tick.number, "tick_seconds": time.monotonic() - since if since is not None else 0.0}

    def tick(self) -> TickStats:
        started = self.ticking_since = time.monotonic()
        if self.compute.failed:
            self._restart_ranks()  # a rank failed between ticks
        stats = TickStats()
        self.in_flight.expire_deadlines()  # deferred deadlines run out (in_flight.py), before the heads are priced
        self._resolve_heads(stats)
        plan: TickPlan = self.scheduler.next_tick(self._cost)
        stats.number, stats.requests = plan.number, len(plan.system) + len(plan.picks) + len(plan.free)
        self.in_flight.planned = plan.free  # a cancel among the system calls may withdraw one
        stats.system = len(plan.system)
        for request in plan.system:
            self.in_flight.finish(request, isolated(request, functools.partial(self._answer_now, request)))
        fb_parts: dict[str, list[FbPart]] = {}
        samples: dict[str, list[SampleJob]] = {}
        answers: list[Answered] = []  # answered once the journals are synced
        for pick in plan.picks:
            request = pick.request
            if request.answered:
                continue  # withdrawn by a cancel earlier in this tick
            answer = isolated(request, functools.partial(self._begin, request, pick.allowance, fb_parts, samples,
                                                         answers))
            if answer is not None:
                answers.append((request, answer))
        answers += self._optim_tick()
        self.in_flight.planned = []
        for request in plan.free:  # frozen samples: every pending one, into this tick's decode groups
            if request.answered:
                continue
            answer = isolated(request, functools.partial(self._begin_frozen, request, samples))
            if answer is not None:
                answers.append((request, answer))
        trained_from = time.monotonic()
        passed: list[Answered] = []
        for key, parts in fb_parts.items():
            passed += self.training.run_live_pass(self.residency.bases[key], parts, stats)
        answers += passed + self._steps_after(passed, stats)
        trained = time.monotonic() - trained_from
        unwritten = self.shared.sync_journals()
        if unwritten:  # a full disk: those runs leave memory unsaved, their calls in this tick fail
            answers = self.in_flight.forget_unwritten(self.recovery.drop_unwritten(unwritten), answers)
        if self.shared.discarded:
            self.in_flight.discard(answers)
        if "after_journal" in self.shared.faults and answers:
            os.kill(os.getpid(), signal.SIGKILL)  # failpoint: journaled, not yet answered
        for request, answer in answers:
            self.in_flight.finish(request, answer)
        for key, jobs in samples.items():
            self.sampling.start(self.residency.bases[key], jobs)
        self.sampling.advance(stats, trained)
        self._housekeeping()
        if self.compute.failed:
            self._restart_ranks()
        stats.seconds = time.monotonic() - started
        self.last_tick = stats
        self.ticking_since = None
        self.totals.count(stats)
        return stats

    def _resolve_heads(self, stats: TickStats) -> None:
        """Give every eligible head a price: its run in memory, a forward_backward's rows rendered. Calls found bad
        here are answered here, before the planner runs; a run past this tick's restores waits for the next."""
        for request in self.scheduler.heads():
            call, run_id = request.call, request.call.run
            if request in self.in_flight.prepared or not call.kind.on_run or run_id is None:
                continue
            if run_id not in self.runs:
                if stats.restores >= RESTORES_PER_TICK:
                    continue  # not priced, so not picked: it keeps its place for the next tick
                stats.restores += 1
            answer = isolated(request, functools.partial(self._resolve, request, call, run_id))
            if answer is not None:
                self.in_flight.finish(request, answer)

    def _resolve(self, request: Request, call: Call, run_id: str) -> Answer | None:
        if "raise_in_prepare" in self.shared.faults and (request.request_id or "").startswith("raise"):
            raise RuntimeError("failpoint raise_in_prepare")  # what a library bug in one call's preparation does
        if "die_in_prepare" in self.shared.faults and (request.request_id or "").startswith("poison"):
            os.kill(os.getpid(), signal.SIGKILL)  # failpoint: a call that kills the process, each time it is sent
        state = self.recovery.state(run_id)
        if isinstance(call, ForwardBackward):
            prepared = self.training.prepare(state, call)
            if not isinstance(prepared, FbProgress):  # a retry of a call already journaled: its first answer, again
                return prepared
            self.in_flight.prepared[request] = prepared
            request.started = True
        return None

    def _cost(self, request: Request) -> int | None:
        """Tokens a head needs this tick (forward_backward), 0 for other calls; None: not resolved, not this tick."""
        if isinstance(request.call, ForwardBackward):
            progress = self.in_flight.prepared.get(request)
            return None if progress is None else max(progress.remaining_tokens, 1)
        if request.call.kind.on_run and request.run_id is not None and request.run_id not in self.runs:
            return None
        return 0

    def _begin(self, request: Request, allowance: int, fb_parts: dict[str, list[FbPart]],
               samples: dict[str, list[SampleJob]], answers: list[Answered]) -> Answer | None:
        """Start a picked call: rows into this tick's passes, a sample into a decode group, or a control call
        done now. Returns its answer when it has one already."""
        call = request.call
        if isinstance(call, ForwardBackward):
            progress = self.in_flight.prepared[request]
            rows = Training.take_rows(progress, allowance)
            fb_parts.setdefault(progress.state.base_key, []).append(FbPart(request, progress, rows, progress.done))
            return None
        if isinstance(call, Sample):
            return self._begin_frozen(request, samples)
        if isinstance(call, OptimStep):
            return self._begin_step(request, call)
        if isinstance(call, SaveState) and call.push_to_hub:
            request.started = True  # uploading past this tick: a cancel no longer withdraws it
            state = self.recovery.state(call.run_id)
            self.control.uploads.save_then_upload(request, state, call, lambda answer: answers.append((request, answer)))
            return None
        return self.handlers.answer(call)

    def _begin_frozen(self, request: Request, samples: dict[str, list[SampleJob]]) -> Answer | None:
        """A sample into this tick's decode group on its base, from the weights its call names (on frozen weights
        or a run's current ones), or a forward on a snapshot, answered now; one whose snapshot a queued call still
        makes waits for that call."""
        call = request.call
        if isinstance(call, Sample):
            replayed = self.sampling.replayed(call)
            if replayed is not None:
                return replayed
        assert isinstance(call, (Sample, Forward))
        try:
            source = self._source(call)
        except weights_sources.Pending:
            self.scheduler.park(request)
            return None
        if isinstance(call, Forward):
            return self.training.forward(call, source)
        job = self.sampling.prepare(request, source, call)
        samples.setdefault(source.base_key, []).append(job)
        return None

    def _source(self, call: Sample | Forward) -> weights_sources.WeightsSource:
        """The one way a call's weights are found: a run's current ones, a snapshot of it, or a base alone."""
        return weights_sources.resolve(call, self.residency, self.snapshots, self.recovery.state, self._save_pending,
                                       copy_latest=self.ranks is None)

    def _copies_latest(self, call: Call) -> bool:
        """False for a sample on the latest weights in a multi-GPU pool, which keeps no copies (its ranks hold their
        own adapters): it queues on its run with no ticket, and decodes the run's weights holding the run."""
        return not (isinstance(call, Sample) and call.latest and self.ranks is not None)

    def _save_pending(self, run_id: str, name: str) -> bool:
        return any(isinstance(r.call, SaveWeightsForSampler) and r.call.name == name
                   for r in self.scheduler.queued_on(run_id))

    def _answer_now(self, request: Request) -> Answer:
        return self.handlers.answer(request.call)

    def _handlers(self) -> Handlers:
        """A call answered now: which room answers it (forward_backward and sample are the tick's passes)."""
        state = self.recovery.state
        return (Handlers()
                .add(CreateRun, self.control.create_run)
                .add(OptimStep, self._optim_step)
                .add(Forward, lambda c: self.training.forward(c, self._source(c)))  # a run's weights, or a base alone
                .add(RenderDatums, lambda c: self.training.render_datums(state(c.run_id), c))
                .add(SaveState, lambda c: self.control.save_state(state(c.run_id), c))
                .add(RunInfo, lambda c: self.control.describe(state(c.run_id)))
                .add(LoadRun, lambda c: self.control.describe(state(c.run_id)))
                .add(CloseRun, lambda c: self.control.close_run(c.run_id))
                .add(DeleteRun, lambda c: self.control.delete_run(c.run_id))
                .add(ExportCheckpoint, self.control.export_checkpoint)
                .add(SaveWeightsForSampler, lambda c: self.control.save_weights_for_sampler(state(c.run_id), c))
                .add(LoadState, lambda c: self.control.load_state(state(c.run_id), c))
                .add(DeleteCheckpoint, self.control.delete_checkpoint)
                .add(Ping, lambda c: self.control.ping())
                .add(RuntimeState, lambda c: RuntimeStateResult(state=self.control.runtime_state()))
                .add(Tokenizer, lambda c: self.sampling.tokenizer(c, state(c.run_id) if c.run_id is not None else None))
                .add(RenderChat, lambda c: self.sampling.render_chat(c, state(c.run_id) if c.run_id is not None
                                                                     else None))
                .add(Cancel, self.in_flight.cancel))

    def _begin_step(self, request: Request, call: OptimStep) -> Answer | None:
        """An optim_step into this tick's next optimizer tick (_optim_tick), or its answer now (a retry's, a refusal)."""
        begun = self.training.begin_optim(self.recovery.state(call.run_id), call)
        if isinstance(begun, StepCall):
            self._stepping.append((request, begun))
            return None
        return begun

    def _steps_after(self, passed: list[Answered], stats: TickStats) -> list[Answered]:
        """Optim_steps right behind a forward_backward these passes completed, in one more optimizer tick: one fsync
        covers both records, the pass's first (a pipelining client pays one tick a step)."""
        done = [request for request, answer in passed if isinstance(answer, ForwardBackwardResult)]
        joined = self.scheduler.next_calls(done, lambda r: isinstance(r.call, OptimStep))
        stats.joined, stats.requests = len(joined), stats.requests + len(joined)
        begun = [(r, isolated(r, functools.partial(self._begin_step, r, cast(OptimStep, r.call)))) for r in joined]
        return [(request, answer) for request, answer in begun if answer is not None] + self._optim_tick()

    def _optim_tick(self) -> list[Answered]:
        """The tick's optim_steps, every run's in one optimizer tick; a run whose step is due gets its snapshot."""
        stepping, self._stepping = self._stepping, []
        if not stepping:
            return []
        try:
            outcomes = self.training.optim_tick([step for _, step in stepping])
        except Exception as exc:  # noqa: BLE001 - a failing tick fails its calls, not the runtime
            return [(request, internal(exc, request)) for request, _ in stepping]
        answers: list[Answered] = []
        for (request, step), outcome in zip(stepping, outcomes):
            if isinstance(outcome, SignalError):
                answers.append((request, outcome))
                continue
            failed = isolated(request, functools.partial(self.recovery.snapshot_if_due, step.state))
            answers.append((request, failed if failed is not None else outcome))
        return answers

    def _optim_step(self, call: OptimStep) -> OptimStepResult:
        state = self.recovery.state(call.run_id)
        result = self.training.optim_step(state, call)
        if not result.replayed:
            self.recovery.snapshot_if_due(state)
        return result

    # ---- between calls ----------------------------------------------------------------------

    def _housekeeping(self) -> None:
        decoding = self.sampling.decoding_runs
        self.snapshots.drop_unread_latest()
        self.snapshots.expire()
        self.snapshots.evict_over_budget()  # idle snapshots before runs: a run's training state is dearer to reload
        if not self.free_space.below(self.options.min_free_disk_bytes, fresh=True):  # eviction writes snapshots
            self.recovery.evict_over_budget(busy=lambda r: r in decoding or self.scheduler.is_queued(r))
        self.residency.unload_idle_bases()
        self.compute.keepalive()

    def shutdown(self) -> None:
        """Let Hub uploads in flight answer; snapshot every resident run that changed, and close its journal."""
        self.control.uploads.wait()
        self.recovery.shutdown()
        self.compute.stop()

    def _restart_ranks(self) -> None:
        """A rank died or hung, and every rank was stopped. The runs' in-memory state may be half a pass along, so it
        is dropped unsaved: every acknowledged call is in a journal. What was mid-flight fails; calls still queued
        start afresh; runs come back from snapshot + journal on their next call, through a fresh group."""
        error = WorkerFailed(f"a rank of this pool failed ({self.compute.failed}); the pool restarted: retry the call")
        self.in_flight.fail_all(error)
        self.residency.forget()
        self.compute.restart()
