"""A base as the runtime holds it: the loaded model, its renderer, the layers LoRA may target and their wrappers.
The runs resident on it and the memory budget are the engine's (gpu_runtime/engine/residency.py).

(A *pool* is the whole runtime for one pool key, a process or a Modal container; `Residency` is what it
holds in memory. The deployed Modal class keeps the name `Pool`.)

Each base is loaded once; its targeted Linear layers are wrapped by `MultiLoraLinear` as runs ask
for them, and every resident run's matrices hang off those layers. Runs are kept in least recently
used order; past the budget (bytes of LoRA + AdamW + gradients, or a count) the oldest idle ones
are handed to the eviction (gpu_runtime/engine/recovery.py) to snapshot and free. A base with no resident runs is unloaded
after an idle time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import torch

from gpu_runtime.compute.batches import Renderer
from gpu_runtime.compute.lora.layer import Routing
from gpu_runtime.compute.lora.wrap import LoraTarget, linear_module_names
from gpu_runtime.compute.models import LoadedBase, ModelRegistry


@dataclass
class BaseEntry:
    base: LoadedBase
    quantization: str | None
    routing: Routing
    renderer: Renderer
    available: set[str]  # linear layer names LoRA may target, the unembedding (lm_head) included
    params: int
    layers: dict[str, LoraTarget] = field(default_factory=dict)
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def model(self) -> torch.nn.Module:
        return self.base.model


def load_base(models: ModelRegistry, name: str, quantization: str | None) -> BaseEntry:
    """A base loaded (or found in the registry), frozen, with its renderer and the layers LoRA may target."""
    base = models.get(name, quantization)
    base.model.requires_grad_(False)  # only LoRA matrices train
    base.model.eval()  # no base dropout; LoRA dropout is drawn by the multi-LoRA layer itself
    vocab = cast(torch.nn.Embedding, base.model.get_input_embeddings()).num_embeddings  # typed as a plain Module
    return BaseEntry(base=base, quantization=quantization, routing=Routing(),
                     renderer=Renderer(base.tokenizer, vocab, base.max_length),
                     available=linear_module_names(base.model, unembedding=True), params=base.params)
