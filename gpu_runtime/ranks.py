"""A multi-GPU pool's ranks: N processes over torch.distributed, started once and kept alive between calls.

Rank 0 is the engine's own process: it takes every call, runs the scheduler, journals and answers.
Ranks 1..N-1 are followers (`python -m gpu_runtime.ranks`, started by `RankGroup`): each holds its
shard of every base and a replica of every resident run's fp32 LoRA matrices and AdamW state, and
does what rank 0 sends it, in the order sent: load a base, attach or detach a run, run a pass, take
an AdamW step. So every rank runs the same collectives in the same order.

Ops go out with `broadcast_object_list` on a gloo group of their own, whose timeout is long (a
follower waits for the next call as long as it takes); the work's collectives use the default group
(gloo on CPU, NCCL on CUDA), which times out after `rank_timeout_seconds`.

Supervision: a thread per follower waits for its process. A follower that exits (it died, or it
raised: followers never carry on after an error) fails the group; so does any collective on rank 0
that raises or times out (a hung rank). Failing the group kills every follower, and the call in
flight is answered WORKER_FAILED (`RanksFailed`). The engine then drops every run and base from
memory, starts a fresh group, and restores runs from snapshot + journal on their next call:
nothing acknowledged is lost. Followers exit when rank 0 goes (their stdin is its pipe).

Failpoints for tests: `rank_dies` (the last rank SIGKILLs itself when its next pass begins) and
`rank_hangs` (it blocks there), armed with `RankGroup.arm` or given in the engine's `faults` (they
fire in the first group only: a restarted group runs clean).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.errors import BadInput, SignalError, WorkerFailed
from gpu_runtime.optimizer import kernel as optimizer_kernel
from gpu_runtime.pool import BaseEntry, Residency
from gpu_runtime.quantization import base_key
from gpu_runtime.run_state import RunConfig, RunState
from gpu_runtime.sharding import PassPlan, RankShard, ShardedRegistry, ShardedResidency, local_param_bytes, split_rows
from gpu_runtime.training import Outcome, PassPart, adamw_step, forward_backward_pass

RANK_FAULTS = ("rank_dies", "rank_hangs")
START_TIMEOUT_S = 300.0  # followers import torch and transformers before they connect
OPS_TIMEOUT = timedelta(days=7)  # a follower waits this long for the next op; rank 0 sends a keep-alive far sooner
KEEPALIVE_S = 3600.0
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


class RanksFailed(WorkerFailed):
    """A rank died or hung: every rank was stopped. The pool restarts and replays its journals; retry the call."""


@dataclass
class Op:
    kind: str
    args: dict[str, Any]


class RankGroup:
    """Rank 0's handle on the group: starts and supervises the followers, and sends them ops."""

    def __init__(self, world: int, device: torch.device, data_dir: str | Path, options: RuntimeOptions,
                 allow_downloads: bool = False, faults: set[str] | None = None, python: str = sys.executable) -> None:
        if world < 2:
            raise BadInput(f"a rank group needs at least 2 ranks, got {world}", field="local_ranks")
        first = device.index or 0
        if device.type == "cuda" and first + world > torch.cuda.device_count():
            raise BadInput(f"{world} ranks from {device} need {first + world} GPUs; this machine has "
                           f"{torch.cuda.device_count()}", field="local_ranks")
        self.world, self.device, self.data_dir = world, device, str(data_dir)
        self.options, self.allow_downloads, self.python = options, allow_downloads, python
        self.timeout = options.rank_timeout_seconds
        self.faults = {f for f in (faults or set()) if f in RANK_FAULTS}
        self.processes: list[subprocess.Popen[bytes]] = []
        self.failed: str | None = None
        self.generation = 0  # bumped by every (re)start: a watcher of an older group says nothing
        self.restarts = 0
        self.in_pass = False  # rank 0's forwards inside a pass are the pass's own; outside one, followers mirror them
        self.last_pass: list[tuple[int, int, int]] = []  # every rank's (first row, end row, tokens) in the last pass
        self.last_sent = time.monotonic()
        self._control: Any = None
        self._store: Any = None
        self._stopping = False
        self._lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the followers, wait until they are ready, and join the process group as rank 0."""
        if dist.is_initialized():
            raise BadInput("this process already belongs to a process group: one multi-rank pool per process "
                           "(a Modal container, or the local runtime)", field="local_ranks")
        store = dist.TCPStore(
            "127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        self._store, self.failed, self._stopping = store, None, False
        faults, self.faults = self.faults, set()  # they fire once: a restarted group runs clean
        self.processes = [self._spawn(rank, store.port, faults if rank == self.world - 1 else set())
                          for rank in range(1, self.world)]
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process, self.generation), daemon=True,
                             name=f"rank-{rank}-watch").start()
        try:  # a follower that exits while starting sets every key (see fail), so this wait ends at once
            store.wait(self._ready_keys(), timedelta(seconds=START_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - the store's timeout
            self.fail(f"ranks did not start within {START_TIMEOUT_S:.0f} s")
            raise RanksFailed(f"ranks did not start: {self.failed}") from exc
        if self.failed:
            raise RanksFailed(f"ranks did not start: {self.failed}")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=self.world,
                                timeout=timedelta(seconds=self.timeout))
        self._control = dist.new_group(backend="gloo", timeout=OPS_TIMEOUT)
        self.last_sent = time.monotonic()

    def stop(self) -> None:
        """Tell the followers to exit, wait for them (killing any that do not), and leave the group."""
        if not self.failed and self._control is not None:
            try:
                self.send("stop")
            except RanksFailed:
                pass
        self._end(graceful=not self.failed)

    def restart(self) -> None:
        """After a failure: every follower killed, the group left, and a fresh one started."""
        self._end(graceful=False)
        self.generation += 1
        self.restarts += 1
        self.start()

    def fail(self, reason: str) -> None:
        """Stop every rank: a follower blocked in a collective with the failed one would wait for ever."""
        with self._lock:
            if self.failed is None:
                self.failed = reason
                print(f"gpu_runtime ranks: {reason}; stopping every rank", file=sys.stderr)
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        store = self._store
        if store is not None and self._control is None:  # still starting: end rank 0's wait for the followers
            for key in self._ready_keys():
                store.set(key, "failed")

    def _exited(self) -> str | None:
        """A follower that died is the cause worth naming (a collective with it fails a moment after it exits)."""
        for rank, process in enumerate(self.processes, start=1):
            try:
                code = process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            return f"rank {rank} exited with code {code}"
        return None

    def _ready_keys(self) -> list[str]:
        return [f"ready/{rank}" for rank in range(1, self.world)]

    def _end(self, graceful: bool) -> None:
        self._stopping = True
        for process in self.processes:
            if not graceful and process.poll() is None:
                process.kill()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()
        self.processes = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self._control, self._store = None, None

    def _spawn(self, rank: int, port: int, faults: set[str]) -> subprocess.Popen[bytes]:
        device = f"cuda:{(self.device.index or 0) + rank}" if self.device.type == "cuda" else "cpu"
        command = [self.python, "-m", "gpu_runtime.ranks", "--rank", str(rank), "--world", str(self.world),
                   "--port", str(port), "--data-dir", self.data_dir, "--device", device,
                   "--options", json.dumps(self.options.to_dict()), "--faults", ",".join(sorted(faults))]
        command += ["--allow-downloads"] if self.allow_downloads else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_PARENT, os.environ.get("PYTHONPATH")) if p)}
        # stdin is our pipe: the follower exits when we go. stdout joins stderr: a worker's stdout is its protocol.
        return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=2, env=env)

    def _watch(self, rank: int, process: subprocess.Popen[bytes], generation: int) -> None:
        code = process.wait()
        if generation == self.generation and not self._stopping:
            self.fail(f"rank {rank} exited with code {code}")
            if self._control is not None:
                try:  # rank 0 may be waiting in a collective with the dead rank: end the wait now, not at the timeout
                    dist.distributed_c10d._abort_process_group()
                except Exception as exc:  # noqa: BLE001 - then the collective's own timeout ends it
                    print(f"gpu_runtime ranks: abort failed: {exc}", file=sys.stderr)

    # ---- ops ----------------------------------------------------------------------------------

    def send(self, kind: str, cleanup: bool = False, **args: Any) -> None:
        """Broadcast one op to the followers. `cleanup` ops (forgetting a run or base) are skipped when the group
        has failed: the followers that held them are gone."""
        if self.failed:
            if cleanup:
                return
            raise RanksFailed(f"a rank of this pool failed ({self.failed}); the pool is restarting: retry the call")
        with self.guard():
            dist.broadcast_object_list([Op(kind, args)], src=0, group=self._control)
        self.last_sent = time.monotonic()

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Work with collectives in it: anything raised fails the whole group (the ranks may be out of step)."""
        try:
            yield
        except RanksFailed:
            raise
        except Exception as exc:
            self.fail(self._exited() or f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise RanksFailed(f"a rank of this pool failed ({self.failed}); the pool is restarting: retry the call") from exc

    def forward_backward(self, entry: BaseEntry, runs: dict[str, RunState], parts: list[PassPart]) -> list[Outcome]:
        """The pass on every rank: the plan (parts, each rank's rows and tokens) goes out, then rank 0 does its share."""
        chunks, tokens = split_rows(parts, self.world)
        self.send("fb_pass", plan=PassPlan(base_key(entry.base.name, entry.quantization), parts, chunks, tokens))
        shard = RankShard(0, self.world, chunks[0])
        with self.guard():
            self.in_pass = True
            try:
                outcomes = forward_backward_pass(entry, runs, parts, self.device, shard)
            finally:
                self.in_pass = False
        self.last_pass = shard.processed
        return outcomes

    def mirror_forwards(self, key: str, model: torch.nn.Module) -> None:
        """A forward of rank 0's outside a pass (decoding a sample) has every follower run one too, on one row:
        FSDP gathers each layer from every rank. Prepended, so it goes out before FSDP's own hook gathers."""
        def mirror(module: torch.nn.Module, args: Any) -> None:
            if not self.in_pass:
                self.send("forward", key=key)

        model.register_forward_pre_hook(mirror, prepend=True)

    def report(self, pool: Residency) -> list[dict[str, Any]]:
        """What each rank holds: its shard of each base, and the LoRA and AdamW bytes of the runs it replicates."""
        self.send("report")
        gathered: list[Any] = [None] * self.world
        with self.guard():
            dist.all_gather_object(gathered, describe_rank(0, pool), group=self._control)
        return gathered

    def arm(self, fault: str) -> None:
        """Tests: the last rank dies or hangs when its next pass begins (a failpoint of RANK_FAULTS)."""
        if fault not in RANK_FAULTS:
            raise BadInput(f"unknown rank fault {fault!r}; known: {list(RANK_FAULTS)}", field="fault")
        self.send("arm", rank=self.world - 1, fault=fault)

    def keepalive(self) -> None:
        if not self.failed and time.monotonic() - self.last_sent > KEEPALIVE_S:
            self.send("noop", cleanup=True)

    def describe(self) -> dict[str, Any]:
        return {"world": self.world, "backend": "nccl" if self.device.type == "cuda" else "gloo",
                "pids": [os.getpid()] + [p.pid for p in self.processes], "restarts": self.restarts,
                "failed": self.failed, "timeout_seconds": self.timeout, "last_pass": self.last_pass}


def describe_rank(rank: int, pool: Residency) -> dict[str, Any]:
    lora = sum(p.numel() * p.element_size() for state in pool.runs.values() for p in state.parameters())
    optimizer = sum(t.numel() * t.element_size() for state in pool.runs.values()
                    for moments in state.optimizer.state.values() for t in moments.values()
                    if isinstance(t, torch.Tensor))
    return {"rank": rank, "pid": os.getpid(), "runs": sorted(pool.runs),
            "base_bytes": {key: local_param_bytes(entry.model) for key, entry in pool.bases.items()},
            "base_params": {key: entry.params for key, entry in pool.bases.items()},
            "lora_bytes": lora, "optimizer_bytes": optimizer}


# ---- a follower ---------------------------------------------------------------------------------


class Follower:
    """Ranks 1..N-1: a pool of shards and run replicas, changed only by rank 0's ops."""

    def __init__(self, rank: int, world: int, device: torch.device, dtype: torch.dtype, data_dir: str,
                 options: RuntimeOptions, faults: set[str], allow_downloads: bool) -> None:
        self.rank, self.world, self.device, self.data_dir = rank, world, device, data_dir
        self.models = ShardedRegistry(data_dir, device, dtype, rank, world, allow_downloads=allow_downloads)
        self.pool = ShardedResidency(self.models, options)
        self.faults = faults
        self.backups: dict[str, list[torch.Tensor | None]] = {}  # a split call's gradients from before it

    def serve(self, control: Any) -> None:
        while True:
            holder: list[Any] = [None]
            dist.broadcast_object_list(holder, src=0, group=control)
            op: Op = holder[0]
            if op.kind == "stop":
                return
            if op.kind == "report":
                dist.all_gather_object([None] * self.world, describe_rank(self.rank, self.pool), group=control)
                continue
            getattr(self, op.kind)(**op.args)

    def noop(self) -> None:
        pass

    def arm(self, rank: int, fault: str) -> None:
        if rank == self.rank:
            self.faults.add(fault)

    def base(self, name: str, files: Any) -> None:
        self.models.files[name] = files
        self.pool.base(name)

    def attach(self, config: RunConfig) -> None:
        state = self.pool.attach(config, self.data_dir)
        state.load_latest_snapshot(self.device)  # rank 0 loads the same one as it restores the run

    def detach(self, run_id: str) -> None:
        self.backups.pop(run_id, None)
        self.pool.detach(run_id)

    def unload(self, keys: list[str]) -> None:
        for key in keys:
            self.pool.bases.pop(key, None)
            self.models.unload(key)

    def forward(self, key: str) -> None:
        entry = self.pool.bases[key]
        pad = entry.base.tokenizer.pad_token_id or 0
        with torch.no_grad():
            entry.model(input_ids=torch.tensor([[pad]], device=self.device))

    def fb_pass(self, plan: PassPlan) -> None:
        if "rank_dies" in self.faults:
            os.kill(os.getpid(), signal.SIGKILL)  # failpoint: this rank dies mid-call
        if "rank_hangs" in self.faults:
            threading.Event().wait()  # failpoint: this rank hangs mid-call, until rank 0's timeout stops it
        runs = self.pool.runs
        for part in plan.parts:
            if part.backup and part.run_id is not None:
                self.backups[part.run_id] = [None if p.grad is None else p.grad.clone() for p in runs[part.run_id].parameters()]
        shard = RankShard(self.rank, self.world, plan.chunks[self.rank])
        outcomes = forward_backward_pass(self.pool.bases[plan.key], runs, plan.parts, self.device, shard)
        for part, outcome in zip(plan.parts, outcomes):  # as the engine does on rank 0
            if part.run_id is None or part.forward_only:
                continue  # a forward keeps no gradient
            if isinstance(outcome, SignalError):
                backup = self.backups.pop(part.run_id, None)
                if backup is not None and part.row_offset > 0:  # a later part of a split call failed: undo the earlier
                    for param, grad in zip(runs[part.run_id].parameters(), backup):
                        param.grad = grad
            elif part.row_offset + len(part.examples) >= part.call_rows:
                self.backups.pop(part.run_id, None)

    def optim(self, run_id: str, normaliser: float, settings: dict[str, float], kernel: str | None = None) -> None:
        state = self.pool.runs[run_id]
        with optimizer_kernel(state.optimizer, kernel):
            adamw_step(state.parameters(), state.optimizer, normaliser, settings)

    def drop_grads(self, run_id: str) -> None:
        self.pool.runs[run_id].optimizer.zero_grad(set_to_none=True)

    def restore_grads(self, run_id: str) -> None:
        """A split call withdrawn between its parts (a cancel): the gradients from before it put back, as rank 0 does."""
        backup = self.backups.pop(run_id, None)
        if backup is not None:
            for param, grad in zip(self.pool.runs[run_id].parameters(), backup):
                param.grad = grad


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_runtime.ranks", description="A follower rank of a pool.")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--faults", default="")
    parser.add_argument("--allow-downloads", action="store_true")
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with_parent, daemon=True, name="parent-watch").start()

    from gpu_runtime.devices import resolve_device

    device, dtype = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options = RuntimeOptions.from_dict(json.loads(args.options))
    store = dist.TCPStore(
        "127.0.0.1", args.port, args.world, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    store.set(f"ready/{args.rank}", "1")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=options.rank_timeout_seconds))
    control = dist.new_group(backend="gloo", timeout=OPS_TIMEOUT)
    follower = Follower(args.rank, args.world, device, dtype, args.data_dir, options,
                        {f for f in args.faults.split(",") if f}, args.allow_downloads)
    try:
        follower.serve(control)
    except BaseException:  # noqa: BLE001 - a follower never carries on after an error: rank 0 sees it exit
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)  # not a normal exit: the parent-watch thread is blocked reading stdin


def _exit_with_parent() -> None:
    """Our stdin is rank 0's pipe: at its end (rank 0 exited or was killed), so do we."""
    while sys.stdin.buffer.read(1 << 16):
        pass
    os._exit(0)


if __name__ == "__main__":
    main()
