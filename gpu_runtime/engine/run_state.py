"""A run as the runtime holds it (`RunState`), and its snapshots on disk.

In memory: the run's A/B matrices (fp32, one pair per targeted layer of its base), its AdamW, the gradients summed
since the last optim_step and what they must be divided by, and its journal.

A snapshot is `lora_adapters/step_N/`: the adapter in PEFT's own format (`PeftModel.from_pretrained` loads it), the
optimizer state, the pending gradients when there are any, and `snapshot.json` naming the journal position it covers.
Restore = the newest snapshot + the journal after it. Snapshots written before the journal existed (format 1: no
snapshot.json, an `optimizer_state.pt` keyed by PEFT's parameter names) still load; their journal position is 0.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import signal
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeVar

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from gpu_runtime.client.persistence import RunPaths, atomic_dir, read_json, write_json
from gpu_runtime.compute.lora.experts import attach_experts, detach_experts, is_expert_path, peft_names, target_parameters
from gpu_runtime.compute.lora.slots import BaseSlots, in_layout_of
from gpu_runtime.compute.lora.wrap import LoraTarget
from gpu_runtime.compute.optimizer import restore_fused, state_to_save
from gpu_runtime.compute.plan import RunConfig as RunConfig  # the contract of config.json lives with the plain data
from gpu_runtime.compute.quantization import base_key
from gpu_runtime.contract.checkpoints import DEFAULT_NAME
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.training_settings import DEFAULT_REDUCTION, LoraSettings
from gpu_runtime.engine.journal import Journal
from gpu_runtime.engine.journal_records import BatchRecord, PendingRecord
from gpu_runtime.errors import BadInput

# Every change of a run's weights in this process takes the next number (RunState.weights_version): the prefix cache
# reuses KV only of the same number, so weights loaded at a step the run had before never read their predecessors' KV.
WEIGHTS_VERSIONS = itertools.count(1)

SNAPSHOT_FORMAT = 2
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
LEGACY_OPTIMIZER_FILE = "optimizer_state.pt"
PENDING_FILE = "pending_grads.safetensors"
SNAPSHOT_FILE = "snapshot.json"
CHECKPOINT_FILE = "checkpoint.json"  # what a checkpoint is and what resuming from it needs (docs/CHECKPOINTS.md)
CHECKPOINT_FORMAT = 1


class CheckpointMeta(TypedDict):
    """checkpoint.json (ControlCalls._checkpoint_meta), or what a checkpoint saved before it had one amounts to."""

    step: int
    seed: int
    lora: LoraSettings
    base_model: str
    quantization: str | None
    with_optimizer: bool
    format: NotRequired[int]  # the rest: absent from a checkpoint saved before checkpoint.json
    run_id: NotRequired[str]
    user_id: NotRequired[str]
    mode: NotRequired[str]
    name: NotRequired[str]
    base_revision: NotRequired[str | None]
    pending_excluded: NotRequired[int]
    created_at: NotRequired[float]
    request_id: NotRequired[str | None]  # the save that wrote it, its body's hash and its answer (for its retry)
    body_sha256: NotRequired[str | None]
    result: NotRequired[JSONObject]
LOADS_DIR = "loads"  # a load_state's files, copied into the run until the snapshot after it is written
REMEMBERED_REQUESTS = 4096  # request ids (and results) kept for answering retries
REMEMBERED_SAMPLES = 64  # sample answers kept in memory only: a sample changes nothing, so none is journaled


def peft_name(path: str, matrix: str) -> str:
    """The key PEFT's adapter files use for a layer's A or B."""
    return f"base_model.model.{path}.lora_{matrix}.weight"


@dataclass
class PendingGrads:
    """Gradients summed in .grad since the last optim_step: what they are divided by, and what they came from."""

    normaliser: float = 0.0  # the sum a "mean" reduction divides by (|weights| or counted positions, every call)
    calls: int = 0  # forward_backward calls summed in
    tokens: int = 0  # their target tokens
    batches: list[BatchRecord] = field(default_factory=list)  # each call's hash and size, for the manifest
    reduction: str | None = None  # the reduction every call since the last step used (None: no call yet)

    def add(self, normaliser: float, tokens: int, batch: BatchRecord, reduction: str = DEFAULT_REDUCTION) -> None:
        self.normaliser += normaliser
        self.calls += 1
        self.tokens += tokens
        self.batches.append(batch)
        self.reduction = reduction

    @property
    def divisor(self) -> float:
        """What optim_step divides the summed gradients by: the normaliser ("mean"), or 1 ("sum"). A mean over no
        counted position divides by 1: those gradients are all zero."""
        if self.reduction == "sum" or not self.normaliser:
            return 1.0
        return self.normaliser

    def to_record(self) -> PendingRecord:
        return PendingRecord(self.normaliser, self.calls, self.tokens, list(self.batches), self.reduction)

    @classmethod
    def from_record(cls, record: PendingRecord) -> PendingGrads:
        return cls(record.normaliser, record.calls, record.tokens, list(record.batches), record.reduction)


T = TypeVar("T", bound=torch.Tensor)  # a run's parameters, or a snapshot's plain tensors


@dataclass
class RunState:
    run_id: str
    user_id: str
    config: RunConfig
    paths: RunPaths
    base_model: str
    weights: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]  # layer path → (A, B)
    optimizer: torch.optim.AdamW
    journal: Journal
    step: int = 0
    seq: int = 0  # journal records applied
    weights_version: int = field(default_factory=lambda: next(WEIGHTS_VERSIONS))  # new at each change (above)
    pending: PendingGrads = field(default_factory=lambda: PendingGrads())
    answered: OrderedDict[str, JSONObject] = field(default_factory=OrderedDict)  # request id → result
    sampled: OrderedDict[str, JSONObject] = field(default_factory=OrderedDict)  # request id → sample result
    # request id → the sha256 of the call it answered (Call.body_sha256), for answered and sampled alike
    bodies: OrderedDict[str, str] = field(default_factory=OrderedDict)
    snapshot_step: int = -1
    snapshot_seq: int = 0
    snapshot_time: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    weight_bytes: int | None = field(default=None, repr=False)  # the weights' bytes, counted once (resident_bytes)

    @property
    def lora(self) -> LoraSettings:
        return self.config["lora"]

    @property
    def quantization(self) -> str | None:
        return self.config.get("quantization")

    @property
    def base_key(self) -> str:
        """The pool entry this run trains on (a quantized base is an entry of its own)."""
        return base_key(self.base_model, self.quantization)

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """PEFT-named parameters in a fixed order (the optimizer's order)."""
        named = {}
        names = peft_names(self.weights)  # expert parameters nest in PEFT's files (compute/lora/experts.py)
        for path in sorted(self.weights):
            A, B = self.weights[path]
            named[names[path][0]] = A
            named[names[path][1]] = B
        return named

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.named_parameters().values())

    def clear_pending(self) -> None:
        self.pending = PendingGrads()

    def remember(self, request_id: str | None, result: JSONObject, body: str | None = None) -> None:
        """Keep a call's answer for its retries, with the hash of its body (None: journaled before bodies were)."""
        if request_id:
            self.answered[request_id] = result
            while len(self.answered) > REMEMBERED_REQUESTS:
                self.answered.popitem(last=False)
            self._remember_body(request_id, body)

    def remember_sample(self, request_id: str | None, result: JSONObject, body: str | None = None) -> None:
        if request_id:
            self.sampled[request_id] = result
            while len(self.sampled) > REMEMBERED_SAMPLES:
                self.sampled.popitem(last=False)
            self._remember_body(request_id, body)

    def _remember_body(self, request_id: str, body: str | None) -> None:
        if body is None:
            return
        self.bodies[request_id] = body
        self.bodies.move_to_end(request_id)
        while len(self.bodies) > REMEMBERED_REQUESTS + REMEMBERED_SAMPLES:
            self.bodies.popitem(last=False)

    def answer_to(self, request_id: str | None, body: str, sampled: bool = False) -> JSONObject | None:
        """The remembered answer to a retry: the same request id with the same body. None for a new id (or one whose
        answer was forgotten); BAD_INPUT naming request_id when the id answered another call (docs/ERRORS.md)."""
        if not request_id:
            return None
        check_same_body(request_id, self.bodies.get(request_id), body)
        return (self.sampled if sampled else self.answered).get(request_id)

    def resident_bytes(self) -> int:
        """Parameters, gradients and optimizer state held for this run. The eviction check counts every resident run
        each tick, so it reads three facts, not every tensor: the weights' bytes (fixed for the run's life), whether
        gradients are held (a pass links all of a run's, a step clears all) and whether AdamW holds its two moments
        (each its parameter's size; the step counts' few bytes are left out)."""
        if self.weight_bytes is None:
            self.weight_bytes = sum(p.nbytes for pair in self.weights.values() for p in pair)
        first = next((pair[0] for pair in self.weights.values()), None)
        grads = self.weight_bytes if first is not None and first.grad is not None else 0
        return self.weight_bytes + grads + (2 * self.weight_bytes if self.optimizer.state else 0)

    @property
    def changed_since_snapshot(self) -> bool:
        return self.seq > self.snapshot_seq

    # ---- attaching to a base ----------------------------------------------------------------

    def attach(self, layers: dict[str, LoraTarget], slots: BaseSlots) -> None:
        """Take a slot of the base: from here on the run's A and B are views of its rows (compute/lora/slots.py);
        expert parameters' matrices hang off their targets (compute/lora/experts.py)."""
        linear, experts = split_expert_weights(self.weights)
        scaling = self.lora["alpha"] / self.lora["r"]
        if linear:
            slots.attach(self.run_id, layers, linear, self.lora["r"], scaling, self.lora["dropout"], trainable=True)
        attach_experts(slots, self.run_id, layers, experts, self.lora["r"], scaling, self.lora["dropout"], trainable=True)

    def detach(self, slots: BaseSlots, layers: dict[str, LoraTarget]) -> None:
        slots.detach(self.run_id)
        detach_experts(slots, self.run_id)

    # ---- adapter files ------------------------------------------------------------------------

    def save_adapter(self, directory: Path, base_name: str) -> None:
        """A directory `PeftModel.from_pretrained(base, directory)` loads."""
        tensors = {name: p.detach().to("cpu").contiguous() for name, p in self.named_parameters().items()}
        save_file(tensors, str(Path(directory) / ADAPTER_WEIGHTS))
        experts = target_parameters(self.weights)
        # PEFT's parameter targets refuse dropout (a weight delta has no input to drop): inference has none anyway.
        linear = sorted({path.rsplit(".", 1)[-1] for path in self.weights if not is_expert_path(path)})
        # peft annotates lora_alpha as int; it scales by alpha / r, a float alpha included
        config = LoraConfig(r=self.lora["r"], lora_alpha=self.lora["alpha"],  # type: ignore[arg-type]
                            lora_dropout=0.0 if experts else self.lora["dropout"],
                            target_modules=(linear or None) if experts else self.lora["target_modules"],
                            target_parameters=experts or None, bias="none", task_type="CAUSAL_LM",
                            base_model_name_or_path=base_name, inference_mode=True)
        config.save_pretrained(str(directory))

    def load_adapter(self, directory: Path) -> None:
        tensors = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
        named = self.named_parameters()
        # PEFT's older files may carry the adapter's name in the key; ours never do.
        tensors = {re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", k) if k not in named else k: v
                   for k, v in tensors.items()}
        if set(tensors) != set(named):
            extra, missing = sorted(set(tensors) - set(named))[:3], sorted(set(named) - set(tensors))[:3]
            raise RuntimeError(f"adapter at {directory} does not fit run {self.run_id}: extra {extra}, missing {missing}")
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(tensors[name])
        self.weights_changed()

    def weights_changed(self) -> None:
        """Its weights are not those of before (an optim_step, a load_state, a restore): KV they computed is not
        reused for the new ones."""
        self.weights_version = next(WEIGHTS_VERSIONS)

    # ---- snapshots ----------------------------------------------------------------------------

    def save_optimizer(self, path: Path) -> None:
        """AdamW's state keyed by parameter name (`_load_optimizer` renumbers it for the loading run)."""
        torch.save({"step": self.step, "param_names": list(self.named_parameters()),
                    "optimizer": state_to_save(self.optimizer)}, path)

    def load_checkpoint_files(self, directory: Path, with_optimizer: bool, step: int, device: torch.device) -> None:
        """A checkpoint's adapter, and its AdamW or a fresh one, into this run at `step`; pending gradients go."""
        self.load_adapter(directory)
        if with_optimizer:
            payload = torch.load(Path(directory) / LEGACY_OPTIMIZER_FILE, map_location=device, weights_only=True)
            self._load_optimizer(payload, Path(directory))
        else:
            self.optimizer.state.clear()  # a fresh AdamW: no moments, its own step count 0 (bias correction anew)
        self.optimizer.zero_grad(set_to_none=True)
        self.clear_pending()
        self.step = step

    def write_snapshot(self, base_name: str, fault: str | None = None) -> Path:
        """Snapshot everything the run holds at journal position `seq` (pending gradients included)."""
        target = self.paths.adapter_step(self.step)
        with atomic_dir(target) as tmp:
            self.save_adapter(tmp, base_name)
            if fault == "during_snapshot":
                os.kill(os.getpid(), signal.SIGKILL)  # failpoint for the crash tests: a half-written snapshot
            if fault == "enospc_snapshot":  # failpoint: the disk fills half-way through a snapshot
                raise OSError(errno.ENOSPC, "No space left on device (failpoint enospc_snapshot)")
            torch.save({"param_names": list(self.named_parameters()), "optimizer": state_to_save(self.optimizer)},
                       tmp / OPTIMIZER_FILE)
            pending = self.pending.calls > 0
            kept = list(self.answered.items())[-256:]
            if pending:
                grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().contiguous()
                         for name, p in self.named_parameters().items()}
                save_file(grads, str(tmp / PENDING_FILE))
            write_json(tmp / SNAPSHOT_FILE, {
                "format": SNAPSHOT_FORMAT, "step": self.step, "seq": self.seq, "pending_included": pending,
                "pending": self.pending.to_record().to_dict(),
                "answered": kept, "bodies": {k: self.bodies[k] for k, _ in kept if k in self.bodies},
                "created_at": time.time(),
            })
        self.snapshot_step, self.snapshot_seq, self.snapshot_time = self.step, self.seq, time.monotonic()
        return target

    def load_latest_snapshot(self, device: torch.device) -> None:
        """Load the newest whole snapshot, if any; a fresh run (none yet) keeps its seeded initial weights."""
        for directory in self.snapshots_newest_first():
            if (directory / SNAPSHOT_FILE).exists():
                self._load_snapshot(directory, device)
                return
            if (directory / LEGACY_OPTIMIZER_FILE).exists():
                self._load_legacy(directory, device)
                return

    def _load_snapshot(self, directory: Path, device: torch.device) -> None:
        meta = read_json(directory / SNAPSHOT_FILE)
        self.load_adapter(directory)
        payload = torch.load(directory / OPTIMIZER_FILE, map_location=device, weights_only=True)
        self._load_optimizer(payload, directory)
        if meta["pending_included"]:
            grads = load_file(str(directory / PENDING_FILE), device=str(device))
            for name, param in self.named_parameters().items():
                param.grad = in_layout_of(param, grads[name]).clone()  # in the parameter's layout: fused AdamW reads raw memory
        self.pending = PendingGrads.from_record(PendingRecord.from_dict(meta["pending"]))
        self.answered = OrderedDict((k, v) for k, v in meta.get("answered", []))
        bodies = meta.get("bodies", {})  # snapshots written before bodies hold none: those ids take any body
        self.bodies = OrderedDict((k, bodies[k]) for k in self.answered if k in bodies)
        self.step, self.seq = meta["step"], meta["seq"]
        self.snapshot_step, self.snapshot_seq = self.step, self.seq

    def _load_legacy(self, directory: Path, device: torch.device) -> None:
        self.load_adapter(directory)
        payload = torch.load(directory / LEGACY_OPTIMIZER_FILE, map_location=device, weights_only=True)
        # Format 1 named parameters as PEFT does in memory, with the adapter's name inside.
        payload["param_names"] = [re.sub(r"\.lora_([AB])\.[^.]+\.weight$", r".lora_\1.weight", n)
                                  for n in payload["param_names"]]
        self._load_optimizer(payload, directory)
        self.step, self.seq = payload["step"], 0
        self.snapshot_step, self.snapshot_seq = self.step, 0

    def _load_optimizer(self, payload: dict[str, Any], directory: Path) -> None:
        names = list(self.named_parameters())
        if sorted(payload["param_names"]) != sorted(names):
            raise RuntimeError(f"optimizer state in {directory} does not match run {self.run_id}'s adapter")
        state = payload["optimizer"]
        if payload["param_names"] != names:  # same parameters, another order: renumber the state
            index = {name: i for i, name in enumerate(payload["param_names"])}
            state["state"] = {names.index(n): state["state"][index[n]] for n in names if index[n] in state["state"]}
        self.optimizer.load_state_dict(state)
        restore_fused(self.optimizer)  # load_state_dict puts back the saved groups' `fused`
        for param, moments in self.optimizer.state.items():  # saved from contiguous B's (before slots): B's layout now
            for name, value in moments.items():
                if torch.is_tensor(value) and value.shape == param.shape:
                    moments[name] = in_layout_of(param, value)

    def snapshot_positions(self) -> list[tuple[int, int]]:
        """(journal position, step) of each snapshot, newest (highest position) first. Not by step: load_state can
        move a run's step back, and the snapshot after it is then the newest at a lower step."""
        def position(step: int) -> tuple[int, int]:
            meta = self.paths.adapter_step(step) / SNAPSHOT_FILE
            try:
                return int(read_json(meta)["seq"]), step
            except (OSError, ValueError, KeyError, TypeError):
                return -1, step  # format 1 (no snapshot.json) or torn: before every journaled one, by step
        return sorted((position(step) for step in self.paths.saved_steps()), reverse=True)

    def snapshots_newest_first(self) -> list[Path]:
        return [self.paths.adapter_step(step) for _, step in self.snapshot_positions()]

    def prune_snapshots(self, keep: int, removed: Callable[[Path], None] | None = None) -> None:
        """Keep the newest `keep` snapshots (all when 0), then drop the journal's segments before the oldest kept one:
        restore needs records only after a snapshot it can load. `removed`: a failpoint's hook (Journal.compact)."""
        for directory in self.snapshots_newest_first()[keep:] if keep > 0 else []:
            shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(self.paths.root / LOADS_DIR, ignore_errors=True)  # a snapshot now covers every load_state
        kept = self.snapshot_positions()
        # A format-1 or unreadable snapshot (-1) replays from record 0; no snapshot at all: the journal is the run.
        self.journal.compact(max(min(seq for seq, _ in kept), 0) if kept else 0, removed)

    def drop_snapshots_after(self, seq: int) -> None:
        """Remove snapshots that cover journal records past `seq` (records a failed write cut off): restoring one
        would bring back calls that were answered as failed."""
        for step in self.paths.saved_steps():
            meta = self.paths.adapter_step(step) / SNAPSHOT_FILE
            if meta.exists() and read_json(meta)["seq"] > seq:
                shutil.rmtree(self.paths.adapter_step(step), ignore_errors=True)


