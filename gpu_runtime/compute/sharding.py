"""Sharding a base across ranks with FSDP, and the few collectives a training pass adds.

- **Loading.** A base is built on the meta device, every Linear LoRA may target is wrapped by
  `MultiLoraLinear` once, each decoder layer and then the whole model go through FSDP2's
  `fully_shard` (frozen: only all-gathers, never a reduce-scatter), and each rank reads only its
  rows of each weight from the safetensors files. Runs' A/B matrices live in the layers' plain
  `adapters` dicts, which FSDP never sees, so runs come and go without re-sharding anything.
- **A pass.** Rank 0 splits the pass's rows into contiguous chunks of about equal tokens
  (`split_rows`); each rank computes its chunk (or one row of weight 0), the parts' loss sums and
  normalisers are all-reduced, and each run's gradients of this pass are all-reduced with SUM
  (not AVG: gloo's is unreliable, pytorch#162338) before they join the run's accumulated ones.
- **Decoding.** Rank 0's decode engine calls the decoder and the head apart; each decoder forward outside a pass
  has every follower run one on a pad row (`RankGroup.mirror_forwards`), the root's parameters gathered first on
  every rank (`gather_root`), so the layers' gathers match; a sharded base's decode steps are never graph-captured.
- **Residency.** `ShardedResidency` is the engine's residency with every change that ranks must mirror
  (a base loaded or unloaded, a run attached or detached) sent to them first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gpu_runtime.client.model_files import CACHE_MARKER, builtin_gguf_path
from gpu_runtime.compute.models import LoadedBase, ModelRegistry, sha256_files
from gpu_runtime.compute.plan import PassPart, RunWeights
from gpu_runtime.errors import BadInput, ModelUnavailable


@dataclass(frozen=True)
class ModelFiles:
    """Where a base's weights are, resolved once by rank 0 and sent to the others."""

    directory: str
    source: str
    revision: str


@dataclass
class PassPlan:
    """What rank 0 broadcasts for one pass: the parts, and each rank's rows [start, end) with their tokens."""

    key: str
    parts: list[PassPart]
    chunks: list[tuple[int, int]]
    tokens: list[int]


