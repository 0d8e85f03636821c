"""Sampler snapshots: a run's adapter frozen read-only in the pool (save_weights_for_sampler; docs/SNAPSHOTS.md).

A snapshot is a copy of the run's A/B matrices at the moment its call was applied, registered in the base's
multi-LoRA layers under the routing key "<run_id>@<name>", so its rows share decode groups with every other
run's and the run trains on without touching it.

- **Named** snapshots are written under the run's directory (`checkpoints/sampler/<name>/`, a PEFT adapter)
  before the call is answered: they are listed, downloadable, and load again from disk after a restart or an
  eviction. No journal record is needed: the directory is the record (fsync'd), and it never changes.
- **Unnamed** snapshots live in memory only and expire `unnamed_snapshot_seconds` after they were made. One
  evicted for memory spills to `scratch/snapshots/` and loads back from there; its file is deleted when it
  expires. The scratch directory is emptied when the runtime starts: after a restart an unnamed snapshot is
  NOT_FOUND, and the message says to make another.
- **Copies of the latest** (`latest`): a sample on a run's current weights off its queue (`Sample.latest`, /v1 on a
  run id) reads a copy of the run's adapter made when it is picked, "<run_id>@latest:<step>-<id>". Every such sample
  picked while the run is at that step shares the copy; an optim_step makes the next one read a new copy and changes
  nothing a decode reads. A copy goes as soon as no decode reads it (`drop_unread_latest`), and an eviction of its
  run mid-decode does not touch it. Not kept on a multi-GPU pool, whose ranks hold their own adapters: there such a
  sample queues on its run as before (gpu_runtime/engine/engine.py).
- They count against the resident budget (`Residency.resident_bytes`). One a decode group is using
  (`in_use`) is never evicted, expired or deleted: deleting it, or its run, is refused (FAILED_PRECONDITION).
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.client.persistence import RunPaths, atomic_dir, dir_size, find_run_dir, read_json, write_json
from gpu_runtime.compute.lora.experts import attach_experts, detach_experts, peft_names, targeted_paths
from gpu_runtime.compute.lora.wrap import wrap_targets
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.quantization import base_key
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.engine.residency import Residency
from gpu_runtime.engine.run_state import (
    ADAPTER_WEIGHTS,
    CHECKPOINT_FILE,
    WEIGHTS_VERSIONS,
    RunConfig,
    RunState,
    checkpoint_dir,
    split_expert_weights,
)
from gpu_runtime.errors import FailedPrecondition, NotFound

SAMPLER_MODE = "sampler"  # the checkpoints table's `mode` of a named snapshot
SAMPLER_FILE = "sampler.json"  # beside a named snapshot's adapter: its name, run and step


LATEST_PREFIX = "latest:"  # a copy of a run's current weights: "<run_id>@latest:<step>-<id>"
CHECKPOINT_PREFIX = "checkpoint:"  # a training checkpoint read as a snapshot: "<run_id>@checkpoint:<name>"
READABLE_KINDS = ("state", "adapter")  # training checkpoints that hold an adapter to sample or score


def routing_key(run_id: str, name: str) -> str:
    return f"{run_id}@{name}"


def snapshot_dir(run_root: Path, name: str) -> Path:
    """A named snapshot's directory: where every checkpoint of kind "sampler" lives (run_state.checkpoint_dir), so
    listing, downloading and delete_checkpoint find it like any other."""
    run_root = Path(run_root)
    return checkpoint_dir(RunPaths(run_root.parents[2], run_root.parent.name, run_root.name), SAMPLER_MODE, name)


@dataclass(eq=False)
class Snapshot:
    run_id: str
    user_id: str
    name: str
    named: bool
    step: int
    base_key: str
    config: RunConfig  # the run's config.json: base, quantization, LoRA settings
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None  # layer path → (A, B); None: not in memory
    path: Path | None = None  # named: its directory; unnamed and spilled: its scratch file
    expires_at: float | None = None  # time.monotonic() deadline (unnamed only)
    in_use: int = 0  # decode jobs reading it right now
    latest: bool = False  # a copy of the run's current weights for samples off its queue (Snapshots.latest)
    # its weights' number (run_state.WEIGHTS_VERSIONS): a latest copy's is the run's when copied; another, its own
    weights_version: int = field(default_factory=lambda: next(WEIGHTS_VERSIONS))
    last_used: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> str:
        return routing_key(self.run_id, self.name)

    def resident_bytes(self) -> int:
        if self.weights is None:
            return 0
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


class Snapshots:
    """Every snapshot this runtime knows, in memory or on disk; the residency sees them for the budget."""

    def __init__(self, data_dir: Path, residency: Residency, expiry_seconds: float) -> None:
        self.data_dir = Path(data_dir)
        self.residency = residency
        self.expiry_seconds = expiry_seconds
        self.scratch = self.data_dir / "scratch" / "snapshots"
        shutil.rmtree(self.scratch, ignore_errors=True)  # unnamed snapshots do not outlive their runtime
        self.entries: dict[str, Snapshot] = {}  # routing key → snapshot (named ones once used since start)
        self._latest: dict[str, Snapshot] = {}  # run → the copy of its current weights samples picked now share
        residency.snapshots = self.entries

    # ---- making one ------------------------------------------------------------------------

    def save(self, state: RunState, entry: BaseEntry, name: str | None,
             crash: Callable[[str], None] = lambda failpoint: None) -> Snapshot:
        key = routing_key(state.run_id, name) if name else None
        old = self.entries.get(key) if key else None
        if old is not None and old.in_use:
            raise FailedPrecondition(f"snapshot {name!r} of run {state.run_id} is being sampled; save it under another "
                                     "name, or again once those samples finish", field="name")
        weights = {path: (A.detach().clone(), B.detach().clone()) for path, (A, B) in state.weights.items()}
        snapshot = Snapshot(run_id=state.run_id, user_id=state.user_id, name=name or f"tmp-{uuid.uuid4().hex[:12]}",
                            named=name is not None, step=state.step, base_key=state.base_key, config=state.config,
                            weights=weights)
        if name is not None:
            snapshot.path = snapshot_dir(state.paths.root, name)
            # Whole once renamed in place (the named snapshot's record); after a crash, the old one or none.
            with atomic_dir(snapshot.path, before_swap=lambda: crash("during_swap")) as tmp:
                state.save_adapter(tmp, entry.base.name)
                write_json(tmp / SAMPLER_FILE, {"name": name, "run_id": state.run_id, "step": state.step})
                crash("during_save")
        else:
            snapshot.expires_at = time.monotonic() + self.expiry_seconds
        if old is not None:
            self._unregister(old)
        self.entries[snapshot.key] = snapshot
        self._register(snapshot, entry)
        return snapshot

    def latest(self, state: RunState, entry: BaseEntry) -> Snapshot:
        """The run's weights as they are now, copied for the samples that read them off its queue: one copy per step,
        shared by every such sample picked while it is the run's step (LoRA weights are small; the copy is cheap)."""
        snapshot = self._latest.get(state.run_id)
        if snapshot is None or snapshot.weights_version != state.weights_version or snapshot.weights is None:
            weights = {path: (A.detach().clone(), B.detach().clone()) for path, (A, B) in state.weights.items()}
            snapshot = Snapshot(run_id=state.run_id, user_id=state.user_id, step=state.step, base_key=state.base_key,
                                name=f"{LATEST_PREFIX}{state.step}-{uuid.uuid4().hex[:8]}", named=False,
                                config=state.config, weights=weights, latest=True,
                                weights_version=state.weights_version)
            self._latest[state.run_id] = snapshot
            self.entries[snapshot.key] = snapshot
            self._register(snapshot, entry)
        snapshot.last_used = time.monotonic()
        return snapshot

    def retire_latest(self, run_id: str) -> None:
        """The run's weights changed without a step (load_state): later samples copy them again."""
        self._latest.pop(run_id, None)

    def drop_unread_latest(self) -> None:
        """Copies of the latest that no decode reads any more (each tick's housekeeping)."""
        for snapshot in [s for s in self.entries.values() if s.latest and not s.in_use]:
            self._drop(snapshot)

    # ---- finding one -----------------------------------------------------------------------

    def find(self, run_id: str, name: str, checkpoint: bool = False) -> Snapshot | None:
        """The snapshot, in memory (loaded back if it was evicted), or None: no such snapshot. With `checkpoint`, the
        run's training checkpoint `name` (kind state, else adapter), loaded read-only as a named snapshot would be."""
        snapshot = self.entries.get(routing_key(run_id, CHECKPOINT_PREFIX + name if checkpoint else name))
        if snapshot is None:
            snapshot = self._checkpoint_from_disk(run_id, name) if checkpoint else self._from_disk(run_id, name)
            if snapshot is None:
                return None
            self.entries[snapshot.key] = snapshot
        entry = self._entry(snapshot)
        if snapshot.weights is None:
            assert snapshot.path is not None
            paths = targeted_paths(entry.layers, snapshot.config["lora"]["target_modules"])
            snapshot.weights = _read(snapshot.path / ADAPTER_WEIGHTS if snapshot.named else snapshot.path,
                                     self.residency.models.device, paths)
            if not snapshot.named:  # back in memory: the spill is no longer needed
                snapshot.path.unlink(missing_ok=True)
                snapshot.path = None
        self._register(snapshot, entry)
        snapshot.last_used = time.monotonic()
        return snapshot

    @staticmethod
    def not_found(run_id: str, name: str) -> NotFound:
        return NotFound(f"run {run_id} has no sampler snapshot {name!r}: unnamed snapshots expire and do not survive a "
                        "runtime restart; call save_weights_for_sampler again (with a name to keep it)", field="snapshot")

    def _from_disk(self, run_id: str, name: str) -> Snapshot | None:
        root = find_run_dir(self.data_dir, run_id)
        if root is None or not (snapshot_dir(root, name) / ADAPTER_WEIGHTS).is_file():
            return None
        config = read_json(root / "config.json")
        meta = snapshot_dir(root, name) / SAMPLER_FILE
        step = int(read_json(meta)["step"]) if meta.is_file() else -1
        return Snapshot(run_id=run_id, user_id=config["user_id"], name=name, named=True, step=step,
                        base_key=base_key(config["base_model"], config.get("quantization")), config=config,
                        weights=None, path=snapshot_dir(root, name))

    def _checkpoint_from_disk(self, run_id: str, name: str) -> Snapshot | None:
        root = find_run_dir(self.data_dir, run_id)
        if root is None:
            return None
        paths = RunPaths(root.parents[2], root.parent.name, root.name)
        for kind in READABLE_KINDS:
            directory = checkpoint_dir(paths, kind, name)
            if (directory / ADAPTER_WEIGHTS).is_file():
                break
        else:
            return None
        config = read_json(root / "config.json")
        meta = directory / CHECKPOINT_FILE
        step = int(read_json(meta).get("step", -1)) if meta.is_file() else -1
        return Snapshot(run_id=run_id, user_id=config["user_id"], name=CHECKPOINT_PREFIX + name, named=True, step=step,
                        base_key=base_key(config["base_model"], config.get("quantization")), config=config,
                        weights=None, path=directory)

    def forget_checkpoint(self, run_id: str, name: str) -> None:
        """A training checkpoint about to be deleted: out of the layers, or FAILED_PRECONDITION while it is read."""
        snapshot = self.entries.get(routing_key(run_id, CHECKPOINT_PREFIX + name))
        if snapshot is None:
            return
        if snapshot.in_use:
            raise FailedPrecondition(f"checkpoint {name!r} of run {run_id} is being sampled; delete it once those "
                                     "calls finish", field="name")
        self._drop(snapshot)

    # ---- using one -------------------------------------------------------------------------

    def acquire(self, snapshot: Snapshot) -> None:
        snapshot.in_use += 1
        snapshot.last_used = time.monotonic()

    def release(self, snapshot: Snapshot) -> None:
        snapshot.in_use = max(snapshot.in_use - 1, 0)
        snapshot.last_used = time.monotonic()

    # ---- memory and time ---------------------------------------------------------------------

    def evict(self, snapshot: Snapshot) -> None:
        """Free its memory: a named one reloads from its directory, an unnamed one spills to scratch first."""
        if snapshot.in_use or snapshot.weights is None:
            return
        if snapshot.latest:  # nobody reads it: a later sample copies the run again
            self._drop(snapshot)
            return
        if not snapshot.named:
            self.scratch.mkdir(parents=True, exist_ok=True)
            snapshot.path = self.scratch / f"{snapshot.key}.safetensors"
            names = peft_names(snapshot.weights)
            tensors = {names[path][m]: t.cpu().contiguous()
                       for path, (A, B) in snapshot.weights.items() for m, t in ((0, A), (1, B))}
            save_file(tensors, str(snapshot.path))
        self._unregister(snapshot)
        snapshot.weights = None

    def evict_over_budget(self) -> None:
        """Least recently used idle snapshots go first while the pool is over its resident bytes."""
        budget = self.residency.budget_bytes()
        for snapshot in sorted(self.entries.values(), key=lambda s: s.last_used):
            if self.residency.resident_bytes() <= budget:
                return
            self.evict(snapshot)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop unnamed snapshots past their time (not while sampled), spills included."""
        now = time.monotonic() if now is None else now
        gone = [s for s in self.entries.values()
                if not s.named and s.expires_at is not None and s.expires_at <= now and not s.in_use]
        for snapshot in gone:
            self._drop(snapshot)
        return [s.key for s in gone]

    # ---- deleting ------------------------------------------------------------------------------

    def delete(self, run_id: str, name: str) -> None:
        snapshot = self.find(run_id, name)
        if snapshot is None:
            raise self.not_found(run_id, name)
        if snapshot.in_use:
            raise FailedPrecondition(f"snapshot {name!r} of run {run_id} is being sampled; delete it once those samples "
                                     "finish", field="snapshot")
        self._drop(snapshot)
        if snapshot.named and snapshot.path is not None:
            shutil.rmtree(snapshot.path, ignore_errors=True)

    def check_run_deletable(self, run_id: str) -> None:
        busy = [s.name for s in self.entries.values() if s.run_id == run_id and s.in_use]
        if busy:
            raise FailedPrecondition(f"run {run_id}'s snapshots {busy} are being sampled; delete the run once those "
                                     "samples finish", field="run_id")

    def drop_run(self, run_id: str) -> None:
        for snapshot in [s for s in self.entries.values() if s.run_id == run_id]:
            self._drop(snapshot)

    def of_run(self, run_id: str) -> list[Snapshot]:
        return [s for s in self.entries.values() if s.run_id == run_id]

    def describe(self) -> list[JSONObject]:
        now = time.monotonic()
        return [{"key": s.key, "named": s.named, "in_memory": s.weights is not None, "in_use": s.in_use,
                 "bytes": s.resident_bytes(),
                 "expires_in_seconds": None if s.expires_at is None else round(s.expires_at - now, 1)}
                for s in self.entries.values()]

    def size_bytes(self, snapshot: Snapshot) -> int:
        return dir_size(snapshot.path) if snapshot.named and snapshot.path is not None else snapshot.resident_bytes()

    # ---- the multi-LoRA layers -------------------------------------------------------------------

    def _entry(self, snapshot: Snapshot) -> BaseEntry:
        config = snapshot.config
        entry = self.residency.base(config["base_model"], config.get("quantization"))
        entry.layers = wrap_targets(entry.model, config["lora"]["target_modules"], entry.routing)
        return entry

    def _register(self, snapshot: Snapshot, entry: BaseEntry) -> None:
        assert snapshot.weights is not None
        lora = snapshot.config["lora"]
        # Read-only: no dropout (sampling draws none) and no gradient; its matrices become views of its slot.
        linear, experts = split_expert_weights(snapshot.weights)
        scaling = lora["alpha"] / lora["r"]
        if linear:
            entry.routing.slots.attach(snapshot.key, entry.layers, linear, lora["r"], scaling, 0.0, trainable=False)
        attach_experts(entry.routing.slots, snapshot.key, entry.layers, experts, lora["r"], scaling, 0.0, trainable=False)

    def _unregister(self, snapshot: Snapshot) -> None:
        entry = self.residency.bases.get(snapshot.base_key)
        if entry is not None:
            entry.routing.slots.detach(snapshot.key)
            detach_experts(entry.routing.slots, snapshot.key)

    def _drop(self, snapshot: Snapshot) -> None:
        self._unregister(snapshot)
        snapshot.weights = None
        if not snapshot.named and snapshot.path is not None:
            snapshot.path.unlink(missing_ok=True)
        self.entries.pop(snapshot.key, None)
        if self._latest.get(snapshot.run_id) is snapshot:
            del self._latest[snapshot.run_id]


def _read(path: Path, device: torch.device, paths: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A snapshot's A/B matrices from a PEFT adapter file (or a spill in the same naming), by layer path: `paths`,
    the run's targets on its base, name them (an expert parameter's key says its module, not the parameter)."""
    tensors = load_file(str(path), device=str(device))
    names = peft_names(paths)
    return {p: (tensors[a], tensors[b]) for p, (a, b) in names.items() if a in tensors}
