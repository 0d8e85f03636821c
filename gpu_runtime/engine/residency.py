"""Residency: the bases this runtime holds and the runs resident on them, within a memory budget.

(A *pool* is the whole runtime for one pool key, a process or a Modal container; `Residency` is what it
holds in memory. The deployed Modal class keeps the name `Pool`.)

Each base is loaded once (gpu_runtime/compute/pool.py); its targeted Linear layers are wrapped by `MultiLoraLinear`
as runs ask for them, and every resident run's matrices hang off those layers. Runs are kept in least recently used
order; past the budget (bytes of LoRA + AdamW + gradients, or a count) the oldest idle ones are handed to the eviction
(gpu_runtime/engine/recovery.py) to snapshot and free. A base with no resident runs is unloaded after an idle time.
`ShardedResidency` is the same with its bases sharded across a multi-GPU pool's ranks.
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from gpu_runtime.client.persistence import RunPaths
from gpu_runtime.compute.hardware import LocalCompute, RankCompute
from gpu_runtime.compute.host_memory import keep_freed_memory
from gpu_runtime.compute.lora.wrap import init_lora, linear_module_names, wrap_targets
from gpu_runtime.compute.memory_fit import activation_bytes_per_token, free_device_bytes, pass_reserve, resident_budget
from gpu_runtime.compute.models import ModelRegistry
from gpu_runtime.compute.optimizer import new_adamw
from gpu_runtime.compute.pass_logprobs import decoder_layers
from gpu_runtime.compute.pool import BaseEntry, load_base
from gpu_runtime.compute.quantization import base_key
from gpu_runtime.compute.ranks import RankGroup
from gpu_runtime.compute.sharding import ShardedRegistry, require_grad
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.engine.journal import Journal
from gpu_runtime.engine.run_state import RunConfig, RunState


class HeldSnapshot(Protocol):
    """What the budget and the base unloading read of a sampler snapshot (engine/snapshots.py's Snapshot)."""

    base_key: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None

    def resident_bytes(self) -> int: ...


class Residency:
    def __init__(self, models: ModelRegistry, options: RuntimeOptions) -> None:
        self.models = models
        self.options = options
        self.bases: dict[str, BaseEntry] = {}
        self.runs: OrderedDict[str, RunState] = OrderedDict()  # least recently used first
        self.evicted: set[str] = set()  # runs evicted since this runtime started (they reload on their next call)
        # Sampler snapshots (gpu_runtime/engine/snapshots.py), by routing key: they count against the same budget.
        self.snapshots: Mapping[str, HeldSnapshot] = {}

    def base(self, name: str, quantization: str | None = None) -> BaseEntry:
        key = base_key(name, quantization)
        if key not in self.bases:
            self.bases[key] = load_base(self.models, name, quantization)
        return self.bases[key]

    def attach(self, config: RunConfig, data_dir: Any) -> RunState:
        """Put a run in memory, freshly initialised from its seed (the engine then restores what it saved)."""
        entry = self.base(config["base_model"], config.get("quantization"))
        lora = config["lora"]
        entry.layers = wrap_targets(entry.model, lora["target_modules"], entry.routing)
        weights = init_lora(entry.layers, lora["target_modules"], lora["r"], lora["alpha"], config["seed"],
                            self.models.device)
        params = [p for path in sorted(weights) for p in weights[path]]
        paths = RunPaths(data_dir, config["user_id"], config["run_id"])
        state = RunState(
            run_id=config["run_id"], user_id=config["user_id"], config=config, paths=paths,
            base_model=config["base_model"], weights=weights,
            optimizer=new_adamw(params), journal=Journal(paths.journal),
        )
        state.attach(entry.layers, entry.routing.slots)
        self.runs[state.run_id] = state
        self.evicted.discard(state.run_id)
        return state

    def detach(self, run_id: str, evicted: bool = False) -> None:
        state = self.runs.pop(run_id, None)
        if state is None:
            return
        entry = self.bases.get(state.base_key)
        if entry is not None:
            state.detach(entry.routing.slots, entry.layers)
            if not any(r.base_key == state.base_key for r in self.runs.values()):
                entry.idle_since = time.monotonic()
        state.journal.close()
        state.optimizer.state.clear()
        if evicted:
            self.evicted.add(run_id)
        del state
        gc.collect()
        if self.models.device.type == "cuda":
            torch.cuda.empty_cache()

    def touch(self, state: RunState) -> None:
        state.last_used = time.monotonic()
        self.runs.move_to_end(state.run_id)

    def resident_bytes(self) -> int:
        runs = sum(state.resident_bytes() for state in self.runs.values())
        snapshots: int = sum(snapshot.resident_bytes() for snapshot in self.snapshots.values())
        return runs + snapshots

    def budget_bytes(self, held: int | None = None) -> int:
        """The resident budget: `resident_bytes` where set, else sized from the device's free memory with a pass at
        the token budget set aside (compute/memory_fit.py). `held`: resident_bytes() when the caller has it."""
        if self.options.resident_bytes:
            return self.options.resident_bytes
        free = free_device_bytes(self.models.device)
        if free is None:
            return resident_budget(None, 0, 0)
        reserve = max((pass_reserve(len(decoder_layers(entry.model)), self.options.tick_tokens,
                                    activation_bytes_per_token(entry.model), free) for entry in self.bases.values()),
                      default=0)  # one pass at a time: the largest base's
        return resident_budget(free, self.resident_bytes() if held is None else held, reserve)

    def over_budget(self, keep: Callable[[str], bool]) -> list[RunState]:
        """Least recently used runs to evict (never those `keep` names) until the budget holds."""
        victims: list[RunState] = []
        total, count = self.resident_bytes(), len(self.runs)
        budget = self.budget_bytes(total)
        for state in list(self.runs.values()):
            if total <= budget and count <= self.options.resident_runs:
                break
            if keep(state.run_id):
                continue
            victims.append(state)
            total -= state.resident_bytes()
            count -= 1
        return victims

    def unload_idle_bases(self) -> list[str]:
        """Unload bases no run or in-memory snapshot uses, idle long enough (a decode group keeps `idle_since` fresh)."""
        now, unloaded = time.monotonic(), []
        for name, entry in list(self.bases.items()):
            in_use = any(r.base_key == name for r in self.runs.values()) or any(
                s.base_key == name and s.weights is not None for s in self.snapshots.values())
            if not in_use and now - entry.idle_since >= self.options.base_idle_seconds:
                del self.bases[name]
                self.models.unload(name)
                unloaded.append(name)
        if unloaded:
            gc.collect()
        return unloaded


class ShardedResidency(Residency):
    """A pool whose bases are sharded across ranks. On rank 0 (`group` set) every change is sent to the others first."""

    def __init__(self, models: ShardedRegistry, options: RuntimeOptions, group: RankGroup | None = None) -> None:
        super().__init__(models, options)
        self.sharded = models
        self.group = group

    def base(self, name: str, quantization: str | None = None) -> BaseEntry:
        key = base_key(name, quantization)
        if key in self.bases:
            return self.bases[key]
        if quantization:
            self.sharded.get(name, quantization)  # refuses, typed
        if self.group is not None:
            files = self.sharded.resolve(name)
            self.sharded.files[name] = files
            self.group.send("base", name=name, files=files)
            with self.group.guard():
                entry = super().base(name)
        else:
            entry = super().base(name)
        # Every layer LoRA may target is wrapped once, now: runs attach to it later without touching the sharded tree.
        entry.layers = wrap_targets(entry.model, sorted(linear_module_names(entry.model, unembedding=True)), entry.routing)
        cast(Any, entry.model).get_input_embeddings().register_forward_hook(require_grad)
        if self.group is not None:
            self.group.mirror_forwards(key, entry.model)
        return entry

    def attach(self, config: RunConfig, data_dir: Any) -> RunState:
        self.base(config["base_model"], config.get("quantization"))
        if self.group is not None:
            self.group.send("attach", config=config)
        return super().attach(config, data_dir)

    def detach(self, run_id: str, evicted: bool = False) -> None:
        if self.group is not None and run_id in self.runs:
            self.group.send("detach", cleanup=True, run_id=run_id)
        super().detach(run_id, evicted)

    def unload_idle_bases(self) -> list[str]:
        unloaded = super().unload_idle_bases()
        if unloaded and self.group is not None:
            self.group.send("unload", cleanup=True, keys=unloaded)
        return unloaded

    def forget(self) -> None:
        """Drop every run and base from memory, without a word to the ranks (they are gone): after a failure."""
        for state in self.runs.values():
            state.journal.close()
        self.runs.clear()
        self.bases.clear()
        self.sharded.loaded.clear()
        self.sharded.files.clear()


@dataclass
class Hardware:
    compute: LocalCompute
    models: ModelRegistry
    residency: Residency


def open_hardware(data_dir: Path, device: torch.device, dtype: torch.dtype, options: RuntimeOptions,
                  allow_downloads: bool, faults: set[str]) -> Hardware:
    """`local_ranks` > 1: a multi-GPU pool, its bases sharded across the ranks; else this process alone."""
    if device.type == "cpu":  # the C allocator then serves the tensors themselves
        keep_freed_memory()
    if options.local_ranks > 1:
        world = options.local_ranks
        ranks = RankGroup(world, device, data_dir, options, allow_downloads, faults)
        sharded = ShardedRegistry(data_dir, device, dtype, 0, world, allow_downloads)
        residency = ShardedResidency(sharded, options, ranks)
        ranks.start()
        return Hardware(RankCompute(device, ranks), sharded, residency)
    models = ModelRegistry(data_dir, device, dtype, allow_downloads=allow_downloads)
    return Hardware(LocalCompute(device), models, Residency(models, options))
