"""A run's life in memory: found, restored (snapshot + journal replay), snapshotted and evicted.

- **Restore** = the newest snapshot, then every journal record after it (gpu_runtime/engine/training_calls.py
  replays them): the run as if it never stopped. Replaying up to `snapshot_every_steps` passes takes
  seconds on CPU, so the engine restores at most `RESTORES_PER_TICK` runs per tick.
- **Snapshots** are written every `snapshot_every_steps` optim_steps or `snapshot_every_seconds`, on
  save_state, on eviction and at shutdown; the journal is fsync'd first, so a snapshot never covers
  records the journal could still lose.
- **Eviction** is one step: pick the least recently used idle runs past the budget, snapshot those that
  changed, and free them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.client.persistence import check_id, find_run_dir, read_json, sweep_temporaries
from gpu_runtime.engine.disk import disk_full_error, is_disk_full
from gpu_runtime.engine.journal_records import Record, record_from_dict
from gpu_runtime.engine.run_state import RunConfig, RunState
from gpu_runtime.engine.shared import Shared
from gpu_runtime.errors import InternalError, RunNotFound, SignalError

RESTORES_PER_TICK = 1  # one restore's replay per tick, so one evicted run coming back does not stall every tenant


class Recovery:
    def __init__(self, shared: Shared, replay: Callable[[RunState, Record], None]) -> None:
        self.shared = shared
        self.replay = replay  # applies one journal record (Training.replay)

    # ---- finding runs ----------------------------------------------------------------------

    def resident(self, run_id: str) -> RunState | None:
        state = self.shared.residency.runs.get(run_id)
        if state is not None:
            self.shared.residency.touch(state)
        return state

    def exists(self, run_id: str) -> bool:
        return run_id in self.shared.residency.runs or find_run_dir(self.shared.data_dir, run_id) is not None

    def owner(self, run_id: str) -> str:
        """The run's user, for fair turns ("__unknown__": it fails with NOT_FOUND when its turn comes)."""
        owners = self.shared.owners
        if run_id not in owners:
            root = find_run_dir(self.shared.data_dir, run_id)
            if root is None:
                return "__unknown__"
            owners[run_id] = read_json(root / "config.json")["user_id"]
        return owners[run_id]

    def state(self, run_id: str) -> RunState:
        """The run in memory, restored from disk if it is not (NOT_FOUND if it has no directory)."""
        check_id(run_id, "run_id")
        state = self.resident(run_id)
        if state is None:
            root = find_run_dir(self.shared.data_dir, run_id)
            if root is None:
                raise RunNotFound(f"run {run_id!r} not found", field="run_id")
            state = self.restore(read_json(root / "config.json"))
            self.shared.residency.touch(state)
        return state

    def restore(self, config: RunConfig) -> RunState:
        """The newest snapshot, then every journal record after it: the run as if it never stopped."""
        residency = self.shared.residency
        state = residency.attach(config, self.shared.data_dir)
        try:
            self.sweep(state)
            state.load_latest_snapshot(self.shared.device)
            records, first = state.journal.read(), state.journal.first_seq
            if state.seq < first:  # compaction keeps records back to the oldest snapshot: one went missing
                raise InternalError(f"run {state.run_id}: its journal starts at record {first}, after the newest "
                                    f"snapshot's {state.seq}; the records between are gone")
            for record in records[state.seq - first:]:
                self.replay(state, record_from_dict(record))
            state.seq = first + len(records)
        except BaseException:
            residency.detach(state.run_id)  # never leave a half-restored run in memory
            raise
        if residency.bases[state.base_key].base.revision != config.get("base_revision"):
            print(f"warning: run {state.run_id}: base model revision changed since the run was created", file=sys.stderr)
        return state

    def sweep(self, state: RunState) -> None:
        """What saves, snapshots and loads of this run left when a crash cut them short, swept as the run comes back
        (one pool holds a run at a time, so no write of it is under way; a whole-directory sweep at start could take a
        file another pool on the same Volume is writing): temporaries go, a replaced directory moved aside returns."""
        swept = sweep_temporaries(state.paths.root)
        if swept.removed or swept.restored:
            print(f"run {state.run_id}: swept {swept.removed} temporaries of interrupted saves "
                  f"({swept.removed_bytes} bytes), restored {swept.restored} replaced directories", file=sys.stderr)

    # ---- snapshots -------------------------------------------------------------------------

    def snapshot(self, state: RunState, required: bool = True) -> bool:
        """Snapshot the run (its journal synced first). On a full disk: RESOURCE_EXHAUSTED when the snapshot is the
        call's own work (`required`: save_state, create_run from a checkpoint); else (a periodic, covering, eviction
        or shutdown snapshot) the call it follows is applied and journaled already, so it is logged and skipped:
        restore is the last snapshot plus the journal, and the next one is due again at once. Whether it was written."""
        try:
            state.journal.sync()  # a snapshot never covers records the journal could still lose
        except OSError as exc:
            self.shared.unwritten.setdefault(state.run_id, exc)  # the tick drops the run (drop_unwritten)
            raise
        faults = self.shared.faults
        fault = next((f for f in ("during_snapshot", "enospc_snapshot") if f in faults), None)
        try:
            state.write_snapshot(self.shared.entry(state).base.name, fault)
        except (OSError, RuntimeError) as exc:  # torch reports a full disk as RuntimeError ("unexpected pos")
            if not is_disk_full(exc, self.shared.data_dir, self.shared.options.min_free_disk_bytes):
                raise
            error = disk_full_error(self.shared.data_dir, exc)  # half-written files went with atomic_dir's temp
            if required:
                raise error from None
            print(f"run {state.run_id}: snapshot skipped, the disk is full; its journal holds every acknowledged call",
                  file=sys.stderr)
            return False
        state.prune_snapshots(self.shared.options.keep_snapshots, self._compaction_fault())
        self.shared.totals.snapshots += 1
        self.shared.snapshotted = True
        return True

    def _compaction_fault(self) -> Callable[[Path], None] | None:
        """The failpoint during_compaction: killed once the first old journal segment is deleted, before the rest."""
        if "during_compaction" not in self.shared.faults:
            return None
        return lambda _: os.kill(os.getpid(), signal.SIGKILL)

    def snapshot_if_due(self, state: RunState) -> None:
        options = self.shared.options
        due = state.step - max(state.snapshot_step, 0) >= options.snapshot_every_steps
        late = time.monotonic() - state.snapshot_time >= options.snapshot_every_seconds
        if due or late:
            self.snapshot(state, required=False)

    # ---- eviction --------------------------------------------------------------------------

    def evict(self, state: RunState, count: bool = True) -> None:
        """Snapshot the run if it changed, then free it; it comes back on its next call."""
        if (state.changed_since_snapshot or state.pending.calls) and not self.snapshot(state, required=False):
            return  # the snapshot was skipped (a full disk): the run stays in memory, nothing is lost
        self.shared.residency.detach(state.run_id, evicted=count)
        if count:
            self.shared.totals.evictions += 1

    def evict_over_budget(self, busy: Callable[[str], bool]) -> None:
        """Evict least recently used runs that are not `busy` until the resident budget holds."""
        for state in self.shared.residency.over_budget(keep=busy):
            self.evict(state)
        if self.shared.snapshotted:
            self.shared.sync_journals()  # eviction snapshots are committed as they are written, not at the next tick

    def shutdown(self) -> None:
        """Snapshot every resident run that changed, and close its journal."""
        for state in list(self.shared.residency.runs.values()):
            if state.changed_since_snapshot:
                self.snapshot(state, required=False)
            state.journal.close()

    def drop_unwritten(self, failed: dict[str, OSError]) -> dict[str, SignalError]:
        """Runs whose journal could not be written this tick: the journal is cut back to what is durable, snapshots
        past it are removed, and the run leaves memory unsaved (memory holds calls the disk does not), so its next
        call restores it from snapshot + journal as if those calls never came, their request ids forgotten.
        Returns each run's error, for every call of it in the tick."""
        errors: dict[str, SignalError] = {}
        options = self.shared.options
        for run_id, exc in failed.items():
            full = is_disk_full(exc, self.shared.data_dir, options.min_free_disk_bytes)
            error = disk_full_error(self.shared.data_dir, exc) if full else InternalError(
                f"the run's journal could not be written ({type(exc).__name__}); nothing of this call was applied")
            errors[run_id] = error
            state = self.shared.residency.runs.get(run_id)
            if state is None:
                continue
            try:
                state.journal.abandon()
            except OSError as cut:  # the unsynced tail may survive: say so where the operator looks
                print(f"run {run_id}: could not cut its journal back after a failed write: {cut}", file=sys.stderr)
            state.drop_snapshots_after(state.journal.synced_seq)
            self.shared.residency.detach(run_id)
        return errors