def check_same_body(request_id: str, remembered: str | None, body: str) -> None:
    """A request id names one call: sent again with another body it is refused, never answered with the first call's
    result (a client reusing ids by mistake would otherwise read another call's answer as its own)."""
    if remembered is not None and remembered != body:
        raise BadInput(f"request id {request_id!r} was already used on this run for a different call; a retry must "
                       "send the same call, and a new call needs a new request id", field="request_id")


def checkpoint_dir(paths: RunPaths, mode: str, name: str) -> Path:
    """Where a checkpoint lives: step-N (a save without a name) where checkpoints always were, {mode}_step_N; any
    other name under its kind, checkpoints/{mode}/{name}, so the two never meet."""
    match = DEFAULT_NAME.match(name)
    if match:
        return paths.checkpoint(mode, int(match.group(1)))
    return paths.root / "checkpoints" / mode / name




def split_expert_weights(weights: Mapping[str, tuple[T, T]]) -> tuple[dict[str, tuple[T, T]], dict[str, tuple[T, T]]]:
    """A run's matrices on Linear layers (the base's slots hold them) and on expert parameters (their targets do)."""
    linear = {path: pair for path, pair in weights.items() if not is_expert_path(path)}
    return linear, {path: pair for path, pair in weights.items() if is_expert_path(path)}
