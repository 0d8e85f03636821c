"""The multi-LoRA layer: one frozen base Linear, many runs' A/B matrices, each batch row routed to its run's.

PEFT's mixed-batch `adapter_names` is inference-only, so this is our own (prior art: SkyRL's
`tx/layers/lora.py`, prime-rl's `multi_linear.py`, vLLM's torch reference ops). A forward pass
carries a `Routing`: contiguous row segments, each naming a run. Every row gets its own run's
`B(A(dropout(x))) * scaling` added to the shared base output, so gradients reach only that run's
matrices and each run's loss stays its own, as if it had trained alone.

Dropout masks come from a generator seeded by (run seed, step, call, module) and are drawn at the
shape of the run's whole call, then sliced to the rows in this pass, so co-batching, splitting a
call across passes, replay and recompute all draw the same mask.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Segment:
    """Rows [start, end) of this pass belong to run `key`."""

    key: str
    start: int
    end: int
    dropout_seed: int | None = None  # None: no dropout (sampling, or a run without it)
    call_rows: int = 0  # the whole call's rows and width, for drawing masks at the call's own shape
    call_width: int = 0
    row_offset: int = 0  # where this pass's rows start within the call


@dataclass
class Routing:
    segments: list[Segment] = field(default_factory=list)
    grouped: bool | None = None  # None: the grouped (bmm) path on CUDA only


@dataclass
class LoraWeights:
    A: torch.nn.Parameter  # [r, in]
    B: torch.nn.Parameter  # [out, r]
    scaling: float
    dropout: float


class MultiLoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, name: str, routing: Routing) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.name = name
        self.routing = routing
        self.name_seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
        # Plain dict, not a ModuleDict: the runs' matrices are owned by their RunState, not the base model.
        self.adapters: dict[str, LoraWeights] = {}

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        segments = [s for s in self.routing.segments if s.key in self.adapters]
        if not segments:
            return out
        if len(self.routing.segments) == 1:  # the whole pass is one run: no slicing
            return self._add(out, x, segments[0])
        grouped = self.routing.grouped if self.routing.grouped is not None else x.is_cuda
        if grouped and len(segments) == len(self.routing.segments) and self._groupable(segments):
            return self._grouped(out, x, segments)
        pieces = []
        for segment in self.routing.segments:
            piece = out[segment.start : segment.end]
            if segment.key in self.adapters:
                piece = self._add(piece, x[segment.start : segment.end], segment)
            pieces.append(piece)
        return torch.cat(pieces)

    def _add(self, out: torch.Tensor, x: torch.Tensor, segment: Segment) -> torch.Tensor:
        lora = self.adapters[segment.key]
        x = x.to(lora.A.dtype)  # fp32 adapters on a bf16 base, as PEFT does
        if lora.dropout > 0 and segment.dropout_seed is not None:
            x = x * self._dropout_mask(x, segment, lora.dropout)
        delta = F.linear(F.linear(x, lora.A), lora.B) * lora.scaling
        return (out + delta).to(out.dtype)

    def _dropout_mask(self, x: torch.Tensor, segment: Segment, p: float) -> torch.Tensor:
        assert segment.dropout_seed is not None
        generator = torch.Generator(device=x.device).manual_seed((segment.dropout_seed ^ self.name_seed) & (2**63 - 1))
        rows = max(segment.call_rows, segment.row_offset + x.shape[0])
        width = max(segment.call_width, 1) if x.dim() == 3 else 1
        shape = (rows, width, x.shape[-1]) if x.dim() == 3 else (rows, x.shape[-1])
        keep = torch.rand(shape, generator=generator, device=x.device, dtype=torch.float32) >= p
        mask = keep[segment.row_offset : segment.row_offset + x.shape[0]].to(x.dtype) / (1 - p)
        if x.dim() == 3:  # this pass may be wider (padding, whose values never reach a real token) or narrower
            t = x.shape[1]
            mask = mask[:, :t] if mask.shape[1] >= t else F.pad(mask, (0, 0, 0, t - mask.shape[1]), value=1.0)
        return mask

    def _groupable(self, segments: list[Segment]) -> bool:
        ranks = {self.adapters[s.key].A.shape[0] for s in segments}
        return len(ranks) == 1 and all(self.adapters[s.key].dropout == 0 or s.dropout_seed is None for s in segments)

    def _grouped(self, out: torch.Tensor, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Every run's rows in two batched matmuls: A and B gathered per row (same rank only)."""
        loras = [self.adapters[s.key] for s in segments]
        counts = torch.tensor([s.end - s.start for s in segments], device=x.device)
        A = torch.stack([lora.A for lora in loras]).repeat_interleave(counts, dim=0)  # [N, r, in]
        B = torch.stack([lora.B for lora in loras]).repeat_interleave(counts, dim=0)  # [N, out, r]
        scaling = torch.tensor([lora.scaling for lora in loras], device=x.device, dtype=A.dtype)
        scaling = scaling.repeat_interleave(counts).view(-1, *([1] * (x.dim() - 1)))
        xs = x.to(A.dtype)
        flat = xs if x.dim() == 3 else xs.unsqueeze(1)
        delta = torch.bmm(torch.bmm(flat, A.transpose(1, 2)), B.transpose(1, 2))
        delta = delta if x.dim() == 3 else delta.squeeze(1)
        return (out + delta * scaling).to(out.dtype)


def linear_module_names(model: nn.Module) -> set[str]:
    """Leaf names of the layers LoRA can wrap (q_proj, up_proj, …); lm_head is left alone."""
    names = set()
    for path, module in model.named_modules():
        if isinstance(module, (nn.Linear, MultiLoraLinear)) and not path.endswith("lm_head"):
            names.add(path.rsplit(".", 1)[-1])
    return names


def wrap_targets(model: nn.Module, targets: list[str], routing: Routing) -> dict[str, MultiLoraLinear]:
    """Replace every Linear whose leaf name is in `targets` by a MultiLoraLinear (idempotent); return all wrapped."""
    for path, module in list(model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(module, nn.Linear) and not path.endswith("lm_head"):
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
            setattr(parent, leaf, MultiLoraLinear(module, path, routing))
    return {path: m for path, m in model.named_modules() if isinstance(m, MultiLoraLinear)}


def init_lora(layers: dict[str, MultiLoraLinear], targets: list[str], r: int, alpha: float, seed: int,
              device: torch.device) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """Fresh fp32 A/B per targeted layer, as PEFT initialises them (A Kaiming-uniform, B zero), from `seed` alone."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights = {}
    for path in sorted(layers):
        layer = layers[path]
        if path.rsplit(".", 1)[-1] not in targets:
            continue
        A = torch.empty(r, layer.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        B = torch.zeros(layer.out_features, r, dtype=torch.float32)
        weights[path] = (nn.Parameter(A.to(device)), nn.Parameter(B.to(device)))
    return weights


@contextmanager
def routed(routing: Routing, segments: list[Segment], grouped: bool | None = None) -> Iterator[None]:
    """Route one forward pass; the routing is cleared after, so a stray pass computes the plain base."""
    routing.segments, routing.grouped = segments, grouped
    try:
        yield
    finally:
        routing.segments, routing.grouped = [], None
