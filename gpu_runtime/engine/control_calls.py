"""The runtime's control calls: create (from a checkpoint too), save (and upload), load, export, delete
checkpoints, describe, close and delete runs; ping and the operator's view of the runtime.

Checkpoints (docs/CHECKPOINTS.md): `checkpoints/{mode}_step_N` (named step-N, a save without a name) or
`checkpoints/{mode}/{name}`, each with a `checkpoint.json` saying what resuming needs. load_state and
create_run(from_checkpoint=…) copy the checkpoint's files into the run, journal the load, and snapshot at once,
so the run never needs the checkpoint again (it may be deleted).
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import tarfile
import time
from pathlib import Path

import peft
import torch
import transformers

from gpu_runtime.client.persistence import (
    RunPaths,
    append_manifest,
    atomic_dir,
    dir_size,
    find_run_dir,
    read_json,
    write_json,
)
from gpu_runtime.compute.devices import dtype_name
from gpu_runtime.compute.hardware import RankCompute
from gpu_runtime.compute.merging import save_merged
from gpu_runtime.compute.models import describe
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.quantization import checked as checked_quantization
from gpu_runtime.contract import (
    CONTRACT_VERSION,
    CloseRunResult,
    CreateRun,
    DeleteCheckpoint,
    DeleteCheckpointResult,
    DeleteRunResult,
    ExportCheckpoint,
    ExportCheckpointResult,
    LoadState,
    LoadStateResult,
    PingResult,
    RunDescription,
    SaveState,
    SaveStateResult,
    SaveWeightsForSampler,
    SaveWeightsForSamplerResult,
    checkpoint_ref,
    default_checkpoint_name,
    lora_settings,
)
from gpu_runtime.contract.checkpoints import DEFAULT_NAME, CheckpointRef
from gpu_runtime.contract.json_types import JSONObject, typed_json
from gpu_runtime.engine.journal_records import LOAD_STATE, LoadStateRecord  # replayed from the run's own copy
from gpu_runtime.engine.recovery import Recovery
from gpu_runtime.engine.run_state import (
    ADAPTER_WEIGHTS,
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    LEGACY_OPTIMIZER_FILE,
    LOADS_DIR,
    CheckpointMeta,
    RunConfig,
    RunState,
    check_same_body,
    checkpoint_dir,
)
from gpu_runtime.engine.sampling_calls import Sampling
from gpu_runtime.engine.shared import Shared
from gpu_runtime.engine.snapshots import READABLE_KINDS, SAMPLER_MODE, Snapshots
from gpu_runtime.engine.uploads import Uploads
from gpu_runtime.errors import BadInput, FailedPrecondition, NotFound, RunNotFound

LORA_SHAPE = ("r", "alpha", "target_modules")  # a checkpoint loads into a run only where these agree


class Control:
    def __init__(self, shared: Shared, recovery: Recovery, sampling: Sampling, snapshots: Snapshots) -> None:
        self.shared = shared
        self.recovery = recovery
        self.sampling = sampling
        self.snapshots = snapshots
        self.uploads = Uploads(shared, self.save_state)  # save_state(push_to_hub=True): gpu_runtime/engine/uploads.py

    # ---- runs ------------------------------------------------------------------------------

    def create_run(self, call: CreateRun) -> RunDescription:
        shared = self.shared
        if self.recovery.exists(call.run_id):
            raise BadInput(f"run {call.run_id!r} already exists", field="run_id")
        quantization = checked_quantization(call.quantization)
        source = self._source(call)
        entry = shared.residency.base(call.base_model, quantization)
        lora = source[2]["lora"] if source else lora_settings(call.lora, entry.available)
        seed = source[2]["seed"] if source else call.seed or 0
        config: RunConfig = {
            "run_id": call.run_id, "user_id": call.user_id, "base_model": call.base_model,
            "base_revision": entry.base.revision, "lora": lora, "seed": seed,
            "created_at": time.time(), "quantization": quantization,
        }
        if source:
            config["from_checkpoint"] = source[0].path
        state = shared.residency.attach(config, shared.data_dir)
        try:
            write_json(state.paths.config, config)
            append_manifest(state.paths.manifest, self._manifest_header(state, entry))
            if source:
                ref, directory, meta = source
                state.load_checkpoint_files(directory, call.with_optimizer, int(meta["step"]), shared.device)
                append_manifest(state.paths.manifest, {"event": "from_checkpoint", "checkpoint": ref.path,
                                                       "step": state.step, "with_optimizer": call.with_optimizer})
                self.recovery.snapshot(state)  # seq 0 at the checkpoint's step: the run never reads the checkpoint again
        except BaseException:
            shared.residency.detach(call.run_id)
            shutil.rmtree(state.paths.root, ignore_errors=True)
            raise
        shared.owners[call.run_id] = call.user_id
        return self.describe(state)

    def _source(self, call: CreateRun) -> tuple[CheckpointRef, Path, CheckpointMeta] | None:
        """create_run(from_checkpoint=…): the checkpoint, checked against what the call also says."""
        if call.from_checkpoint is None:
            return None
        if isinstance(self.shared.compute, RankCompute):
            raise FailedPrecondition("a multi-GPU pool cannot start a run from a checkpoint yet: start it on one GPU",
                                     field="from_checkpoint")
        ref = checkpoint_ref(call.from_checkpoint, "from_checkpoint")
        directory, meta = self.find_checkpoint(ref, call.user_id, "from_checkpoint")
        if meta["base_model"] != call.base_model:
            raise BadInput(f"base_model: the checkpoint was trained on {meta['base_model']!r}, not {call.base_model!r}",
                           field="base_model")
        for key, value in (call.lora or {}).items():
            if key == "target_modules" and isinstance(value, list):
                value = sorted(set(value))  # as lora_settings keeps them
            if value is not None and value != meta["lora"].get(key):
                raise BadInput(f"lora.{key}: the checkpoint's is {meta['lora'].get(key)!r}, not {value!r}; a run from "
                               "a checkpoint inherits its LoRA settings", field=f"lora.{key}")
        if call.seed is not None and call.seed != meta["seed"]:
            raise BadInput(f"seed: the checkpoint's is {meta['seed']}, not {call.seed}; a run from a checkpoint "
                           "inherits its seed", field="seed")
        if call.with_optimizer and not meta["with_optimizer"]:
            raise FailedPrecondition("this checkpoint holds no optimizer state: pass with_optimizer false, or save "
                                     "one with it (mode state)", field="with_optimizer")
        return ref, directory, meta

    def describe(self, state: RunState) -> RunDescription:
        trainable = sum(p.numel() for p in state.parameters())
        return RunDescription(
            run_id=state.run_id, user_id=state.user_id, base_model=state.base_model, quantization=state.quantization,
            base_revision=state.config["base_revision"], lora=state.lora, target_modules=state.lora["target_modules"],
            seed=state.config["seed"], step=state.step, trainable_params=trainable,
            total_params=self.shared.entry(state).params + trainable, pending_forward_backward=state.pending.calls,
            pending_tokens=state.pending.tokens, path=str(state.paths.root), device=str(self.shared.device))

    def close_run(self, run_id: str) -> CloseRunResult:
        state = self.shared.residency.runs.get(run_id)
        if state is not None:
            self.recovery.evict(state, count=False)
        elif not self.recovery.exists(run_id):
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        return CloseRunResult(run_id=run_id, closed=True)

    def delete_run(self, run_id: str) -> DeleteRunResult:
        residency = self.shared.residency
        if not self.recovery.exists(run_id):
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        self.snapshots.check_run_deletable(run_id)  # refused while a sample reads one of its snapshots
        self.snapshots.drop_run(run_id)
        residency.detach(run_id)
        residency.evicted.discard(run_id)
        root = find_run_dir(self.shared.data_dir, run_id)
        if root is not None:
            shutil.rmtree(root)
        self.shared.owners.pop(run_id, None)
        return DeleteRunResult(run_id=run_id, deleted=True)

    # ---- sampler snapshots -----------------------------------------------------------------

    def save_weights_for_sampler(self, state: RunState, call: SaveWeightsForSampler) -> SaveWeightsForSamplerResult:
        """Freeze the run's adapter as it is after every call before this one (gpu_runtime/engine/snapshots.py). Not
        journaled: a named one is its own fsync'd directory; an unnamed one is memory only by design."""
        body = call.body_sha256()
        answered = state.answer_to(call.request_id, body)
        if answered is not None:
            return SaveWeightsForSamplerResult.from_dict(answered).replay()
        if isinstance(self.shared.compute, RankCompute):  # the ranks hold their own copies of every adapter
            raise FailedPrecondition("a multi-GPU pool keeps no sampler snapshots yet: sample the run's current "
                                     "weights", field="name")
        started = time.perf_counter()
        snapshot = self.snapshots.save(state, self.shared.entry(state), call.name, self.shared.crash_at)
        expires = None if snapshot.named else self.shared.options.unnamed_snapshot_seconds
        result = SaveWeightsForSamplerResult(
            run_id=state.run_id, name=snapshot.name, step=snapshot.step, named=snapshot.named,
            path=str(snapshot.path.resolve()) if snapshot.path is not None else "",
            size_bytes=self.snapshots.size_bytes(snapshot), expires_in_seconds=expires,
            compute_seconds=self.shared.compute.seconds_since(started))
        state.remember(call.request_id, result.to_dict(), body)
        return result

    # ---- checkpoints -----------------------------------------------------------------------

    def save_state(self, state: RunState, call: SaveState) -> SaveStateResult:
        """Write a checkpoint of the run (an upload, if asked, goes through uploads.py)."""
        entry = self.shared.entry(state)
        if call.mode == "merged" and not self.shared.compute.can_merge:
            # Folding needs whole base weights, which no rank holds (docs/MULTIGPU.md: merge the adapter elsewhere).
            raise FailedPrecondition("a multi-GPU pool saves mode adapter or state; merged checkpoints need the whole "
                                     "base on one machine: load the adapter onto the base there", field="mode")
        body = call.body_sha256()
        answered = state.answer_to(call.request_id, body)
        if answered is not None:
            return SaveStateResult.from_dict(answered).replay()
        name = call.name or default_checkpoint_name(state.step)
        path = checkpoint_dir(state.paths, call.mode, name)
        meta = read_json(path / CHECKPOINT_FILE) if (path / CHECKPOINT_FILE).exists() else {}
        if path.is_dir() and not (call.name is None and meta.get("step") == state.step):
            # A name is kept once per kind: saving over "final" (or over step-0 at step 1) would lose it, unless the
            # call says `overwrite` (Tinker's save_weights). Only a save without a name at the same step writes its
            # step-N again. A retry of the save that wrote it (same request id, after a restart forgot the answer)
            # gets that save's answer.
            if call.request_id and meta.get("request_id") == call.request_id:
                check_same_body(call.request_id, meta.get("body_sha256"), body)
                return SaveStateResult.from_dict(meta["result"]).replay()
            if not call.overwrite:
                article = "an" if call.mode[0] in "aeiou" else "a"  # an adapter, a state
                raise FailedPrecondition(f"run {state.run_id} already has {article} {call.mode} checkpoint named "
                                         f"{name!r}: pick another name, or delete that one first", field="name")
        if call.mode in READABLE_KINDS:
            self.snapshots.forget_checkpoint(state.run_id, name)  # a sample reading the old files refuses (in use)
        started = time.perf_counter()
        self.recovery.snapshot(state)
        with_optimizer = call.optimizer_saved
        crash = self.shared.crash_at
        with atomic_dir(path, before_swap=lambda: crash("during_swap")) as tmp:  # whole, or the old one, after a crash
            if call.mode in ("adapter", "state"):
                state.save_adapter(tmp, entry.base.name)
            if with_optimizer:
                state.save_optimizer(tmp / LEGACY_OPTIMIZER_FILE)
            if call.mode == "state":
                write_json(tmp / "config.json", state.config)
            if call.mode == "merged":
                save_merged(entry, state, tmp)
            crash("during_save")
            meta = self._checkpoint_meta(state, call.mode, name, with_optimizer)
            result = SaveStateResult(checkpoint_path=str(path.resolve()), mode=call.mode, step=state.step,
                                     size_bytes=dir_size(tmp), name=name, with_optimizer=with_optimizer,
                                     pending_excluded=state.pending.calls,
                                     compute_seconds=self.shared.compute.seconds_since(started))
            write_json(tmp / CHECKPOINT_FILE, {**meta, "request_id": call.request_id, "body_sha256": body,
                                               "result": result.to_dict()})
        state.remember(call.request_id, result.to_dict(), body)
        return result

    def _checkpoint_meta(self, state: RunState, mode: str, name: str, with_optimizer: bool) -> CheckpointMeta:
        """What resuming needs besides the files: step, seed, LoRA settings, the base and its quantization. Pending
        gradients are never in a checkpoint (`pending_excluded` counts the calls left out)."""
        return {
            "format": CHECKPOINT_FORMAT, "run_id": state.run_id, "user_id": state.user_id, "mode": mode, "name": name,
            "step": state.step, "seed": state.config["seed"], "lora": state.lora, "base_model": state.base_model,
            "base_revision": state.config.get("base_revision"), "quantization": state.quantization,
            "with_optimizer": with_optimizer, "pending_excluded": state.pending.calls, "created_at": time.time(),
        }

    def find_checkpoint(self, ref: CheckpointRef, user_id: str, field: str) -> tuple[Path, CheckpointMeta]:
        """A loadable checkpoint's directory and what it holds; another user's, or none, is NOT_FOUND alike."""
        root = find_run_dir(self.shared.data_dir, ref.run_id)
        config = read_json(root / "config.json") if root is not None else None
        directory = checkpoint_dir(RunPaths(self.shared.data_dir, root.parent.name, ref.run_id), ref.kind, ref.name) \
            if root is not None else None
        if config is None or config["user_id"] != user_id or directory is None or not directory.is_dir():
            raise NotFound(f"checkpoint {ref.path} not found", field=field)
        if not (directory / ADAPTER_WEIGHTS).exists():
            raise FailedPrecondition(f"checkpoint {ref.path} holds no adapter to load", field=field)
        if (directory / CHECKPOINT_FILE).exists():
            meta: CheckpointMeta = read_json(directory / CHECKPOINT_FILE)  # written by _checkpoint_meta
        else:  # saved before checkpoint.json: the run's config says the rest, the optimizer file the step
            optimizer = directory / LEGACY_OPTIMIZER_FILE
            step = torch.load(optimizer, map_location="cpu", weights_only=True)["step"] if optimizer.exists() else None
            match = DEFAULT_NAME.match(ref.name)
            meta = {"step": step if step is not None else int(match.group(1)) if match else 0, "seed": config["seed"],
                    "lora": config["lora"], "base_model": config["base_model"],
                    "quantization": config.get("quantization"), "with_optimizer": optimizer.exists()}
        return directory, meta

    def load_state(self, state: RunState, call: LoadState) -> LoadStateResult:
        """The checkpoint's adapter (and AdamW) into this run: staged into the run's own directory, journaled, applied,
        then a snapshot at once; the staged copy goes with the snapshot's pruning."""
        body = call.body_sha256()
        answered = state.answer_to(call.request_id, body)
        if answered is not None:
            return LoadStateResult.from_dict(answered).replay()
        if isinstance(self.shared.compute, RankCompute):
            raise FailedPrecondition("a multi-GPU pool cannot load a checkpoint into a run yet: create a run from it "
                                     "on one GPU", field="checkpoint")
        started = time.perf_counter()
        ref = checkpoint_ref(call.checkpoint, "checkpoint", state.run_id)
        directory, meta = self.find_checkpoint(ref, state.user_id, "checkpoint")
        if meta["base_model"] != state.base_model:
            raise BadInput(f"base_model: the checkpoint was trained on {meta['base_model']!r}, this run on "
                           f"{state.base_model!r}", field="checkpoint")
        for key in LORA_SHAPE:
            if meta["lora"].get(key) != state.lora.get(key):
                raise BadInput(f"lora.{key}: the checkpoint's is {meta['lora'].get(key)!r}, this run's "
                               f"{state.lora.get(key)!r}", field="checkpoint")
        if call.with_optimizer and not meta["with_optimizer"]:
            raise FailedPrecondition("this checkpoint holds no optimizer state: pass with_optimizer false",
                                     field="with_optimizer")
        staged = f"seq_{state.seq}"
        with atomic_dir(state.paths.root / LOADS_DIR / staged) as tmp:
            files = [ADAPTER_WEIGHTS] + ([LEGACY_OPTIMIZER_FILE] if call.with_optimizer else [])
            for name in files:
                shutil.copyfile(directory / name, tmp / name)
        dropped = state.pending.calls
        self.snapshots.retire_latest(state.run_id)  # new weights at what may be the same step
        state.load_checkpoint_files(state.paths.root / LOADS_DIR / staged, call.with_optimizer, int(meta["step"]),
                                    self.shared.device)
        result = LoadStateResult(checkpoint=ref.path, step=state.step, with_optimizer=call.with_optimizer,
                                 pending_dropped=dropped, compute_seconds=self.shared.compute.seconds_since(started))
        self.shared.journal(state, LoadStateRecord(request_id=call.request_id, staged=staged,
                                                   with_optimizer=call.with_optimizer, step=state.step,
                                                   body_sha256=body, result=result.to_dict()))
        state.remember(call.request_id, result.to_dict(), body)
        append_manifest(state.paths.manifest, {"event": LOAD_STATE, "checkpoint": ref.path, "step": state.step,
                                               "with_optimizer": call.with_optimizer})
        self.recovery.snapshot(state, required=False)  # the journal first, then the snapshot covering the load
        return result

    def delete_checkpoint(self, call: DeleteCheckpoint) -> DeleteCheckpointResult:
        root = find_run_dir(self.shared.data_dir, call.run_id)
        if root is None:
            raise RunNotFound(f"run {call.run_id!r} not found", field="run_id")
        directory = checkpoint_dir(RunPaths(self.shared.data_dir, root.parent.name, call.run_id), call.mode, call.name)
        missing = NotFound(f"run {call.run_id!r} has no {call.mode} checkpoint named {call.name!r}", field="name")
        if call.mode == SAMPLER_MODE:
            # A snapshot, named (its directory) or unnamed (memory or a spill): out of the layers and off the disk;
            # refused while a decode group reads it (FAILED_PRECONDITION).
            if self.snapshots.find(call.run_id, call.name) is None:
                raise missing
            self.snapshots.delete(call.run_id, call.name)
        elif not directory.is_dir():
            raise missing
        else:
            if call.mode in READABLE_KINDS:
                self.snapshots.forget_checkpoint(call.run_id, call.name)  # refused while a sample reads it
            shutil.rmtree(directory)
        return DeleteCheckpointResult(run_id=call.run_id, mode=call.mode, name=call.name, deleted=True)

    def export_checkpoint(self, call: ExportCheckpoint) -> ExportCheckpointResult:
        """A saved checkpoint's directory as a base64 .tar.gz, for a server whose disk is not the runtime's (Modal)."""
        root = find_run_dir(self.shared.data_dir, call.run_id)
        if root is None:
            raise RunNotFound(f"run {call.run_id!r} not found", field="run_id")
        name = call.name or default_checkpoint_name(call.step)
        source = checkpoint_dir(RunPaths(self.shared.data_dir, root.parent.name, call.run_id), call.mode, name)
        if not source.is_dir():
            raise NotFound(f"run {call.run_id!r} has no {call.mode} checkpoint named {name!r}", field="checkpoint")
        limit = self.shared.options.export_limit_bytes
        if dir_size(source) > limit:
            raise BadInput(f"the checkpoint is over {limit / 1024**2:g} MiB, too large to stream through the "
                           f"runtime: copy it with `signal pull {call.run_id}`", field="checkpoint")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            label = f"step{call.step}" if call.name is None else name  # the name archives had before names
            archive.add(source, arcname=f"{call.run_id[:8]}-{label}-{call.mode}")
        return ExportCheckpointResult(archive_b64=base64.b64encode(buffer.getvalue()).decode())

    # ---- the runtime -----------------------------------------------------------------------

    def ping(self) -> PingResult:
        shared = self.shared
        return PingResult(
            pid=os.getpid(), device=str(shared.device), dtype=dtype_name(shared.dtype),
            loaded_models=list(shared.models.loaded), models=[describe(b) for b in shared.models.loaded.values()],
            runs_in_memory=list(shared.residency.runs), max_batch_size=shared.options.max_batch_size,
            options=shared.options.to_dict(), contract=CONTRACT_VERSION,
        )

    def runtime_state(self) -> JSONObject:
        """What an operator wants to see: bases, resident and evicted runs, queues, and what ticks did."""
        shared, residency, totals = self.shared, self.shared.residency, self.shared.totals
        return {
            "device": str(shared.device),
            "threads": torch.get_num_threads(),  # what torch uses now (SIGNAL_THREADS), not what was asked
            "bases": [{"name": name, "params": e.params, "quantization": e.quantization,
                       "resident_runs": sum(r.base_key == name for r in residency.runs.values())}
                      for name, e in residency.bases.items()],
            "resident_runs": [{"run_id": r.run_id, "user_id": r.user_id, "base_model": r.base_model,
                               "quantization": r.quantization, "step": r.step,
                               "bytes": r.resident_bytes()} for r in residency.runs.values()],
            "evicted_runs": sorted(residency.evicted),
            "resident_bytes": residency.resident_bytes(),
            "budget": {"bytes": residency.budget_bytes(), "runs": shared.options.resident_runs},
            "queue_depth": shared.scheduler.queue_depth_by_user(),
            "calls_refused": dict(shared.scheduler.refused),  # per user, past the bound on calls in flight
            "calls_withdrawn": dict(shared.scheduler.withdrawn),  # per user, by a cancel (deadline, client gone)
            "decode_groups": self.sampling.describe(),  # one per base decoding (its engine), as before
            "sampler_snapshots": self.snapshots.describe(),
            "ticks": {"count": totals.ticks, "base_passes": totals.base_passes, "fb_rows": totals.fb_rows,
                      "decode_passes": totals.decode_passes, "recent": list(totals.last_ticks)},
            "evictions": totals.evictions,
            "snapshots": totals.snapshots,
            "ranks": typed_json(shared.compute.describe()),
        }

    def _manifest_header(self, state: RunState, entry: BaseEntry) -> JSONObject:
        base = entry.base
        return {
            "run_id": state.run_id, "user_id": state.user_id,
            "base_model": {"name": base.name, "revision": base.revision, "source": base.source},
            "lora": typed_json(state.lora), "seed": state.config["seed"], "optimizer": "torch.optim.AdamW",
            "device": str(self.shared.device), "dtype": dtype_name(self.shared.dtype),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        }
