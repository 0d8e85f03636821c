"""The multi-tenant engine: the four primitives for many runs on shared bases, one tick at a time.

Calls arrive through `submit` (any thread) and are answered through their `reply`. The engine's own
thread runs ticks (`serve_forever`, or `call`, which pumps ticks in-process). One tick:

1. answers system calls (ping, runtime_state);
2. asks the scheduler for this tick's work: at most one call per run, users in fair order,
   forward_backward rows bounded by `tick_tokens`;
3. runs the control calls (create_run, optim_step, save_state, …);
4. runs every picked forward_backward on one base as **one** forward and backward pass, each row
   routed to its run's LoRA; losses, normalisers and gradients stay per run;
5. appends each acknowledged call to its run's journal and fsyncs (one group fsync per tick),
   then answers;
6. starts a decode group for the sample calls picked, and advances every decode group by one
   time-bounded chunk;
7. evicts least recently used idle runs past the memory budget, and unloads idle bases.

Every argument and result is plain JSON-able data, so the same calls cross the worker's pipe and
a Modal `.remote()` unchanged.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import inspect
import io
import math
import os
import shutil
import signal
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from gpu_runtime.batches import Example
from gpu_runtime.contract import SAVE_MODES, RuntimeOptions, adam_settings, lora_settings, sampling_settings
from gpu_runtime.decoding import DecodeGroup, SampleJob
from gpu_runtime.devices import dtype_name, resolve_device
from gpu_runtime.errors import BadInput, FailedPrecondition, NotFound, RunNotFound, SignalError, WorkerFailed
from gpu_runtime.losses import LossFn, get_loss
from gpu_runtime.merging import save_merged
from gpu_runtime.models import ModelRegistry, describe
from gpu_runtime.persistence import RunPaths, atomic_dir, check_id, dir_size, find_run_dir, read_json, sha256_json, write_json
from gpu_runtime.pool import BaseEntry, Pool
from gpu_runtime.quantization import checked as checked_quantization
from gpu_runtime.ranks import RankGroup, RanksFailed
from gpu_runtime.run_state import RunState, append_manifest, last_manifest_step
from gpu_runtime.scheduler import Request, Scheduler, TickPlan, split_ticket
from gpu_runtime.sharding import ShardedPool, ShardedRegistry
from gpu_runtime.training import PassPart, adamw_step, forward_backward_pass

FORWARD_BACKWARD, SAMPLE, SAVE_STATE = "forward_backward", "sample", "save_state"
UPLOAD_GRACE_SECONDS = 300  # at shutdown, Hub uploads in flight get this long to finish and answer
EXPORT_LIMIT_BYTES = 256 * 1024**2  # a checkpoint archive sent through the runtime (JSON, base64); bigger: signal pull
SYSTEM_METHODS = ("ping", "runtime_state")


@dataclass
class FbProgress:
    """A forward_backward call being computed, possibly across several ticks."""

    state: RunState
    examples: list[Example]
    loss_fn: str
    loss: LossFn
    loss_config: dict[str, Any]
    batch_hash: str
    call: int  # which call since the last optim_step: seeds its dropout
    width: int  # the call's own padded width: its dropout masks are drawn at this shape
    done: int = 0
    loss_sum: float = 0.0
    normaliser: float = 0.0
    compute_seconds: float = 0.0  # this call's share of its ticks' passes, by its rows' tokens
    backup: list[torch.Tensor | None] | None = None  # gradients before a split call, restored if a later part fails

    @property
    def remaining_tokens(self) -> int:
        return sum(len(e.tokens) for e in self.examples[self.done:])


@dataclass
class FbPart:
    request: Request | None  # None while replaying the journal
    progress: FbProgress
    examples: list[Example]
    row_offset: int


@dataclass
class TickStats:
    number: int = 0
    requests: int = 0
    fb_rows: int = 0
    fb_runs: int = 0
    base_passes: int = 0  # forward+backward passes of a base (one per base per tick when co-batched)
    decode_passes: int = 0
    decode_rows: int = 0
    fb_seconds: float = 0.0  # of the forward+backward passes: what their calls' compute_seconds add up to
    seconds: float = 0.0


@dataclass
class Totals:
    ticks: int = 0
    base_passes: int = 0
    fb_rows: int = 0
    decode_passes: int = 0
    evictions: int = 0
    snapshots: int = 0
    last_ticks: list[dict[str, Any]] = field(default_factory=list)


class Engine:
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
        base = (options or RuntimeOptions()).to_dict()
        self.options = RuntimeOptions.from_dict({**base, **overrides})
        self.data_dir = Path(data_dir).resolve()
        self.device, self.dtype = resolve_device(device)
        self.faults = faults or set()
        # local_ranks > 1: a multi-GPU pool (gpu_runtime/ranks.py), its bases sharded across the ranks with FSDP.
        self.ranks: RankGroup | None = None
        self.models: ModelRegistry
        self.pool: Pool
        if self.options.local_ranks > 1:
            world = self.options.local_ranks
            self.ranks = RankGroup(world, self.device, self.data_dir, self.options, allow_downloads, self.faults)
            self.models = ShardedRegistry(self.data_dir, self.device, self.dtype, 0, world, allow_downloads)
            self.pool = ShardedPool(self.models, self.options, self.ranks)
            self.ranks.start()
        else:
            self.models = ModelRegistry(self.data_dir, self.device, self.dtype, allow_downloads=allow_downloads)
            self.pool = Pool(self.models, self.options)
        self.scheduler = Scheduler(self.options.tick_tokens)
        # Called once per tick after its journal fsyncs, before its answers, and after snapshots written outside a
        # tick's calls (evictions): Modal commits the Volume there.
        self.after_sync = after_sync
        self.decode_groups: list[DecodeGroup] = []
        self.totals = Totals()
        self.last_tick = TickStats()
        self._owners: dict[str, str] = {}  # run → user, for fair turns
        self._uploads: set[threading.Thread] = set()  # Hub uploads in flight, each answering its save_state
        self._touched: set[str] = set()  # runs whose journal has records not yet fsync'd
        self._snapshotted = False  # a snapshot was written since the last after_sync (Modal commits it then)
        self._handlers: dict[str, Callable[..., Any]] = {
            "create_run": self._create_run, "forward_backward": self._prepare_fb, "optim_step": self._optim_step,
            "sample": self._prepare_sample, "save_state": self._save_state, "load_run": self._run_info,
            "run_info": self._run_info, "close_run": self._close_run, "delete_run": self._delete_run,
            "ping": self._ping, "runtime_state": self._runtime_state, "export_checkpoint": self._export_checkpoint,
        }

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(self._handlers)

    @property
    def runs(self) -> dict[str, RunState]:
        return self.pool.runs

    # ---- calls ----------------------------------------------------------------------------

    def submit(self, method: str, params: dict[str, Any], reply: Any) -> None:
        """Queue one call (thread-safe); `reply` gets {"result": …} or {"error": …} exactly once."""
        try:
            handler = self._handlers.get(method)
            if handler is None:
                raise BadInput(f"unknown method {method!r}; the runtime answers {list(self._handlers)}", field="method")
            if not isinstance(params, dict) or any(str(k).startswith("_") for k in params):
                raise BadInput("params must be an object of the method's arguments", field="params")
            params, ticket = split_ticket(params)  # the call's place in its run's order across servers
            try:
                inspect.signature(handler).bind(**params)
            except TypeError as exc:
                raise BadInput(f"{method}: {exc}", field="params") from None
            run_id = None if method in SYSTEM_METHODS else check_id(params.get("run_id"), "run_id")
            user = params.get("user_id") if method == "create_run" else self._owner(run_id)
        except SignalError as exc:
            reply({"error": exc.to_dict()})
            return
        self.scheduler.submit(Request(method, params, reply, user_id=str(user), run_id=run_id, ticket=ticket))

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Submit and pump ticks in this thread until answered (in-process use: tests, benchmarks)."""
        future: Future[dict[str, Any]] = Future()
        self.submit(method, params, future.set_result)
        while not future.done():
            self.tick()
            if not future.done() and not self.scheduler.has_work() and not self.decode_groups:
                wait([future], timeout=0.5)  # answered off the tick (a Hub upload): nothing to pump meanwhile
        message = future.result()
        if "error" in message:
            raise SignalError.from_dict(message["error"])
        return message["result"]

    def serve_forever(self) -> None:
        """Run ticks until the scheduler is closed and nothing is left; then snapshot and return."""
        while True:
            busy = bool(self.decode_groups)
            woken = self.scheduler.wait_for_work(timeout=self._idle_timeout(), also_busy=busy)
            if self.scheduler.closed and not self.scheduler.has_work() and not self.decode_groups:
                break
            if not woken:
                self._housekeeping()
                continue
            self.tick()
        self.shutdown()

    # The primitives, callable in-process with the contract's signatures.
    def create_run(self, run_id: str, user_id: str, base_model: str, lora: dict[str, Any] | None = None,
                   seed: int = 0, quantization: str | None = None) -> dict[str, Any]:
        return self.call("create_run", run_id=run_id, user_id=user_id, base_model=base_model, lora=lora, seed=seed,
                         quantization=quantization)

    def forward_backward(self, run_id: str, batch: list[dict[str, Any]], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None) -> dict[str, Any]:
        return self.call("forward_backward", run_id=run_id, batch=batch, loss_fn=loss_fn,
                         loss_fn_config=loss_fn_config, request_id=request_id)

    def optim_step(self, run_id: str, adam: dict[str, Any] | None = None, request_id: str | None = None) -> dict[str, Any]:
        return self.call("optim_step", run_id=run_id, adam=adam, request_id=request_id)

    def sample(self, run_id: str, prompts: list[str], **params: Any) -> dict[str, Any]:
        return self.call("sample", run_id=run_id, prompts=prompts, **params)

    def save_state(self, run_id: str, mode: str = "adapter") -> dict[str, Any]:
        return self.call("save_state", run_id=run_id, mode=mode)

    def load_run(self, run_id: str) -> dict[str, Any]:
        return self.call("load_run", run_id=run_id)

    def run_info(self, run_id: str) -> dict[str, Any]:
        return self.call("run_info", run_id=run_id)

    def close_run(self, run_id: str) -> dict[str, Any]:
        return self.call("close_run", run_id=run_id)

    def delete_run(self, run_id: str) -> dict[str, Any]:
        return self.call("delete_run", run_id=run_id)

    def ping(self) -> dict[str, Any]:
        return self.call("ping")

    def runtime_state(self) -> dict[str, Any]:
        return self.call("runtime_state")

    # ---- one tick -------------------------------------------------------------------------

    def tick(self) -> TickStats:
        started = time.monotonic()
        if self.ranks is not None and self.ranks.failed:
            self._restart_ranks()  # a rank failed between ticks
        plan: TickPlan = self.scheduler.next_tick(self._cost)
        stats = TickStats(number=plan.number, requests=len(plan.system) + len(plan.picks))
        for request in plan.system:
            self._answer(request, lambda r=request: self._handlers[r.method](**r.params))
        fb_parts: dict[str, list[FbPart]] = {}
        samples: dict[str, list[SampleJob]] = {}
        deferred: list[tuple[Request, dict[str, Any]]] = []  # answered once the journal is synced
        for pick in plan.picks:
            request = pick.request
            if request.method == FORWARD_BACKWARD:
                progress: FbProgress = request.progress
                part = self._take_rows(progress, pick.allowance)
                fb_parts.setdefault(progress.state.base_key, []).append(FbPart(request, progress, part, progress.done))
            elif request.method == SAMPLE:
                try:
                    replayed = self._sampled_before(**request.params)
                    if replayed is not None:  # a retry whose first answer may not have reached the caller
                        self.scheduler.finish(request, {"result": replayed})
                        continue
                    job = self._prepare_sample(**request.params, _request=request)
                except SignalError as exc:
                    self.scheduler.finish(request, {"error": exc.to_dict()})
                    continue
                samples.setdefault(job.state.base_key, []).append(job)
            elif request.method == SAVE_STATE and request.params.get("push_to_hub"):
                self._save_then_upload(request, deferred)
            else:
                try:
                    result = self._handlers[request.method](**request.params)
                    deferred.append((request, {"result": result}))
                except SignalError as exc:
                    deferred.append((request, {"error": exc.to_dict()}))
                except Exception as exc:  # noqa: BLE001 - one bad call must not take the runtime down
                    deferred.append((request, {"error": _internal(exc)}))
        for key, parts in fb_parts.items():
            try:
                deferred += self._run_fb(self.pool.bases[key], parts, stats)
            except RanksFailed as exc:  # every rank stopped: these calls fail; the pool restarts below
                deferred += [(part.request, {"error": exc.to_dict()}) for part in parts if part.request is not None]
        self._sync_journals()
        if "after_journal" in self.faults and deferred:
            os.kill(os.getpid(), signal.SIGKILL)  # failpoint: journaled, not yet answered
        for request, message in deferred:
            self.scheduler.finish(request, message)
        for key, jobs in samples.items():
            self._start_group(self.pool.bases[key], jobs)
        self._advance_decoding(stats)
        self._housekeeping()
        if self.ranks is not None and self.ranks.failed:
            self._restart_ranks()
        stats.seconds = time.monotonic() - started
        self._count(stats)
        return stats

    def _cost(self, request: Request) -> int:
        """Tokens a head still needs this tick (forward_backward only); prepares it on first sight."""
        if request.method != FORWARD_BACKWARD:
            return 0
        if request.progress is None:
            try:
                replayed = self._prepare_fb(**request.params, _request=request)
            except SignalError as exc:
                self.scheduler.finish(request, {"error": exc.to_dict()})
                return 0
            except Exception as exc:  # noqa: BLE001
                self.scheduler.finish(request, {"error": _internal(exc)})
                return 0
            if replayed is not None:  # a retry of a call already journaled: its first answer, again
                self.scheduler.finish(request, {"result": replayed})
                return 0
        progress: FbProgress = request.progress
        return max(progress.remaining_tokens, 1)

    def _answer(self, request: Request, work: Any) -> None:
        try:
            self.scheduler.finish(request, {"result": work()})
        except SignalError as exc:
            self.scheduler.finish(request, {"error": exc.to_dict()})
        except Exception as exc:  # noqa: BLE001
            self.scheduler.finish(request, {"error": _internal(exc)})

    # ---- forward_backward ------------------------------------------------------------------

    def _prepare_fb(self, run_id: str, batch: list[dict[str, Any]], loss_fn: str = "cross_entropy",
                    loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None,
                    _request: Request | None = None) -> dict[str, Any] | None:
        state = self._state(run_id)
        _check_request_id(request_id)
        if request_id and request_id in state.answered:
            return {**state.answered[request_id], "replayed": True}
        loss, config = get_loss(loss_fn, loss_fn_config)
        entry = self.pool.bases[state.base_key]
        examples = entry.renderer.render_batch(batch, self.options.max_batch_size, loss_fn)
        progress = FbProgress(state, examples, loss_fn, loss, config, sha256_json({"loss_fn": loss_fn, "batch": batch}),
                              call=state.pending_calls, width=max(len(e.tokens) for e in examples) - 1)
        assert _request is not None
        _request.progress = progress
        return None

    @staticmethod
    def _take_rows(progress: FbProgress, allowance: int) -> list[Example]:
        """The next rows of a call that fit in `allowance` tokens (at least one)."""
        taken: list[Example] = []
        tokens = 0
        for example in progress.examples[progress.done:]:
            if taken and tokens + len(example.tokens) > allowance:
                break
            taken.append(example)
            tokens += len(example.tokens)
        if progress.done == 0 and len(taken) < len(progress.examples):
            # A split call: keep the gradients from before it, to put back if a later part fails.
            progress.backup = [None if p.grad is None else p.grad.clone() for p in progress.state.parameters()]
        return taken

    def _run_fb(self, entry: BaseEntry, parts: list[FbPart], stats: TickStats) -> list[tuple[Request, dict[str, Any]]]:
        """One forward and backward pass of the base for every part; journal the calls that completed.
        The pass's seconds are shared among its parts by their tokens (a call's compute_seconds)."""
        started = time.perf_counter()
        outcomes = self._fb_pass(entry, parts)
        seconds = _device_seconds(self.device, started)
        tokens = [sum(len(e.tokens) for e in part.examples) for part in parts]
        stats.fb_seconds += seconds
        stats.base_passes += 1
        stats.fb_rows += sum(len(p.examples) for p in parts)
        stats.fb_runs += len(parts)
        answers = []
        for part, outcome, part_tokens in zip(parts, outcomes, tokens):
            assert part.request is not None
            if isinstance(outcome, SignalError):
                _restore_grads(part.progress)
                answers.append((part.request, {"error": outcome.to_dict()}))
                continue
            result = self._fb_done(part, outcome, seconds * part_tokens / max(sum(tokens), 1))
            if result is not None:
                answers.append((part.request, {"result": result}))
        return answers

    def _fb_pass(self, entry: BaseEntry, parts: list[FbPart]) -> list[tuple[float, float] | SignalError]:
        """One forward and backward pass for every part (gpu_runtime/training.py): here, or on every rank."""
        plan = []
        for part in parts:
            progress = part.progress
            plan.append(PassPart(
                progress.state.run_id, part.examples, part.row_offset, call_rows=len(progress.examples),
                call_width=progress.width, loss_fn=progress.loss_fn, loss_config=progress.loss_config,
                dropout_seed=_derive_seed(progress.state.config["seed"], progress.state.step, progress.call),
                backup=part.row_offset == 0 and len(part.examples) < len(progress.examples)))
        if self.ranks is not None:
            return self.ranks.forward_backward(entry, self.pool.runs, plan)
        return forward_backward_pass(entry, self.pool.runs, plan, self.device)

    def _fb_done(self, part: FbPart, outcome: tuple[float, float], seconds: float = 0.0) -> dict[str, Any] | None:
        """Count a part (and its share of the pass's `seconds`); when the call is whole, journal it and return
        its result."""
        progress, state = part.progress, part.progress.state
        progress.compute_seconds += seconds
        progress.loss_sum += outcome[0]
        progress.normaliser += outcome[1]
        progress.done += len(part.examples)
        if progress.done < len(progress.examples):
            return None
        num_tokens = sum(e.num_targets for e in progress.examples)
        state.pending_normaliser += progress.normaliser
        state.pending_calls += 1
        state.pending_tokens += num_tokens
        state.pending_batches.append({"sha256": progress.batch_hash, "num_examples": len(progress.examples),
                                      "num_tokens": num_tokens})
        result = {"loss": progress.loss_sum / progress.normaliser if progress.normaliser else 0.0,
                  "num_tokens": num_tokens, "num_examples": len(progress.examples), "step": state.step,
                  "compute_seconds": progress.compute_seconds}
        if part.request is None:  # replaying: the journal already holds it
            return result
        if "before_journal" in self.faults:
            os.kill(os.getpid(), signal.SIGKILL)  # failpoint: computed, not journaled
        request_id = part.request.params.get("request_id")
        self._journal(state, {
            "type": FORWARD_BACKWARD, "request_id": request_id, "loss_fn": progress.loss_fn,
            "loss_fn_config": progress.loss_config, "call": progress.call, "step": state.step,
            "batch_sha256": progress.batch_hash,
            "examples": [{"tokens": e.tokens, "weights": e.weights, "extras": e.extras} for e in progress.examples],
            "result": result,
        })
        state.remember(request_id, result)
        self.pool.touch(state)
        return result

    # ---- optim_step and the other control calls -------------------------------------------

    def _optim_step(self, run_id: str, adam: dict[str, Any] | None = None, request_id: str | None = None) -> dict[str, Any]:
        state = self._state(run_id)
        _check_request_id(request_id)
        if request_id and request_id in state.answered:
            answered = state.answered[request_id]
            if "error" in answered:  # it failed (and dropped the gradients) the first time: the retry fails alike
                raise SignalError.from_dict(answered["error"])
            return {**answered, "replayed": True}
        settings = adam_settings(adam)
        if state.pending_calls == 0:
            raise FailedPrecondition("no gradients to apply: call forward_backward before optim_step")
        pending_tokens, pending_batches = state.pending_tokens, state.pending_batches
        started = time.perf_counter()
        try:
            result: dict[str, Any] = _apply_optim(state, settings, self.ranks)
            result["compute_seconds"] = _device_seconds(self.device, started)
        except FailedPrecondition as exc:
            result = {"error": exc.to_dict()}  # journaled too: dropping the gradients is a change replay must repeat
        self._journal(state, {"type": "optim_step", "request_id": request_id, "adam": settings, "result": result})
        state.remember(request_id, result)
        self.pool.touch(state)
        if "error" in result:
            raise SignalError.from_dict(result["error"])
        append_manifest(state.paths.manifest, {"step": state.step, "adam": settings, "grad_norm": result["grad_norm"],
                                               "num_tokens": pending_tokens, "batches": pending_batches})
        due = state.step - max(state.snapshot_step, 0) >= self.options.snapshot_every_steps
        late = time.monotonic() - state.snapshot_time >= self.options.snapshot_every_seconds
        if due or late:
            self._snapshot(state)
        return result

    def _create_run(self, run_id: str, user_id: str, base_model: str, lora: dict[str, Any] | None = None,
                    seed: int = 0, quantization: str | None = None) -> dict[str, Any]:
        check_id(user_id, "user_id")
        if run_id in self.pool.runs or find_run_dir(self.data_dir, run_id) is not None:
            raise BadInput(f"run {run_id!r} already exists", field="run_id")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise BadInput(f"seed must be a non-negative integer, got {seed!r}", field="seed")
        if not isinstance(base_model, str) or not base_model:
            raise BadInput("base_model must be a model name or path", field="base_model")
        quantization = checked_quantization(quantization)
        entry = self.pool.base(base_model, quantization)
        config = {
            "run_id": run_id, "user_id": user_id, "base_model": base_model, "base_revision": entry.base.revision,
            "lora": lora_settings(lora, entry.available), "seed": seed, "created_at": time.time(),
            "quantization": quantization,
        }
        state = self.pool.attach(config, self.data_dir)
        try:
            write_json(state.paths.config, config)
            append_manifest(state.paths.manifest, self._manifest_header(state, entry))
        except BaseException:
            self.pool.detach(run_id)
            shutil.rmtree(state.paths.root, ignore_errors=True)
            raise
        self._owners[run_id] = user_id
        return self._info(state)

    def _save_then_upload(self, request: Request, deferred: list[tuple[Request, dict[str, Any]]]) -> None:
        """save_state(push_to_hub=True): the checkpoint is written in this tick, then uploaded on a thread of its own,
        so other runs' calls go on meanwhile; this run's next call waits, as its head is answered only after."""
        # hf_token is the user's: it reaches gpu_runtime.hub and nothing else (no journal, manifest or log).
        from gpu_runtime import hub

        params = dict(request.params)
        try:
            hub_model_id, hf_token = hub.check_push(params.pop("hub_model_id", None), params.pop("hf_token", None))
            params.pop("push_to_hub")
            result = self._save_state(**params)
            state = self._state(params["run_id"])
            upload = functools.partial(
                hub.push_checkpoint, Path(result["checkpoint_path"]), hub_model_id=hub_model_id, hf_token=hf_token,
                base_model=self.pool.bases[state.base_key].base.name, manifest=state.paths.manifest,
                mode=result["mode"], step=result["step"], run_id=state.run_id)
        except SignalError as exc:
            deferred.append((request, {"error": exc.to_dict()}))
            return
        except Exception as exc:  # noqa: BLE001 - one bad call must not take the runtime down
            deferred.append((request, {"error": _internal(exc)}))
            return

        def run() -> None:
            try:
                message: dict[str, Any] = {"result": {**result, "hub": upload()}}  # upload time is not compute time
            except SignalError as exc:
                message = {"error": exc.to_dict()}
            except Exception as exc:  # noqa: BLE001
                message = {"error": _internal(exc)}
            self.scheduler.finish(request, message)
            self._uploads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"hub-upload-{state.run_id[:8]}", daemon=True)
        self.scheduler.hold(state.run_id)  # in progress outside the picks: not picked again until answered
        self._uploads.add(thread)
        thread.start()

    def _save_state(self, run_id: str, mode: str = "adapter", request_id: str | None = None, push_to_hub: bool = False,
                    hub_model_id: str | None = None, hf_token: str | None = None) -> dict[str, Any]:
        """Write a checkpoint of the run. The Hub parameters are for _save_then_upload, which the tick sends them to."""
        assert not push_to_hub, "uploads go through _save_then_upload"
        state = self._state(run_id)
        if mode not in SAVE_MODES:
            raise BadInput(f"mode must be one of {list(SAVE_MODES)}, got {mode!r}", field="mode")
        if mode == "merged" and self.ranks is not None:
            # Folding needs whole base weights, which no rank holds (docs/MULTIGPU.md: merge the adapter elsewhere).
            raise FailedPrecondition("a multi-GPU pool saves mode adapter or state; merged checkpoints need the whole "
                                     "base on one machine: load the adapter onto the base there", field="mode")
        entry = self.pool.bases[state.base_key]
        started = time.perf_counter()
        self._snapshot(state)
        path = state.paths.checkpoint(mode, state.step)
        with atomic_dir(path) as tmp:
            if mode in ("adapter", "state"):
                state.save_adapter(tmp, entry.base.name)
            if mode == "state":
                torch.save({"step": state.step, "param_names": list(state.named_parameters()),
                            "optimizer": state.optimizer.state_dict()}, tmp / "optimizer_state.pt")
                write_json(tmp / "config.json", state.config)
            if mode == "merged":
                save_merged(entry, state, tmp)
        return {"checkpoint_path": str(path.resolve()), "mode": mode, "step": state.step, "size_bytes": dir_size(path),
                "compute_seconds": _device_seconds(self.device, started)}

    def _export_checkpoint(self, run_id: str, mode: str, step: int) -> dict[str, Any]:
        """A saved checkpoint's directory as a base64 .tar.gz, for a server whose disk is not the runtime's (Modal)."""
        root = find_run_dir(self.data_dir, run_id)
        if root is None:
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        source = RunPaths(self.data_dir, root.parent.name, run_id).checkpoint(str(mode), int(step))
        if not source.is_dir():
            raise NotFound(f"run {run_id!r} has no {mode} checkpoint at step {step}", field="checkpoint")
        if dir_size(source) > EXPORT_LIMIT_BYTES:
            raise BadInput(f"the checkpoint is over {EXPORT_LIMIT_BYTES >> 20} MiB, too large to stream through the "
                           "runtime: copy it with `signal pull`", field="checkpoint")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            archive.add(source, arcname=f"{run_id[:8]}-step{step}-{mode}")
        return {"archive_b64": base64.b64encode(buffer.getvalue()).decode()}

    def _run_info(self, run_id: str) -> dict[str, Any]:
        return self._info(self._state(run_id))

    def _close_run(self, run_id: str) -> dict[str, Any]:
        if run_id in self.pool.runs:
            self._evict(self.pool.runs[run_id], count=False)
        elif find_run_dir(self.data_dir, run_id) is None:
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        return {"run_id": run_id, "closed": True}

    def _delete_run(self, run_id: str) -> dict[str, Any]:
        if run_id not in self.pool.runs and find_run_dir(self.data_dir, run_id) is None:
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        self.pool.detach(run_id)
        self.pool.evicted.discard(run_id)
        root = find_run_dir(self.data_dir, run_id)
        if root is not None:
            shutil.rmtree(root)
        self._owners.pop(run_id, None)
        return {"run_id": run_id, "deleted": True}

    def _ping(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(), "device": str(self.device), "dtype": dtype_name(self.dtype),
            "loaded_models": list(self.models.loaded), "models": [describe(b) for b in self.models.loaded.values()],
            "runs_in_memory": list(self.pool.runs), "max_batch_size": self.options.max_batch_size,
            "options": self.options.to_dict(),
        }

    def _runtime_state(self) -> dict[str, Any]:
        """What an operator wants to see: bases, resident and evicted runs, queues, and what ticks did."""
        return {
            "device": str(self.device),
            "bases": [{"name": name, "params": e.params, "quantization": e.quantization,
                       "resident_runs": sum(r.base_key == name for r in self.pool.runs.values())}
                      for name, e in self.pool.bases.items()],
            "resident_runs": [{"run_id": r.run_id, "user_id": r.user_id, "base_model": r.base_model,
                               "quantization": r.quantization, "step": r.step,
                               "bytes": r.resident_bytes()} for r in self.pool.runs.values()],
            "evicted_runs": sorted(self.pool.evicted),
            "resident_bytes": self.pool.resident_bytes(),
            "budget": {"bytes": self.options.resident_bytes, "runs": self.options.resident_runs},
            "queue_depth": self.scheduler.queue_depth_by_user(),
            "decode_groups": [{"runs": g.run_ids, "rows": g.rows, "tokens_done": g.t} for g in self.decode_groups],
            "ticks": {"count": self.totals.ticks, "base_passes": self.totals.base_passes, "fb_rows": self.totals.fb_rows,
                      "decode_passes": self.totals.decode_passes, "recent": list(self.totals.last_ticks)},
            "evictions": self.totals.evictions,
            "snapshots": self.totals.snapshots,
            "ranks": self.ranks.describe() if self.ranks is not None else {"world": 1},
        }

    # ---- sampling ---------------------------------------------------------------------------

    def _prepare_sample(self, run_id: str, prompts: list[str], max_tokens: int = 64, temperature: float = 1.0,
                        top_p: float = 1.0, top_k: int = 0, stop: str | list[str] | None = None, num_samples: int = 1,
                        seed: int | None = None, request_id: str | None = None,
                        _request: Request | None = None) -> SampleJob:
        state = self._state(run_id)
        prompts, settings = sampling_settings(prompts, max_tokens, temperature, top_p, top_k, stop, num_samples, seed)
        entry = self.pool.bases[state.base_key]
        limit = entry.renderer.max_length
        prompt_ids = [list(entry.base.tokenizer(p, add_special_tokens=True)["input_ids"]) for p in prompts]
        for i, ids in enumerate(prompt_ids):
            if not ids or len(ids) >= limit:
                raise BadInput(f"prompts[{i}] is {len(ids)} tokens; the model's context is {limit}", field=f"prompts[{i}]")
            if len(ids) + settings.max_tokens > limit:
                raise BadInput(f"prompts[{i}] ({len(ids)} tokens) + max_tokens ({settings.max_tokens}) exceeds "
                               f"the context ({limit})", field="max_tokens")
        assert _request is not None
        generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        return SampleJob(_request, state, prompt_ids, settings, generator, step=state.step)

    def _sampled_before(self, run_id: str, request_id: str | None = None, **_: Any) -> dict[str, Any] | None:
        _check_request_id(request_id)
        if not request_id:
            return None
        previous = self._state(run_id).sampled.get(request_id)
        return None if previous is None else {**previous, "replayed": True}

    def _start_group(self, entry: BaseEntry, jobs: list[SampleJob]) -> None:
        for job in jobs:
            assert job.request.run_id is not None
            self.scheduler.hold(job.request.run_id)
            self.pool.touch(job.state)
        self.decode_groups.append(DecodeGroup(entry, jobs, _eos_ids(entry)))

    def _advance_decoding(self, stats: TickStats) -> None:
        deadline = time.monotonic() + self.options.decode_chunk_seconds
        for group in list(self.decode_groups):
            before = group.passes
            active = [job for job in group.jobs if not job.done]
            started = time.perf_counter()
            try:
                finished = group.advance(deadline)
            except Exception as exc:  # noqa: BLE001 - fail its calls, keep the runtime
                error = exc.to_dict() if isinstance(exc, SignalError) else _internal(exc)
                for job in group.jobs:
                    if not job.done:
                        job.done = True
                        self.scheduler.finish(job.request, {"error": error})
                self.decode_groups.remove(group)
                continue
            stats.decode_passes += group.passes - before
            stats.decode_rows += group.rows
            seconds, rows = _device_seconds(self.device, started), sum(job.end - job.start for job in active)
            for job in active:  # the chunk's seconds, shared by the rows of the calls still decoding
                job.compute_seconds += seconds * (job.end - job.start) / max(rows, 1)
            for job in finished:
                result = {**group.result(job), "compute_seconds": job.compute_seconds}
                job.state.remember_sample(job.request.request_id, result)
                self.scheduler.finish(job.request, {"result": result})
            if group.done:
                self.decode_groups.remove(group)

    # ---- run state: resident, restored, snapshotted, evicted ------------------------------

    def _owner(self, run_id: str | None) -> str:
        if run_id is None:
            return "__system__"
        if run_id not in self._owners:
            root = find_run_dir(self.data_dir, run_id)
            if root is None:
                return "__unknown__"  # it fails with NOT_FOUND when its turn comes
            self._owners[run_id] = read_json(root / "config.json")["user_id"]
        return self._owners[run_id]

    def _state(self, run_id: str) -> RunState:
        check_id(run_id, "run_id")
        state = self.pool.runs.get(run_id)
        if state is None:
            root = find_run_dir(self.data_dir, run_id)
            if root is None:
                raise RunNotFound(f"run {run_id!r} not found", field="run_id")
            state = self._restore(read_json(root / "config.json"))
        self.pool.touch(state)
        return state

    def _restore(self, config: dict[str, Any]) -> RunState:
        """The newest snapshot, then every journal record after it: the run as if it never stopped."""
        state = self.pool.attach(config, self.data_dir)
        try:
            state.load_latest_snapshot(self.device)
            records = state.journal.read()
            for record in records[state.seq:]:
                self._replay(state, record)
            state.seq = len(records)
        except BaseException:
            self.pool.detach(state.run_id)  # never leave a half-restored run in memory
            raise
        if self.pool.bases[state.base_key].base.revision != config.get("base_revision"):
            print(f"warning: run {state.run_id}: base model revision changed since the run was created", file=sys.stderr)
        return state

    def _replay(self, state: RunState, record: dict[str, Any]) -> None:
        request_id = record.get("request_id")
        if request_id and request_id in state.answered:
            return  # a duplicate cannot be applied twice
        if record["type"] == FORWARD_BACKWARD:
            examples = [Example(e["tokens"], e["weights"], e.get("extras") or {}) for e in record["examples"]]
            loss, config = get_loss(record["loss_fn"], record.get("loss_fn_config") or None)
            progress = FbProgress(state, examples, record["loss_fn"], loss, config, record.get("batch_sha256", ""),
                                  call=record["call"], width=max(len(e.tokens) for e in examples) - 1)
            entry = self.pool.bases[state.base_key]
            while progress.done < len(examples):  # split as the budget splits live calls
                part = FbPart(None, progress, self._take_rows(progress, self.options.tick_tokens), progress.done)
                (outcome,) = self._fb_pass(entry, [part])
                assert not isinstance(outcome, SignalError), "a journaled call cannot fail on replay"
                self._fb_done(part, outcome)
        elif "error" in record["result"]:
            # It failed live and dropped the gradients: the journal's outcome holds, whatever a recompute says.
            if self.ranks is not None:
                self.ranks.send("drop_grads", run_id=state.run_id)
            state.optimizer.zero_grad(set_to_none=True)
            state.clear_pending()
        else:
            pending_tokens, pending_batches = state.pending_tokens, state.pending_batches
            try:
                _apply_optim(state, record["adam"], self.ranks)
            except FailedPrecondition:
                pass  # it failed the first time too, and dropped the gradients as it does now
            else:
                if last_manifest_step(state.paths.manifest) < state.step:  # the crash came before its manifest line
                    append_manifest(state.paths.manifest, {
                        "step": state.step, "adam": record["adam"], "grad_norm": record["result"]["grad_norm"],
                        "num_tokens": pending_tokens, "batches": pending_batches})
        state.remember(request_id, record["result"])

    def _journal(self, state: RunState, record: dict[str, Any]) -> None:
        state.journal.append(record)
        state.seq += 1
        self._touched.add(state.run_id)

    def _sync_journals(self) -> None:
        for run_id in list(self._touched):
            state = self.pool.runs.get(run_id)
            if state is not None:
                state.journal.sync()
        if (self._touched or self._snapshotted) and self.after_sync is not None:
            self.after_sync()
        self._touched = set()
        self._snapshotted = False

    def _snapshot(self, state: RunState) -> None:
        state.journal.sync()  # a snapshot never covers records the journal could still lose
        fault = "during_snapshot" if "during_snapshot" in self.faults else None
        state.write_snapshot(self.pool.bases[state.base_key].base.name, fault)
        state.prune_snapshots(self.options.keep_snapshots)
        self.totals.snapshots += 1
        self._snapshotted = True

    def _evict(self, state: RunState, count: bool = True) -> None:
        if state.changed_since_snapshot or state.pending_calls:
            self._snapshot(state)
        self.pool.detach(state.run_id, evicted=count)
        if count:
            self.totals.evictions += 1

    def _housekeeping(self) -> None:
        decoding = {run_id for group in self.decode_groups for run_id in group.run_ids}
        for state in self.pool.over_budget(keep=lambda r: r in decoding or self.scheduler.is_queued(r)):
            self._evict(state)
        if self._snapshotted:
            self._sync_journals()  # eviction snapshots are committed as they are written, not at the next tick
        self.pool.unload_idle_bases()
        if self.ranks is not None:
            self.ranks.keepalive()

    def _idle_timeout(self) -> float:
        return min(self.options.base_idle_seconds, 60.0)

    def shutdown(self) -> None:
        """Let Hub uploads in flight answer; snapshot every resident run that changed, and close its journal."""
        for thread in list(self._uploads):
            thread.join(timeout=UPLOAD_GRACE_SECONDS)
        for state in list(self.pool.runs.values()):
            if state.changed_since_snapshot:
                self._snapshot(state)
            state.journal.close()
        if self.ranks is not None:
            self.ranks.stop()

    def _restart_ranks(self) -> None:
        """A rank died or hung, and every rank was stopped. The runs' in-memory state may be half a pass along, so it
        is dropped unsaved: every acknowledged call is in a journal. What was mid-flight fails; calls still queued
        start afresh; runs come back from snapshot + journal on their next call, through a fresh group."""
        assert self.ranks is not None and isinstance(self.pool, ShardedPool)
        error = WorkerFailed(f"a rank of this pool failed ({self.ranks.failed}); the pool restarted: retry the call")
        for group in self.decode_groups:
            for job in group.jobs:
                if not job.done:
                    job.done = True
                    self.scheduler.finish(job.request, {"error": error.to_dict()})
        self.decode_groups = []
        for request in self.scheduler.queued():
            if isinstance(request.progress, FbProgress) and request.progress.done > 0:
                self.scheduler.finish(request, {"error": error.to_dict()})  # part of it went with the dropped state
            else:
                request.progress = None  # prepared again, against the restored run
        self.pool.forget()
        self.ranks.restart()

    # ---- bookkeeping -------------------------------------------------------------------------

    def _count(self, stats: TickStats) -> None:
        self.last_tick = stats
        totals = self.totals
        totals.ticks += 1
        totals.base_passes += stats.base_passes
        totals.fb_rows += stats.fb_rows
        totals.decode_passes += stats.decode_passes
        if stats.requests or stats.decode_passes:
            totals.last_ticks = (totals.last_ticks + [stats.__dict__.copy()])[-20:]

    def _manifest_header(self, state: RunState, entry: BaseEntry) -> dict[str, Any]:
        base = entry.base
        return {
            "run_id": state.run_id, "user_id": state.user_id,
            "base_model": {"name": base.name, "revision": base.revision, "source": base.source},
            "lora": state.lora, "seed": state.config["seed"], "optimizer": "torch.optim.AdamW",
            "device": str(self.device), "dtype": dtype_name(self.dtype),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        }

    def _info(self, state: RunState) -> dict[str, Any]:
        trainable = sum(p.numel() for p in state.parameters())
        return {
            "run_id": state.run_id, "user_id": state.user_id, "base_model": state.base_model,
            "quantization": state.quantization, "base_revision": state.config["base_revision"], "lora": state.lora,
            "target_modules": state.lora["target_modules"], "seed": state.config["seed"], "step": state.step,
            "trainable_params": trainable, "total_params": self.pool.bases[state.base_key].params + trainable,
            "pending_forward_backward": state.pending_calls, "pending_tokens": state.pending_tokens,
            "path": str(state.paths.root), "device": str(self.device),
        }


