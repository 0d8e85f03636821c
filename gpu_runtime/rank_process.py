"""A follower rank of a multi-GPU pool (`python -m gpu_runtime.rank_process`), started by rank 0's `RankGroup`
(gpu_runtime/compute/ranks.py): a pool of shards and run replicas, changed only by rank 0's ops. An entry point, like
`runtime_process`: it holds runs (the engine's `ShardedResidency`) and runs their passes (compute)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from gpu_runtime.compute.plan import RunConfig
from gpu_runtime.compute.ranks import OPS_TIMEOUT, START_TIMEOUT_S, Op, describe_rank
from gpu_runtime.compute.sharding import PassPlan, RankShard, ShardedRegistry, gather_root
from gpu_runtime.compute.training import adamw_step, forward_backward_pass
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.engine.residency import ShardedResidency
from gpu_runtime.errors import SignalError


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
        """Rank 0 runs its decoder outside a pass (a decode step): this rank's part of each gather, on one row."""
        entry = self.pool.bases[key]
        pad = entry.base.tokenizer.pad_token_id or 0
        gather_root(entry.model)
        with torch.no_grad():
            cast(Any, entry.model).get_decoder()(input_ids=torch.tensor([[pad]], device=self.device), use_cache=False)

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
        adamw_step(state.parameters(), state.optimizer, normaliser, settings, kernel)  # as rank 0's tick steps it

    def drop_grads(self, run_id: str) -> None:
        self.pool.runs[run_id].optimizer.zero_grad(set_to_none=True)

    def restore_grads(self, run_id: str) -> None:
        """A split call withdrawn between its parts (a cancel): the gradients from before it put back, as rank 0 does."""
        backup = self.backups.pop(run_id, None)
        if backup is not None:
            for param, grad in zip(self.pool.runs[run_id].parameters(), backup):
                param.grad = grad


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_runtime.rank_process", description="A follower rank of a pool.")
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

    from gpu_runtime.compute.devices import resolve_device

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
