"""Choosing each next token: temperature, top-k and top-p, with the model's own logprobs.

Reported logprobs are the model's own (temperature 1, unfiltered) log-probabilities of each
chosen token. The decoding loop itself is `decoding.DecodeGroup`.
"""

from __future__ import annotations

import math

import torch

from gpu_runtime.contract import SamplingSettings


def choose_tokens(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token per row; return (tokens, their logprobs under the unmodified model)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if settings.temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        scaled = logits / settings.temperature
        if settings.top_k > 0:
            kth = torch.topk(scaled, min(settings.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        if settings.top_p < 1:
            ordered, order = torch.sort(scaled, dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # Drop a token when the tokens before it already cover top_p (the first always stays).
            drop = probs.cumsum(dim=-1) - probs > settings.top_p
            scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, -math.inf))
        tokens = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
