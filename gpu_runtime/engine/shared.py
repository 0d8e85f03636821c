"""What the engine's rooms share: the device, options, residency, compute, scheduler, journals and counters.

The engine (gpu_runtime/engine/engine.py) builds one `Shared` and hands it to each room: training calls,
sampling calls, control calls and recovery. A room reads and changes these; none calls another's
internals.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpu_runtime.compute.hardware import LocalCompute
from gpu_runtime.compute.models import ModelRegistry
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.engine.journal import sync_all
from gpu_runtime.engine.journal_records import Record
from gpu_runtime.engine.request import Answer, Request
from gpu_runtime.engine.residency import Residency
from gpu_runtime.engine.run_state import RunState
from gpu_runtime.engine.scheduler import Scheduler
from gpu_runtime.errors import InternalError, SignalError

RECENT_TICKS = 60  # ticks that did work, kept for runtime_state (the admin page's chart)


@dataclass
class TickStats:
    number: int = 0
    requests: int = 0
    system: int = 0  # of them, calls on no run (ping, runtime_state, tokenizer…): alone they make no tick worth listing
    fb_rows: int = 0
    fb_runs: int = 0
    base_passes: int = 0  # forward+backward passes of a base (one per base per tick when co-batched)
    decode_passes: int = 0
    decode_rows: int = 0
    fb_seconds: float = 0.0  # of the forward+backward passes: what their calls' compute_seconds add up to
    restores: int = 0  # evicted runs brought back in this tick (their journals replayed)
    joined: int = 0  # optim_steps stepped in the tick their run's forward_backward completed (Engine._steps_after)
    seconds: float = 0.0


@dataclass
class Totals:
    ticks: int = 0
    base_passes: int = 0
    fb_rows: int = 0
    decode_passes: int = 0
    evictions: int = 0
    snapshots: int = 0
    last_ticks: list[JSONObject] = field(default_factory=list)  # TickStats as the runtime state shows them

    def count(self, stats: TickStats) -> None:
        self.ticks += 1
        self.base_passes += stats.base_passes
        self.fb_rows += stats.fb_rows
        self.decode_passes += stats.decode_passes
        if stats.requests > stats.system or stats.decode_passes:  # an admin reading the state adds no tick to it
            self.last_ticks = (self.last_ticks + [stats.__dict__.copy()])[-RECENT_TICKS:]


Answered = tuple[Request, Answer]  # a request and its result or error, sent once the tick's journals are synced


@dataclass
class Shared:
    data_dir: Path
    device: torch.device
    dtype: torch.dtype
    options: RuntimeOptions
    faults: set[str]
    models: ModelRegistry
    residency: Residency
    compute: LocalCompute
    scheduler: Scheduler
    # Called once per tick after its journal fsyncs, before its answers, and after snapshots written outside a
    # tick's calls (evictions): Modal commits the Volume there.
    after_sync: Callable[[], None] | None = None
    totals: Totals = field(default_factory=Totals)
    owners: dict[str, str] = field(default_factory=dict)  # run → user, for fair turns
    touched: set[str] = field(default_factory=set)  # runs whose journal has records not yet fsync'd
    unwritten: dict[str, OSError] = field(default_factory=dict)  # runs whose journal write failed this tick
    armed: set[str] = field(default_factory=set)  # failpoint enospc_journal: runs whose next sync fails
    # Runs whose memory holds a call that failed after its pass (gradients summed, never journaled): each leaves
    # memory unsaved once the tick's journals are synced, and comes back from snapshot + journal without it.
    discarded: dict[str, SignalError] = field(default_factory=dict)
    snapshotted: bool = False  # a snapshot was written since the last after_sync (Modal commits it then)

    def crash_at(self, failpoint: str) -> None:
        """A crash test's failpoint (runtime_process.py's docstring lists them): SIGKILL here, as a power cut would."""
        if failpoint in self.faults:
            os.kill(os.getpid(), signal.SIGKILL)

    def entry(self, state: RunState) -> BaseEntry:
        return self.residency.bases[state.base_key]

    def journal(self, state: RunState, record: Record) -> None:
        """Append an acknowledged call to its run's journal; it is fsync'd before the tick answers. A failed write
        is kept for `sync_journals` to report: every call of that run in this tick then fails."""
        if "enospc_journal" in self.faults and str(record.request_id or "").startswith("enospc"):
            self.armed.add(state.run_id)  # failpoint: this run's journal sync fails as on a full disk
        try:
            state.journal.append(record.to_dict())
        except OSError as exc:
            self.unwritten.setdefault(state.run_id, exc)
        state.seq += 1
        self.touched.add(state.run_id)

    def sync_journals(self) -> dict[str, OSError]:
        """fsync every journal written this tick; returns the runs whose records could not be made durable."""
        failed, self.unwritten = self.unwritten, {}
        syncing: list[RunState] = []
        for run_id in list(self.touched):
            state = self.residency.runs.get(run_id)
            if state is None or run_id in failed:
                continue
            if run_id in self.armed:
                self.armed.discard(run_id)
                failed[run_id] = OSError(errno.ENOSPC, "No space left on device (failpoint enospc_journal)")
                continue
            syncing.append(state)
        # All at once: one tick's fsyncs are committed together, each durable before any answer of the tick goes out.
        for state, error in zip(syncing, sync_all([state.journal for state in syncing])):
            if error is not None:
                failed[state.run_id] = error
        if (self.touched or self.snapshotted) and self.after_sync is not None:
            self.after_sync()
        self.touched = set()
        self.snapshotted = False
        return failed


def internal(exc: BaseException, request: Request | None = None) -> InternalError:
    """An unexpected exception as an INTERNAL error for its call alone; logged with the call's request id."""
    where = "" if request is None else f" in {request.method} (request {request.request_id or '-'}, run {request.run_id})"
    print(f"error{where}: {type(exc).__name__}: {exc}", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)
    return InternalError(f"{type(exc).__name__}: {exc}")


def isolated(request: Request, work: Callable[[], Answer | None]) -> Answer | None:
    """Run one call's step; its exception becomes its own typed answer (INTERNAL, logged with its id)."""
    try:
        return work()
    except SignalError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - one bad call must not take the runtime down
        return internal(exc, request)
