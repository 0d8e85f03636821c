"""The runtime's control calls: create, save (and upload), export, describe, close and delete runs; ping and
the operator's view of the runtime.
"""

from __future__ import annotations

import base64
import functools
import io
import os
import shutil
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from gpu_runtime.compute import RankCompute
from gpu_runtime.contract import (
    CreateRun,
    ExportCheckpoint,
    RunDescription,
    SaveState,
    SaveStateResult,
    SaveWeightsForSampler,
    SaveWeightsForSamplerResult,
    lora_settings,
)
from gpu_runtime.devices import dtype_name
from gpu_runtime.errors import BadInput, FailedPrecondition, NotFound, RunNotFound, SignalError
from gpu_runtime.merging import save_merged
from gpu_runtime.models import describe
from gpu_runtime.persistence import RunPaths, atomic_dir, dir_size, find_run_dir, write_json
from gpu_runtime.pool import BaseEntry
from gpu_runtime.quantization import checked as checked_quantization
from gpu_runtime.recovery import Recovery
from gpu_runtime.run_state import RunState, append_manifest
from gpu_runtime.sampling_calls import Sampling
from gpu_runtime.scheduler import Request
from gpu_runtime.shared import Shared, internal
from gpu_runtime.snapshots import SAMPLER_MODE, Snapshots, snapshot_dir

UPLOAD_GRACE_SECONDS = 300  # at shutdown, Hub uploads in flight get this long to finish and answer
EXPORT_LIMIT_BYTES = 256 * 1024**2  # a checkpoint archive sent through the runtime (JSON, base64); bigger: signal pull


