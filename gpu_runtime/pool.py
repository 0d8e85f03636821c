"""Residency: the bases this runtime holds and the runs resident on them, within a memory budget.

(A *pool* is the whole runtime for one pool key, a process or a Modal container; `Residency` is what it
holds in memory. The deployed Modal class keeps the name `Pool`.)

Each base is loaded once; its targeted Linear layers are wrapped by `MultiLoraLinear` as runs ask
for them, and every resident run's matrices hang off those layers. Runs are kept in least recently
used order; past the budget (bytes of LoRA + AdamW + gradients, or a count) the oldest idle ones
are handed to the eviction (gpu_runtime/recovery.py) to snapshot and free. A base with no resident runs is unloaded
after an idle time.
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from gpu_runtime.batches import Renderer
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.journal import Journal
from gpu_runtime.models import LoadedBase, ModelRegistry
from gpu_runtime.multilora import MultiLoraLinear, Routing, init_lora, linear_module_names, wrap_targets
from gpu_runtime.optimizer import new_adamw
from gpu_runtime.persistence import RunPaths
from gpu_runtime.quantization import base_key
from gpu_runtime.run_state import RunConfig, RunState


@dataclass
class BaseEntry:
    base: LoadedBase
    quantization: str | None
    routing: Routing
    renderer: Renderer
    available: set[str]  # linear layer names LoRA may target, the unembedding (lm_head) included
    params: int
    layers: dict[str, MultiLoraLinear] = field(default_factory=dict)
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def model(self) -> torch.nn.Module:
        return self.base.model


class Residency:
    def __init__(self, models: ModelRegistry, options: RuntimeOptions) -> None:
        self.models = models
        self.options = options
        self.bases: dict[str, BaseEntry] = {}
        self.runs: OrderedDict[str, RunState] = OrderedDict()  # least recently used first
        self.evicted: set[str] = set()  # runs evicted since this runtime started (they reload on their next call)
        # Sampler snapshots (gpu_runtime/snapshots.py), by routing key: they count against the same budget.
        self.snapshots: dict[str, Any] = {}

    def base(self, name: str, quantization: str | None = None) -> BaseEntry:
        key = base_key(name, quantization)
        if key not in self.bases:
            base = self.models.get(name, quantization)
            base.model.requires_grad_(False)  # only LoRA matrices train
            base.model.eval()  # no base dropout; LoRA dropout is drawn by the multi-LoRA layer itself
            vocab = cast(torch.nn.Embedding, base.model.get_input_embeddings()).num_embeddings  # typed as a plain Module
            self.bases[key] = BaseEntry(
                base=base, quantization=quantization, routing=Routing(), renderer=Renderer(base.tokenizer, vocab, base.max_length),
                available=linear_module_names(base.model, unembedding=True), params=base.params,
            )
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
        state.attach(entry.layers)
        self.runs[state.run_id] = state
        self.evicted.discard(state.run_id)
        return state

    def detach(self, run_id: str, evicted: bool = False) -> None:
        state = self.runs.pop(run_id, None)
        if state is None:
            return
        entry = self.bases.get(state.base_key)
        if entry is not None:
            state.detach(entry.layers)
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

    def over_budget(self, keep: Callable[[str], bool]) -> list[RunState]:
        """Least recently used runs to evict (never those `keep` names) until the budget holds."""
        victims: list[RunState] = []
        total, count = self.resident_bytes(), len(self.runs)
        for state in list(self.runs.values()):
            if total <= self.options.resident_bytes and count <= self.options.resident_runs:
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
