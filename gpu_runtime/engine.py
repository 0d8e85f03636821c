"""The training engine: LoRA runs on shared base models, driven by four primitives.

Every argument and result is plain JSON-able data, so the same calls cross the worker's pipe
and a Modal `.remote()` unchanged. Not thread-safe: the worker calls it one request at a time.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import peft
import torch
import transformers

from gpu_runtime.adapters import AdapterHost
from gpu_runtime.batches import Renderer, collate
from gpu_runtime.contract import SAVE_MODES
from gpu_runtime.devices import dtype_name, resolve_device
from gpu_runtime.errors import BadInput, FailedPrecondition, RunNotFound
from gpu_runtime.lora import lora_config, lora_settings
from gpu_runtime.losses import get_loss, target_logprobs
from gpu_runtime.models import ModelRegistry, describe
from gpu_runtime.optimizer import adam_settings, apply_settings, new_optimizer
from gpu_runtime.persistence import (
    RunPaths,
    atomic_dir,
    atomic_file,
    check_id,
    dir_size,
    find_run_dir,
    read_json,
    sha256_json,
    write_json,
)
from gpu_runtime.sampling import generate, sampling_settings

PUBLIC_METHODS = (
    "create_run",
    "forward_backward",
    "optim_step",
    "sample",
    "save_state",
    "load_run",
    "close_run",
    "delete_run",
    "run_info",
    "ping",
    "runtime_state",
)
OPTIMIZER_FILE = "optimizer_state.pt"


@dataclass
class Run:
    run_id: str
    user_id: str
    config: dict[str, Any]  # what config.json holds
    paths: RunPaths
    host: AdapterHost
    renderer: Renderer
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    step: int = 0
    # Gradients summed since the last optim_step, and what they must be divided by.
    pending_normaliser: float = 0.0
    pending_calls: int = 0
    pending_tokens: int = 0
    pending_batches: list[dict[str, Any]] = field(default_factory=list)

    def clear_pending(self) -> None:
        self.pending_normaliser, self.pending_calls, self.pending_tokens = 0.0, 0, 0
        self.pending_batches = []

    def optimizer_payload(self) -> dict[str, Any]:
        return {"step": self.step, "param_names": list(self.params), "optimizer": self.optimizer.state_dict()}


class Engine:
    def __init__(
        self,
        data_dir: str | Path,
        device: str = "auto",
        max_batch_size: int = 64,
        keep_steps: int = 3,
        allow_downloads: bool = False,
    ) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise BadInput("max_batch_size must be a positive integer", field="max_batch_size")
        if not isinstance(keep_steps, int) or keep_steps < 1:
            raise BadInput("keep_steps must be a positive integer", field="keep_steps")
        self.data_dir = Path(data_dir).resolve()
        self.device, self.dtype = resolve_device(device)
        self.max_batch_size = max_batch_size
        self.keep_steps = keep_steps
        self.models = ModelRegistry(self.data_dir, self.device, self.dtype, allow_downloads=allow_downloads)
        self.hosts: dict[str, AdapterHost] = {}
        self.renderers: dict[str, Renderer] = {}
        self.base_params: dict[str, int] = {}
        self.runs: dict[str, Run] = {}

    # ---- runs -------------------------------------------------------------------------

    def create_run(self, run_id: str, user_id: str, base_model: str, lora: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
        check_id(run_id, "run_id")
        check_id(user_id, "user_id")
        if run_id in self.runs or find_run_dir(self.data_dir, run_id) is not None:
            raise BadInput(f"run {run_id!r} already exists", field="run_id")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise BadInput(f"seed must be a non-negative integer, got {seed!r}", field="seed")
        host = self._host(base_model)
        settings = lora_settings(lora, host.available_modules)
        config = {
            "run_id": run_id,
            "user_id": user_id,
            "base_model": base_model,
            "base_revision": host.base.revision,
            "lora": settings,
            "seed": seed,
            "created_at": time.time(),
        }
        run = self._attach(config)
        try:
            write_json(run.paths.config, config)
            write_json(run.paths.manifest, self._new_manifest(run))
            self._persist_step(run)
        except BaseException:
            self._detach(run_id)
            shutil.rmtree(run.paths.root, ignore_errors=True)
            raise
        return self._info(run)

    def load_run(self, run_id: str) -> dict[str, Any]:
        return self._info(self._run(run_id))

    def run_info(self, run_id: str) -> dict[str, Any]:
        return self._info(self._run(run_id))

    def close_run(self, run_id: str) -> dict[str, Any]:
        check_id(run_id, "run_id")
        if run_id not in self.runs and find_run_dir(self.data_dir, run_id) is None:
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        self._detach(run_id)
        return {"run_id": run_id, "closed": True}

    def delete_run(self, run_id: str) -> dict[str, Any]:
        self.close_run(run_id)
        root = find_run_dir(self.data_dir, run_id)
        if root is not None:
            shutil.rmtree(root)
        return {"run_id": run_id, "deleted": True}

    def ping(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "loaded_models": list(self.models.loaded),
            "models": [describe(base) for base in self.models.loaded.values()],
            "runs_in_memory": list(self.runs),
            "max_batch_size": self.max_batch_size,
            "keep_steps": self.keep_steps,
        }

    def runtime_state(self) -> dict[str, Any]:
        return {"bases": list(self.models.loaded), "resident_runs": list(self.runs), "evicted_runs": [],
                "queue_depth": {}, "ticks": {}}

    # ---- the training primitives ---------------------------------------------------------

    def forward_backward(
        self, run_id: str, batch: list[dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        run = self._run(run_id)
        loss, config = get_loss(loss_fn, loss_fn_config)
        examples = run.renderer.render_batch(batch, self.max_batch_size, loss_fn)
        data = collate(examples, self.device)
        model = self._activate(run, train=True)
        # Dropout draws from a stream fixed by (seed, step, call): replays match across restarts.
        with _seeded(_derive_seed(run.config["seed"], run.step, run.pending_calls), self.device):
            logits = model(input_ids=data.input_ids, attention_mask=data.attention_mask).logits
        loss_sum, normaliser = loss(target_logprobs(logits, data.targets), data, config)
        if not torch.isfinite(loss_sum):
            # Before backward: a NaN/inf would poison every gradient accumulated so far.
            raise BadInput(f"the batch's loss is {loss_sum.item()}; check its weights and tokens", field="batch")
        loss_sum.backward()  # a sum, accumulated in .grad; optim_step divides by the total normaliser
        num_tokens = sum(e.num_targets for e in examples)
        run.pending_normaliser += normaliser
        run.pending_calls += 1
        run.pending_tokens += num_tokens
        run.pending_batches.append(
            {"sha256": sha256_json({"loss_fn": loss_fn, "batch": batch}), "num_examples": len(examples), "num_tokens": num_tokens}
        )
        return {"loss": loss_sum.item() / normaliser, "num_tokens": num_tokens, "num_examples": len(examples), "step": run.step}

    def optim_step(self, run_id: str, adam: dict[str, Any] | None = None, request_id: str | None = None) -> dict[str, Any]:
        run = self._run(run_id)
        settings = adam_settings(adam)
        if run.pending_calls == 0:
            raise FailedPrecondition("no gradients to apply: call forward_backward before optim_step")
        params = list(run.params.values())
        for param in params:
            if param.grad is not None:
                param.grad.div_(run.pending_normaliser)  # summed token losses → their mean over all calls
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, settings["grad_clip_norm"] or math.inf))
        if not math.isfinite(grad_norm):
            run.optimizer.zero_grad(set_to_none=True)
            run.clear_pending()
            raise FailedPrecondition(f"gradient norm is {grad_norm}; the step was skipped and the gradients dropped")
        apply_settings(run.optimizer, settings)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.step += 1
        self._persist_step(run, settings, grad_norm)
        run.clear_pending()
        return {"step": run.step, "grad_norm": grad_norm, "learning_rate": settings["learning_rate"]}

    def sample(
        self,
        run_id: str,
        prompts: list[str],
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: str | list[str] | None = None,
        num_samples: int = 1,
        seed: int | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        run = self._run(run_id)
        prompts, settings = sampling_settings(prompts, max_tokens, temperature, top_p, top_k, stop, num_samples, seed)
        tokenizer = run.host.base.tokenizer
        limit = run.renderer.max_length
        prompt_ids = [list(tokenizer(p, add_special_tokens=True)["input_ids"]) for p in prompts]
        for i, ids in enumerate(prompt_ids):
            if not ids or len(ids) >= limit:
                raise BadInput(f"prompts[{i}] is {len(ids)} tokens; the model's context is {limit}", field=f"prompts[{i}]")
            if len(ids) + settings.max_tokens > limit:
                raise BadInput(
                    f"prompts[{i}] ({len(ids)} tokens) + max_tokens ({settings.max_tokens}) exceeds the context ({limit})",
                    field="max_tokens",
                )
        model = self._activate(run, train=False)
        generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        rows = [ids for ids in prompt_ids for _ in range(settings.num_samples)]
        results: list[dict[str, Any]] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            results += generate(model, tokenizer, chunk, settings, _eos_ids(run), generator)
        n = settings.num_samples
        sequences = [results[i * n : (i + 1) * n] for i in range(len(prompts))]
        return {"outputs": [s[0]["text"] for s in sequences], "sequences": sequences, "prompt_tokens": prompt_ids, "step": run.step}

    def save_state(self, run_id: str, mode: str = "adapter", request_id: str | None = None) -> dict[str, Any]:
        run = self._run(run_id)
        if mode not in SAVE_MODES:
            raise BadInput(f"mode must be one of {list(SAVE_MODES)}, got {mode!r}", field="mode")
        path = run.paths.checkpoint(mode, run.step)
        with atomic_dir(path) as tmp:
            if mode in ("adapter", "state"):
                run.host.save_adapter(run_id, tmp)
            if mode == "state":
                torch.save(run.optimizer_payload(), tmp / OPTIMIZER_FILE)
                write_json(tmp / "config.json", run.config)
            if mode == "merged":
                run.host.merged_model(run_id).save_pretrained(tmp)
                run.host.base.tokenizer.save_pretrained(tmp)
        return {"checkpoint_path": str(path.resolve()), "mode": mode, "step": run.step, "size_bytes": dir_size(path)}

    # ---- internals ----------------------------------------------------------------------

    def _host(self, base_model: str) -> AdapterHost:
        if base_model not in self.hosts:
            base = self.models.get(base_model)
            self.base_params[base_model] = sum(p.numel() for p in base.model.parameters())
            vocab = base.model.get_input_embeddings().num_embeddings
            self.renderers[base_model] = Renderer(base.tokenizer, vocab, base.max_length)
            self.hosts[base_model] = AdapterHost(base)
        return self.hosts[base_model]

    def _attach(self, config: dict[str, Any]) -> Run:
        """Put a run's adapter and optimizer in memory, freshly initialised from its seed."""
        base_model = config["base_model"]
        host = self._host(base_model)
        host.add(config["run_id"], lora_config(config["lora"]), config["seed"])
        params = host.parameters(config["run_id"])
        run = Run(
            run_id=config["run_id"],
            user_id=config["user_id"],
            config=config,
            paths=RunPaths(self.data_dir, config["user_id"], config["run_id"]),
            host=host,
            renderer=self.renderers[base_model],
            params=params,
            optimizer=new_optimizer(list(params.values())),
        )
        self.runs[run.run_id] = run
        return run

    def _run(self, run_id: str) -> Run:
        check_id(run_id, "run_id")
        if run_id in self.runs:
            return self.runs[run_id]
        root = find_run_dir(self.data_dir, run_id)
        if root is None:
            raise RunNotFound(f"run {run_id!r} not found", field="run_id")
        return self._restore(root)

    def _restore(self, root: Path) -> Run:
        config = read_json(root / "config.json")
        run = self._attach(config)
        try:
            self._load_latest_step(run)
        except BaseException:
            self._detach(run.run_id)  # never leave a half-restored run in memory
            raise
        if run.host.base.revision != config.get("base_revision"):
            print(f"warning: run {run.run_id}: base model revision changed since the run was created", file=sys.stderr)
        return run

    def _load_latest_step(self, run: Run) -> None:
        steps = run.paths.saved_steps()
        if steps:
            step_dir = run.paths.adapter_step(steps[-1])
            run.host.load_adapter(run.run_id, step_dir)
            payload = torch.load(step_dir / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
            if payload["param_names"] != list(run.params):
                raise RuntimeError(f"optimizer state in {step_dir} does not match run {run.run_id}'s adapter")
            run.optimizer.load_state_dict(payload["optimizer"])
            run.step = payload["step"]

    def _detach(self, run_id: str) -> None:
        """Drop a run's adapter, optimizer and gradients from memory."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return
        run.host.remove(run_id)
        run.optimizer.state.clear()
        del run
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _activate(self, run: Run, train: bool) -> torch.nn.Module:
        run.host.activate(run.run_id)
        model = run.host.model
        # The base stays in eval mode; only LoRA dropout follows training.
        model.eval()
        if train:
            for name, module in model.named_modules():
                if name.endswith("lora_dropout"):
                    module.train()
        return model

    def _persist_step(self, run: Run, settings: dict[str, float] | None = None, grad_norm: float | None = None) -> None:
        # The step directory is the unit of commit: adapter and optimizer state appear together.
        with atomic_dir(run.paths.adapter_step(run.step)) as tmp:
            run.host.save_adapter(run.run_id, tmp)
            torch.save(run.optimizer_payload(), tmp / OPTIMIZER_FILE)
        with atomic_file(run.paths.optimizer_state) as tmp_file:
            _link_or_copy(run.paths.adapter_step(run.step) / OPTIMIZER_FILE, tmp_file)
        run.paths.prune_steps(self.keep_steps)
        if settings is not None:
            manifest = read_json(run.paths.manifest)
            manifest["steps"].append(
                {"step": run.step, "adam": settings, "grad_norm": grad_norm, "num_tokens": run.pending_tokens, "batches": run.pending_batches}
            )
            write_json(run.paths.manifest, manifest)

    def _new_manifest(self, run: Run) -> dict[str, Any]:
        base = run.host.base
        return {
            "run_id": run.run_id,
            "user_id": run.user_id,
            "base_model": {"name": base.name, "revision": base.revision, "source": base.source},
            "lora": run.config["lora"],
            "seed": run.config["seed"],
            "optimizer": "torch.optim.AdamW",
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
            "steps": [],
        }

    def _info(self, run: Run) -> dict[str, Any]:
        trainable = sum(p.numel() for p in run.params.values())
        return {
            "run_id": run.run_id,
            "user_id": run.user_id,
            "base_model": run.config["base_model"],
            "base_revision": run.config["base_revision"],
            "lora": run.config["lora"],
            "target_modules": run.config["lora"]["target_modules"],
            "seed": run.config["seed"],
            "step": run.step,
            "trainable_params": trainable,
            "total_params": self.base_params[run.config["base_model"]] + trainable,
            "pending_forward_backward": run.pending_calls,
            "pending_tokens": run.pending_tokens,
            "path": str(run.paths.root),
        }


def _derive_seed(*parts: int) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _eos_ids(run: Run) -> set[int]:
    ids = {run.host.base.tokenizer.eos_token_id}
    configured = getattr(run.host.base.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def _link_or_copy(source: Path, target: Path) -> None:
    # A hard link costs no space; file systems without links (some volumes) get a copy.
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