class Control:
    def __init__(self, shared: Shared, recovery: Recovery, sampling: Sampling, snapshots: Snapshots) -> None:
        self.shared = shared
        self.recovery = recovery
        self.sampling = sampling
        self.snapshots = snapshots
        self.uploads: set[threading.Thread] = set()  # Hub uploads in flight, each answering its save_state

    # ---- runs ------------------------------------------------------------------------------

    def create_run(self, call: CreateRun) -> RunDescription:
        shared = self.shared
        if self.recovery.exists(call.run_id):
            raise BadInput(f"run {call.run_id!r} already exists", field="run_id")
        quantization = checked_quantization(call.quantization)
        entry = shared.residency.base(call.base_model, quantization)
        config = {
            "run_id": call.run_id, "user_id": call.user_id, "base_model": call.base_model,
            "base_revision": entry.base.revision, "lora": lora_settings(call.lora, entry.available), "seed": call.seed,
            "created_at": time.time(), "quantization": quantization,
        }
        state = shared.residency.attach(config, shared.data_dir)
        try:
            write_json(state.paths.config, config)
            append_manifest(state.paths.manifest, self._manifest_header(state, entry))
        except BaseException:
            shared.residency.detach(call.run_id)
            shutil.rmtree(state.paths.root, ignore_errors=True)
            raise
        shared.owners[call.run_id] = call.user_id
        return self.describe(state)

    def describe(self, state: RunState) -> RunDescription:
        trainable = sum(p.numel() for p in state.parameters())
        return RunDescription(
            run_id=state.run_id, user_id=state.user_id, base_model=state.base_model, quantization=state.quantization,
            base_revision=state.config["base_revision"], lora=state.lora, target_modules=state.lora["target_modules"],
            seed=state.config["seed"], step=state.step, trainable_params=trainable,
            total_params=self.shared.entry(state).params + trainable, pending_forward_backward=state.pending.calls,
            pending_tokens=state.pending.tokens, path=str(state.paths.root), device=str(self.shared.device))

    def close_run(self, run_id: str) -> dict[str, Any]:
        state = self.shared.residency.runs.get(run_id)
        if state is not None:
            self.recovery.evict(state, count=False)
        elif not self.recovery.exists(run_id):
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        return {"run_id": run_id, "closed": True}

    def delete_run(self, run_id: str) -> dict[str, Any]:
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
        return {"run_id": run_id, "deleted": True}

    # ---- sampler snapshots -----------------------------------------------------------------

    def save_weights_for_sampler(self, state: RunState, call: SaveWeightsForSampler) -> SaveWeightsForSamplerResult:
        """Freeze the run's adapter as it is after every call before this one (gpu_runtime/snapshots.py). Not
        journaled: a named one is its own fsync'd directory; an unnamed one is memory only by design."""
        if call.request_id and call.request_id in state.answered:
            return SaveWeightsForSamplerResult.from_dict(state.answered[call.request_id]).replay()
        if isinstance(self.shared.compute, RankCompute):  # the ranks hold their own copies of every adapter
            raise FailedPrecondition("a multi-GPU pool keeps no sampler snapshots yet: sample the run's current "
                                     "weights", field="name")
        started = time.perf_counter()
        snapshot = self.snapshots.save(state, self.shared.entry(state), call.name)
        expires = None if snapshot.named else self.shared.options.unnamed_snapshot_seconds
        result = SaveWeightsForSamplerResult(
            run_id=state.run_id, name=snapshot.name, step=snapshot.step, named=snapshot.named,
            path=str(snapshot.path.resolve()) if snapshot.path is not None else "",
            size_bytes=self.snapshots.size_bytes(snapshot), expires_in_seconds=expires,
            compute_seconds=self.shared.compute.seconds_since(started))
        state.remember(call.request_id, result.to_dict())
        return result

    # ---- checkpoints -----------------------------------------------------------------------

    def save_state(self, state: RunState, call: SaveState) -> SaveStateResult:
        """Write a checkpoint of the run (an upload, if asked, goes through `save_then_upload`)."""
        entry = self.shared.entry(state)
        if call.mode == "merged" and not self.shared.compute.can_merge:
            # Folding needs whole base weights, which no rank holds (docs/MULTIGPU.md: merge the adapter elsewhere).
            raise FailedPrecondition("a multi-GPU pool saves mode adapter or state; merged checkpoints need the whole "
                                     "base on one machine: load the adapter onto the base there", field="mode")
        started = time.perf_counter()
        self.recovery.snapshot(state)
        path = state.paths.checkpoint(call.mode, state.step)
        with atomic_dir(path) as tmp:
            if call.mode in ("adapter", "state"):
                state.save_adapter(tmp, entry.base.name)
            if call.mode == "state":
                torch.save({"step": state.step, "param_names": list(state.named_parameters()),
                            "optimizer": state.optimizer.state_dict()}, tmp / "optimizer_state.pt")
                write_json(tmp / "config.json", state.config)
            if call.mode == "merged":
                save_merged(entry, state, tmp)
        return SaveStateResult(checkpoint_path=str(path.resolve()), mode=call.mode, step=state.step,
                               size_bytes=dir_size(path), compute_seconds=self.shared.compute.seconds_since(started))

    def save_then_upload(self, request: Request, state: RunState, call: SaveState,
                         answer: Callable[[dict[str, Any]], None]) -> None:
        """save_state(push_to_hub=True): the checkpoint is written in this tick, then uploaded on a thread of its own,
        so other runs' calls go on meanwhile; this run's next call waits, as its head is answered only after."""
        from gpu_runtime import hub  # huggingface_hub, only for runs that upload

        try:
            hub_model_id, hf_token = hub.check_push(call.hub_model_id, call.hf_token)
            result = self.save_state(state, call)
            upload = functools.partial(
                hub.push_checkpoint, Path(result.checkpoint_path), hub_model_id=hub_model_id, hf_token=hf_token,
                base_model=self.shared.entry(state).base.name, manifest=state.paths.manifest, mode=result.mode,
                step=result.step, run_id=state.run_id)
        except SignalError as exc:
            answer({"error": exc.to_dict()})
            return
        except Exception as exc:  # noqa: BLE001 - one bad call must not take the runtime down
            answer({"error": internal(exc, request)})
            return

        def run() -> None:
            try:  # upload time is not compute time
                message: dict[str, Any] = {"result": {**result.to_dict(), "hub": upload()}}
            except SignalError as exc:
                message = {"error": exc.to_dict()}
            except Exception as exc:  # noqa: BLE001
                message = {"error": internal(exc, request)}
            self.shared.scheduler.finish(request, message)
            self.uploads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"hub-upload-{state.run_id[:8]}", daemon=True)
        self.shared.scheduler.hold(state.run_id)  # in progress outside the picks: not picked again until answered
        self.uploads.add(thread)
        thread.start()

    def export_checkpoint(self, call: ExportCheckpoint) -> dict[str, Any]:
        """A saved checkpoint's directory as a base64 .tar.gz, for a server whose disk is not the runtime's (Modal)."""
        root = find_run_dir(self.shared.data_dir, call.run_id)
        if root is None:
            raise RunNotFound(f"run {call.run_id!r} not found", field="run_id")
        if call.mode == SAMPLER_MODE:  # a named sampler snapshot, by name
            source = snapshot_dir(root, call.name or "")
            if not call.name or not source.is_dir():
                raise NotFound(f"run {call.run_id!r} has no named sampler snapshot {call.name!r}", field="name")
        else:
            source = RunPaths(self.shared.data_dir, root.parent.name, call.run_id).checkpoint(call.mode, call.step)
            if not source.is_dir():
                raise NotFound(f"run {call.run_id!r} has no {call.mode} checkpoint at step {call.step}",
                               field="checkpoint")
        if dir_size(source) > EXPORT_LIMIT_BYTES:
            raise BadInput(f"the checkpoint is over {EXPORT_LIMIT_BYTES >> 20} MiB, too large to stream through the "
                           "runtime: copy it with `signal pull`", field="checkpoint")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            label = call.name if call.mode == SAMPLER_MODE else f"step{call.step}"
            archive.add(source, arcname=f"{call.run_id[:8]}-{label}-{call.mode}")
        return {"archive_b64": base64.b64encode(buffer.getvalue()).decode()}

    def wait_for_uploads(self) -> None:
        for thread in list(self.uploads):
            thread.join(timeout=UPLOAD_GRACE_SECONDS)

    # ---- the runtime -----------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        shared = self.shared
        return {
            "pid": os.getpid(), "device": str(shared.device), "dtype": dtype_name(shared.dtype),
            "loaded_models": list(shared.models.loaded), "models": [describe(b) for b in shared.models.loaded.values()],
            "runs_in_memory": list(shared.residency.runs), "max_batch_size": shared.options.max_batch_size,
            "options": shared.options.to_dict(),
        }

    def runtime_state(self) -> dict[str, Any]:
        """What an operator wants to see: bases, resident and evicted runs, queues, and what ticks did."""
        shared, residency, totals = self.shared, self.shared.residency, self.shared.totals
        return {
            "device": str(shared.device),
            "bases": [{"name": name, "params": e.params, "quantization": e.quantization,
                       "resident_runs": sum(r.base_key == name for r in residency.runs.values())}
                      for name, e in residency.bases.items()],
            "resident_runs": [{"run_id": r.run_id, "user_id": r.user_id, "base_model": r.base_model,
                               "quantization": r.quantization, "step": r.step,
                               "bytes": r.resident_bytes()} for r in residency.runs.values()],
            "evicted_runs": sorted(residency.evicted),
            "resident_bytes": residency.resident_bytes(),
            "budget": {"bytes": shared.options.resident_bytes, "runs": shared.options.resident_runs},
            "queue_depth": shared.scheduler.queue_depth_by_user(),
            "decode_groups": [{"runs": g.run_ids, "calls": len(g.jobs), "rows": g.rows, "tokens_done": g.t}
                              for g in self.sampling.groups],
            "sampler_snapshots": self.snapshots.describe(),
            "ticks": {"count": totals.ticks, "base_passes": totals.base_passes, "fb_rows": totals.fb_rows,
                      "decode_passes": totals.decode_passes, "recent": list(totals.last_ticks)},
            "evictions": totals.evictions,
            "snapshots": totals.snapshots,
            "ranks": shared.compute.describe(),
        }

    def _manifest_header(self, state: RunState, entry: BaseEntry) -> dict[str, Any]:
        base = entry.base
        return {
            "run_id": state.run_id, "user_id": state.user_id,
            "base_model": {"name": base.name, "revision": base.revision, "source": base.source},
            "lora": state.lora, "seed": state.config["seed"], "optimizer": "torch.optim.AdamW",
            "device": str(self.shared.device), "dtype": dtype_name(self.shared.dtype),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        }
