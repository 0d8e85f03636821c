"""What the decode engine holds per sequence and per prompt: the settings a sequence decodes with, its `Handle` (what
it has so far, read after each step to stream), and a prompt's `Prefill`, shared by its `num_samples` sequences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_runtime.compute.decode.sampler import Sampled
from gpu_runtime.compute.decode.text import StopText


@dataclass(frozen=True)
class DecodeSettings:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    logprobs_k: int = 0  # top logprobs per sampled token
    prompt_logprobs: bool = False
    prompt_topk: int = 0  # top logprobs per prompt position
    prompt_alt_k: int = 0  # draws per prompt position after the first (sampler.prompt_draws)

    @property
    def wants_prompt_scores(self) -> bool:
        """Whether the prefill reads the logits of every prompt position: then no prefix comes from the cache, whose
        KV carries no logits (a prompt asking these pays its whole prefill)."""
        return self.prompt_logprobs or self.prompt_topk > 0 or self.prompt_alt_k > 0


@dataclass(eq=False)
class Handle:
    """One sequence: what it was asked, and what it has so far (read it after each step to stream)."""

    prompt: list[int]
    settings: DecodeSettings
    seq_index: int
    adapter: int
    key: str
    stop_tokens: frozenset[int]
    stop_strings: tuple[str, ...]
    tag: Any = None
    owner: str = ""  # the user it samples for: passes and prefills take turns by owner (turns.py)
    turn: int = 0  # when it was last decoded (the engine's `turns` then; 0: not yet)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, (id, logprob) most likely first
    prompt_logprobs: list[float | None] | None = None  # None at position 0
    prompt_topk: list[list[tuple[int, float]] | None] | None = None
    prompt_alts: list[list[tuple[int, float]]] | None = None  # per prompt position after the first: k (id, logprob)
    reason: str | None = None  # "stop", "length", "cancelled"
    text: str | None = None  # the final text (with a `decode`); a stop string's match and after left out
    prompt_cache_hit_tokens: int = 0
    slot: int = -1
    kv: int = 0  # columns of KV written in its slot
    stops: StopText | None = None
    group: Prefill | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def running(self) -> bool:
        return self.slot >= 0 and self.group is None and self.reason is None


@dataclass(eq=False)
class Prefill:
    """One prompt's prefill, shared by its sequences (`members`): its KV goes into `slot`, which its first member
    still live at the end keeps; the others get a copy of the prompt's KV in their own `reserved` slots."""

    prompt: list[int]
    members: list[Handle]
    slot: int = -1
    reserved: list[int] = field(default_factory=list)
    filled: int = 0
    hits: int = 0
    salt: int = 0  # the weights its KV is computed with: a prefix is reused only from KV of the same weights
    scores: list[float | None] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    alts: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return self.slot >= 0


def outputs(drawn: Sampled) -> tuple[torch.Tensor, ...]:
    """A draw's tensors as the step packs them: tokens, logprobs, and the top-k values and ids when asked."""
    if drawn.top_values is not None and drawn.top_ids is not None:
        return drawn.tokens, drawn.logprobs, drawn.top_values, drawn.top_ids
    return drawn.tokens, drawn.logprobs