def split_rows(parts: Sequence[PassPart], world: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Contiguous row chunks, one per rank, as close to equal in tokens as whole rows allow."""
    lengths = [e.cost for part in parts for e in part.examples]
    prefix = [0]
    for length in lengths:
        prefix.append(prefix[-1] + length)
    cuts = [0]
    for r in range(1, world):
        target = prefix[-1] * r / world
        best = min(range(cuts[-1], len(lengths) + 1), key=lambda c: (abs(prefix[c] - target), -c))
        cuts.append(best)
    cuts.append(len(lengths))
    chunks = [(cuts[r], cuts[r + 1]) for r in range(world)]
    return chunks, [prefix[end] - prefix[start] for start, end in chunks]


class RankShard:
    """One rank's side of one pass: which rows are its own, and the pass's all-reduces."""

    def __init__(self, rank: int, world: int, chunk: tuple[int, int]) -> None:
        self.rank, self.world, self.chunk = rank, world, chunk
        self.tokens = 0  # of this rank's rows
        self.processed: list[tuple[int, int, int]] = []  # every rank's (first row, end row, tokens), after the pass

    def rows_of_this_rank(self, parts: list[PassPart]) -> list[PassPart]:
        """Each part cut to the rows in this rank's chunk (possibly none), its row offset moved to match."""
        start, end = self.chunk
        mine, index = [], 0
        for part in parts:
            lo, hi = max(start, index), min(end, index + len(part.examples))
            taken = part.examples[lo - index:hi - index] if hi > lo else []
            mine.append(replace(part, examples=taken, row_offset=part.row_offset + max(lo - index, 0)))
            index += len(part.examples)
        self.tokens = sum(e.cost for part in mine for e in part.examples)
        return mine

    def all_reduce_sums(self, sums: list[tuple[torch.Tensor | None, float]]) -> list[tuple[float, float]]:
        """Each part's (loss sum, normaliser) summed over the ranks; every rank's rows and tokens ride along."""
        values = torch.zeros(2 * len(sums) + 3 * self.world, dtype=torch.float64)
        for i, (loss_sum, normaliser) in enumerate(sums):
            values[2 * i] = float(loss_sum.detach().item()) if loss_sum is not None else 0.0
            values[2 * i + 1] = normaliser
        start, end = self.chunk
        values[2 * len(sums) + 3 * self.rank:2 * len(sums) + 3 * self.rank + 3] = torch.tensor(
            [start, end, self.tokens], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        tail = values[2 * len(sums):].view(self.world, 3).long().tolist()
        self.processed = [(a, b, c) for a, b, c in tail]
        return [(float(values[2 * i]), float(values[2 * i + 1])) for i in range(len(sums))]

    def gather_outputs(self, outputs: list[list[dict[str, list[float]]] | None]) -> list[list[dict[str, list[float]]] | None]:
        """Each part's per-datum outputs from every rank, in row order (rank r holds a contiguous chunk of rows)."""
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, outputs)
        merged: list[list[dict[str, list[float]]] | None] = []
        for i, mine in enumerate(outputs):
            merged.append(None if mine is None else [datum for rank in gathered for datum in rank[i]])
        return merged

    def stash_grads(self, runs: Mapping[str, RunWeights], parts: list[PassPart]) -> list[tuple[list[nn.Parameter], list[Any]]]:
        """Set aside each run's accumulated gradients: only this pass's are summed over the ranks."""
        stash = []
        for run_id in sorted({part.run_id for part in parts if part.run_id is not None and not part.forward_only}):
            params = runs[run_id].parameters()
            stash.append((params, [p.grad for p in params]))
            for param in params:
                param.grad = None
        return stash

    def reduce_grads(self, stash: list[tuple[list[nn.Parameter], list[Any]]]) -> None:
        """SUM this pass's gradients over the ranks (one flat all-reduce), then add back what each run had."""
        params = [p for group, _ in stash for p in group]
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for group, saved in stash:
            for param, before in zip(group, saved):
                grad = flat[offset:offset + param.numel()].view(param.shape)
                offset += param.numel()
                # its own memory, in the parameter's layout (a slot's B is a transposed view): fused AdamW reads raw memory
                param.grad = torch.empty_like(param).copy_(grad if before is None else before + grad)


# ---- loading a base, sharded ------------------------------------------------------------------------


class ShardedRegistry(ModelRegistry):
    """The model registry of a rank: bases built on the meta device, sharded, each rank reading only its rows."""

    def __init__(self, data_dir: str | Path, device: torch.device, dtype: torch.dtype, rank: int, world: int,
                 allow_downloads: bool = False) -> None:
        super().__init__(data_dir, device, dtype, allow_downloads=allow_downloads)
        self.rank, self.world = rank, world
        self.files: dict[str, ModelFiles] = {}  # set before `get`: rank 0 resolves, the others are told

    def get(self, name: str, quantization: str | None = None) -> LoadedBase:
        if quantization:
            raise BadInput("quantization runs on one GPU; a multi-GPU pool shards a bf16 base instead",
                           field="quantization")
        if name not in self.loaded:
            files = self.files.get(name) or self.resolve(name)
            self.loaded[name] = load_sharded(name, files, self.device, self.dtype, self.rank, self.world)
            self.load_count[name] = self.load_count.get(name, 0) + 1
        return self.loaded[name]

    def resolve(self, name: str) -> ModelFiles:
        """The directory of the base's safetensors, as ModelRegistry would find the model (a GGUF is cached first)."""
        if not isinstance(name, str) or not name.strip():
            raise ModelUnavailable("base model name must be a non-empty string", field="base_model")
        local = Path(name).expanduser()
        if local.is_dir() and ((local / "config.json").exists() or len(list(local.glob("*.gguf"))) != 1):
            weights = [p for p in local.iterdir() if p.suffix in {".safetensors", ".bin"} or p.name == "config.json"]
            return ModelFiles(str(local), "local", sha256_files(weights))
        gguf = local if local.is_file() and local.suffix == ".gguf" else None
        if gguf is None and local.is_dir():
            gguf = next(iter(sorted(local.glob("*.gguf"))))
        gguf = gguf or builtin_gguf_path(name)
        cache = self._cache_path(name)
        source = "cache"
        if gguf is not None and not (cache / CACHE_MARKER).exists():
            self._cached_or_gguf(name, gguf)  # de-quantized once into the safetensors cache, which every rank reads
            source = "gguf"
        if (cache / CACHE_MARKER).exists():
            return ModelFiles(str(cache), source, json.loads((cache / CACHE_MARKER).read_text())["revision"])
        return self._from_hub_files(name)

    def _from_hub_files(self, name: str) -> ModelFiles:
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(name, local_files_only=not self.allow_downloads,
                                     allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except Exception as exc:  # noqa: BLE001 - any hub failure means the model is unusable here
            raise ModelUnavailable(f"base model {name!r} is not available to this pool: {type(exc).__name__}: {exc}"
                                   + ("" if self.allow_downloads else " (downloads are off)"), field="base_model") from None
        return ModelFiles(path, "hub", Path(path).name)


def load_sharded(name: str, files: ModelFiles, device: torch.device, dtype: torch.dtype, rank: int,
                 world: int) -> LoadedBase:
    """The base on the meta device, every LoRA-able Linear wrapped, sharded by FSDP2, then this rank's rows read."""
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory = Path(files.directory)
    try:
        config = AutoConfig.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as exc:  # noqa: BLE001
        raise ModelUnavailable(f"could not read base model {name!r} from {directory}: {type(exc).__name__}: {exc}",
                               field="base_model") from None
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed, not read: keep them real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    if (directory / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model.requires_grad_(False)  # only LoRA matrices train: FSDP gathers the base, never reduces its gradients
    model.eval()
    mesh = init_device_mesh(device.type, (world,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    cast(nn.Module, model).to_empty(device=device)
    with torch.no_grad():
        for buffer_name, buffer in model.named_buffers():
            buffer.copy_(buffers[buffer_name])
        _read_rows(model, directory, rank, world)
    return LoadedBase(name, model, tokenizer, files.revision, source=files.source, path=str(directory))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks FSDP shards one by one (model.model.layers in Llama, Qwen, Mistral, Gemma…)."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ModelUnavailable(f"cannot find the {count} decoder layers of {type(model).__name__} to shard",
                           field="base_model")


def _read_rows(model: nn.Module, directory: Path, rank: int, world: int) -> None:
    """Copy this rank's rows of every weight (FSDP2 shards dim 0 in chunks of ceil(n / world)) from safetensors."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        where: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").exists():
        where = {}
    else:
        raise ModelUnavailable(f"{directory} has no safetensors weights; a multi-GPU pool reads safetensors only",
                               field="base_model")
    handles: dict[str, Any] = {}
    try:
        for name, param in model.named_parameters():
            file = where.get(name, "model.safetensors")
            if file not in handles:
                handles[file] = safe_open(str(directory / file), framework="pt").__enter__()  # type: ignore[no-untyped-call]  # safetensors types no __enter__
            local = param.to_local() if hasattr(param, "to_local") else param
            rows = math.ceil(param.shape[0] / world)
            start = rank * rows
            if local.shape[0] == 0:
                continue
            try:
                piece = handles[file].get_slice(name)[start:start + local.shape[0]]
            except Exception as exc:  # noqa: BLE001
                raise ModelUnavailable(f"{directory}: weight {name} not readable: {exc}", field="base_model") from None
            local.copy_(piece.to(local.dtype))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of the base's parameters this rank holds (its shards)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def gather_root(model: nn.Module) -> None:
    """The root's own parameters (embeddings, final norm, head) gathered, as the root's forward gathers them, for a
    forward of the decoder alone (a decode step). They stay gathered, as after any forward without a backward, on
    every rank alike (each does this at the same op), until a backward reshards them."""
    from torch.distributed.fsdp import FSDPModule

    root = cast(FSDPModule, model)
    # FSDP2 names as its root the first module a forward runs through: the decoder's first layer would be named
    # (and the root's next forward refused) unless the root is initialised first. Idempotent.
    root._get_fsdp_state()._lazy_init()
    root.unshard()


def require_grad(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    # The embeddings' output takes part in autograd, so backward reaches every layer on every rank (FSDP's gathers
    # in backward must match), even where a rank's rows only touch LoRA matrices in the last layers.
    return output.requires_grad_() if torch.is_grad_enabled() else output
