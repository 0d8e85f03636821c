"""A multi-GPU pool's ranks: N processes over torch.distributed, started once and kept alive between calls.

Rank 0 is the engine's own process: it takes every call, runs the scheduler, journals and answers.
Ranks 1..N-1 are followers (`python -m gpu_runtime.compute.ranks`, started by `RankGroup`): each holds its
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

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, Required, TypedDict, cast

import torch
import torch.distributed as dist

from gpu_runtime.compute.plan import Outcome, PassPart, RunWeights
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.quantization import base_key
from gpu_runtime.compute.sharding import PassPlan, RankShard, gather_root, local_param_bytes, split_rows
from gpu_runtime.compute.training import forward_backward_pass
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.errors import BadInput, WorkerFailed

RANK_FAULTS = ("rank_dies", "rank_hangs")
START_TIMEOUT_S = 300.0  # followers import torch and transformers before they connect
OPS_TIMEOUT = timedelta(days=7)  # a follower waits this long for the next op; rank 0 sends a keep-alive far sooner
KEEPALIVE_S = 3600.0
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


class HeldRuns(Protocol):
    """What a rank holds, as its report reads it: the engine's residency, or a follower's."""

    @property
    def runs(self) -> Mapping[str, RunWeights]: ...

    @property
    def bases(self) -> Mapping[str, BaseEntry]: ...


class RanksFailed(WorkerFailed):
    """A rank died or hung: every rank was stopped. The pool restarts and replays its journals; retry the call."""


class RankReport(TypedDict):
    """What one rank holds (RankGroup.report, one per rank)."""

    rank: int
    pid: int
    runs: list[str]
    base_bytes: dict[str, int]  # per base: this rank's shard
    base_params: dict[str, int]
    lora_bytes: int
    optimizer_bytes: int


class GroupReport(TypedDict, total=False):
    """A pool's compute as the runtime state shows it: `world` alone for one GPU, the group's state for several."""

    world: Required[int]
    backend: str
    pids: list[int]  # rank 0's first
    restarts: int
    failed: str | None
    timeout_seconds: float
    last_pass: list[tuple[int, int, int]]


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
        command = [self.python, "-m", "gpu_runtime.rank_process", "--rank", str(rank), "--world", str(self.world),
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

    def forward_backward(self, entry: BaseEntry, runs: Mapping[str, RunWeights], parts: list[PassPart]) -> list[Outcome]:
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
        """Every forward of rank 0's outside a pass has every follower run one too, on one row: FSDP gathers each
        layer from every rank, in the same order. The decode engine calls the decoder and the head apart (the root's
        own forward never runs), so the decoder is hooked too, and the root's parameters (embeddings, final norm, head)
        are gathered before the op's layers, as the root's forward does. Prepended: the op goes out before any gather."""
        decoder = cast(Any, model).get_decoder()
        outer = [False]  # inside a root forward outside a pass: its decoder is already mirrored

        def mirror(module: torch.nn.Module, args: Any) -> None:
            if self.in_pass or outer[0]:
                return
            self.send("forward", key=key)
            gather_root(model)
            outer[0] = module is model

        def done(module: torch.nn.Module, args: Any, output: Any) -> None:
            outer[0] = False

        model.register_forward_pre_hook(mirror, prepend=True)
        model.register_forward_hook(done, always_call=True)
        decoder.register_forward_pre_hook(mirror, prepend=True)

    def report(self, pool: HeldRuns) -> list[RankReport]:
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

    def describe(self) -> GroupReport:
        return {"world": self.world, "backend": "nccl" if self.device.type == "cuda" else "gloo",
                "pids": [os.getpid()] + [p.pid for p in self.processes], "restarts": self.restarts,
                "failed": self.failed, "timeout_seconds": self.timeout, "last_pass": self.last_pass}


def describe_rank(rank: int, pool: HeldRuns) -> RankReport:
    lora = sum(p.numel() * p.element_size() for state in pool.runs.values() for p in state.parameters())
    optimizer = sum(t.numel() * t.element_size() for state in pool.runs.values()
                    for moments in state.optimizer.state.values() for t in moments.values()
                    if isinstance(t, torch.Tensor))
    return {"rank": rank, "pid": os.getpid(), "runs": sorted(pool.runs),
            "base_bytes": {key: local_param_bytes(entry.model) for key, entry in pool.bases.items()},
            "base_params": {key: entry.params for key, entry in pool.bases.items()},
            "lora_bytes": lora, "optimizer_bytes": optimizer}


# ---- a follower ---------------------------------------------------------------------------------
