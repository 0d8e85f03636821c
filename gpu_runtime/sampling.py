"""Sampling from a run's current weights: validation, then a batched KV-cache decoding loop.

Prompts are left-padded so every sequence's next token sits in the last column. Reported
logprobs are the model's own (temperature 1, unfiltered) log-probabilities of each chosen token.
Tokens keep what was generated, EOS included; text drops EOS and is cut before a stop string.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gpu_runtime.errors import BadInput

MAX_TOKENS_LIMIT = 4096
MAX_SAMPLES = 16


@dataclass
class SamplingSettings:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    num_samples: int
    seed: int


def sampling_settings(
    prompts: Any, max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, stop: Any, num_samples: Any, seed: Any
) -> tuple[list[str], SamplingSettings]:
    if not isinstance(prompts, list) or not prompts:
        raise BadInput("prompts must be a non-empty list of strings", field="prompts")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise BadInput(f"prompts[{i}] must be a non-empty string", field=f"prompts[{i}]")
    if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadInput(f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {max_tokens!r}", field="max_tokens")
    if not _is_number(temperature) or temperature < 0:
        raise BadInput(f"temperature must be a number >= 0, got {temperature!r}", field="temperature")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadInput(f"top_p must be a number in (0, 1], got {top_p!r}", field="top_p")
    if not _is_int(top_k) or top_k < 0:
        raise BadInput(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}", field="top_k")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadInput("stop must be a string or a list of non-empty strings", field="stop")
    if not _is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES:
        raise BadInput(f"num_samples must be an integer in 1..{MAX_SAMPLES}, got {num_samples!r}", field="num_samples")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    elif not _is_int(seed) or seed < 0:
        raise BadInput(f"seed must be a non-negative integer or null, got {seed!r}", field="seed")
    return prompts, SamplingSettings(max_tokens, float(temperature), float(top_p), top_k, stop, num_samples, seed)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[list[int]],
    settings: SamplingSettings,
    eos_ids: set[int],
    generator: torch.Generator,
) -> list[dict[str, Any]]:
    """Decode every prompt in one batch with the KV cache; one result dict per prompt row."""
    device = next(model.parameters()).device
    rows, width = len(prompt_ids), max(len(p) for p in prompt_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((rows, width), pad, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # Positions count real tokens only, so left padding does not shift them.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    reasons: list[str | None] = [None] * rows
    texts: list[str | None] = [None] * rows
    for t in range(settings.max_tokens):
        chosen, chosen_logprobs = choose_tokens(out.logits[:, -1, :].float(), settings, generator)
        for i, (token, logprob) in enumerate(zip(chosen.tolist(), chosen_logprobs.tolist())):
            if reasons[i] is not None:
                continue
            tokens[i].append(token)
            logprobs[i].append(logprob)
            if token in eos_ids:
                reasons[i] = "stop"
            elif settings.stop:
                text = tokenizer.decode(tokens[i], skip_special_tokens=True)
                cut = min((k for k in (text.find(s) for s in settings.stop) if k >= 0), default=-1)
                if cut >= 0:
                    reasons[i], texts[i] = "stop", text[:cut]
        if all(r is not None for r in reasons) or t == settings.max_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, 1)], dim=1)
        position_ids = position_ids[:, -1:] + 1
        out = model(
            input_ids=chosen[:, None],
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=out.cache,
            use_cache=True,
        )
    results = []
    for i in range(rows):
        text = texts[i]
        if text is None:
            body = tokens[i][:-1] if tokens[i] and tokens[i][-1] in eos_ids else tokens[i]
            text = tokenizer.decode(body, skip_special_tokens=True)
        results.append({"text": text, "tokens": tokens[i], "logprobs": logprobs[i], "stop_reason": reasons[i] or "length"})
    return results