def _apply_optim(state: RunState, settings: dict[str, float], ranks: RankGroup | None = None) -> dict[str, Any]:
    """AdamW on the run's summed gradients divided by their normaliser (on every rank, alike); clears them."""
    if state.pending_calls == 0:
        raise FailedPrecondition("no gradients to apply: call forward_backward before optim_step")
    if ranks is not None:
        ranks.send("optim", run_id=state.run_id, normaliser=state.pending_normaliser, settings=settings)
    grad_norm = adamw_step(state.parameters(), state.optimizer, state.pending_normaliser, settings)
    state.clear_pending()
    if not math.isfinite(grad_norm):
        raise FailedPrecondition(f"gradient norm is {grad_norm}; the step was skipped and the gradients dropped")
    state.step += 1
    return {"step": state.step, "grad_norm": grad_norm, "learning_rate": settings["learning_rate"]}


def _device_seconds(device: torch.device, started: float) -> float:
    """Seconds since `started` (time.perf_counter), once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _restore_grads(progress: FbProgress) -> None:
    if progress.backup is None or progress.done == 0:
        return  # nothing of this call reached the gradients
    for param, grad in zip(progress.state.parameters(), progress.backup):
        param.grad = grad


def _check_request_id(request_id: Any) -> None:
    if request_id is not None and (not isinstance(request_id, str) or not 1 <= len(request_id) <= 128):
        raise BadInput("request_id must be a string of 1-128 characters", field="request_id")


def _derive_seed(*parts: int) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _eos_ids(entry: BaseEntry) -> set[int]:
    ids = {entry.base.tokenizer.eos_token_id}
    configured = getattr(entry.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def _internal(exc: BaseException) -> dict[str, Any]:
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    return {"type": "InternalError", "code": "INTERNAL", "message": f"{type(exc).__name__}: {exc}", "field": None}

