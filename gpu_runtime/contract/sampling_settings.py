"""Sampling's defaults, bounds and checked settings: one sample call's knobs, its prompts and its stops."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TypedDict

from gpu_runtime.contract.checks import MAX_SEED, check_seed, check_text, is_int, is_number
from gpu_runtime.errors import BadInput

MAX_TOKENS_LIMIT = 4096
MAX_SAMPLES = 16
MAX_TOPK_LOGPROBS = 20  # most (token, logprob) pairs per position, as vLLM's max_logprobs
MAX_TEMPERATURE = 2.0  # OpenAI's bound; past it sampling is noise (the playground and /v1 share it)
MAX_TOP_P = 1.0  # top_p is a probability mass in (0, MAX_TOP_P] (the playground and /v1 share it)
MAX_TOP_K = 1024  # past this top-k keeps the tail anyway; 0 (or -1) turns it off
MAX_STOP = 16  # stop strings or stop token ids per call: each is checked after every decoded token
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_PROMPT_ALT_TOKENS = 256  # draws per prompt position (Tinker's prompt_alt_tokens_k)
MAX_PROMPT_ALT_CELLS = 1 << 18  # draws per prompt, k x (len - 1): what the answer holds, as ints and logprobs


class SampleDefaults(TypedDict):
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    num_samples: int
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int


SAMPLE_DEFAULTS: SampleDefaults = {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "num_samples": 1,
                                   "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0}


@dataclass
class SamplingSettings:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0: off (the caller's -1 is read as 0)
    stop: list[str]  # stop strings
    num_samples: int
    seed: int
    stop_tokens: list[int] = field(default_factory=list)
    eos: bool = True  # EOS ids stop; `stop=[]` turns them off
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0  # draws at each prompt position after the first (0: none)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt_logprobs > 0


def sampling_prompts(prompts: Any, prompt_tokens: Any) -> list[str] | list[list[int]]:
    """Exactly one of text prompts or token-id prompts; ids are checked against the vocabulary in the runtime."""
    if (prompts is None) == (prompt_tokens is None):
        raise BadInput("give exactly one of prompts (text) or prompt_tokens (token ids)", field="prompts")
    if prompts is not None:
        if not isinstance(prompts, list) or not prompts:
            raise BadInput("prompts must be a non-empty list of strings", field="prompts")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise BadInput(f"prompts[{i}] must be a non-empty string", field=f"prompts[{i}]")
            check_text(prompt, f"prompts[{i}]")
        return prompts
    if not isinstance(prompt_tokens, list) or not prompt_tokens:
        raise BadInput("prompt_tokens must be a non-empty list of token id lists", field="prompt_tokens")
    for i, ids in enumerate(prompt_tokens):
        if not isinstance(ids, list) or not ids or not all(is_int(t) and t >= 0 for t in ids):
            raise BadInput(f"prompt_tokens[{i}] must be a non-empty list of token ids (integers >= 0)",
                           field=f"prompt_tokens[{i}]")
    return prompt_tokens


def stop_settings(stop: Any) -> tuple[list[str], list[int], bool]:
    """(stop strings, stop token ids, whether EOS stops). None: EOS alone; []: nothing stops but max_tokens;
    a non-empty list of strings or of token ids stops there and at EOS too (vLLM's and Tinker's reading)."""
    if stop is None:
        return [], [], True
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list):
        raise BadInput("stop must be a string, a list of strings or a list of token ids", field="stop")
    if len(stop) > MAX_STOP:
        raise BadInput(f"stop has {len(stop)} entries; at most {MAX_STOP}", field="stop")
    if all(isinstance(s, str) for s in stop):
        if not all(stop):
            raise BadInput("stop strings must be non-empty", field="stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise BadInput(f"a stop string is {longest} characters; at most {MAX_STOP_CHARS}", field="stop")
        return list(stop), [], bool(stop)
    if all(is_int(s) for s in stop):
        if any(s < 0 for s in stop):
            raise BadInput("stop token ids must be integers >= 0", field="stop")
        return [], list(stop), True
    raise BadInput("stop must be all strings or all token ids, not a mix", field="stop")


def sampling_settings(
    max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, stop: Any, num_samples: Any, seed: Any,
    prompt_logprobs: Any = False, topk_prompt_logprobs: Any = 0, topk_sample_logprobs: Any = 0,
    prompt_alt_tokens_k: Any = 0,
) -> SamplingSettings:
    if not is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadInput(f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {max_tokens!r}", field="max_tokens")
    if not is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise BadInput(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {temperature!r}",
                       field="temperature")
    if not is_number(top_p) or not 0 < top_p <= MAX_TOP_P:
        raise BadInput(f"top_p must be a number in (0, {MAX_TOP_P:g}], got {top_p!r}", field="top_p")
    if not is_int(top_k) or not -1 <= top_k <= MAX_TOP_K:
        raise BadInput(f"top_k must be an integer in -1..{MAX_TOP_K} (0 or -1 = off), got {top_k!r}", field="top_k")
    strings, tokens, eos = stop_settings(stop)
    if not is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES:
        raise BadInput(f"num_samples must be an integer in 1..{MAX_SAMPLES}, got {num_samples!r}", field="num_samples")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    else:
        check_seed(seed, MAX_SEED)
    if not isinstance(prompt_logprobs, bool):
        raise BadInput(f"prompt_logprobs must be a boolean, got {prompt_logprobs!r}", field="prompt_logprobs")
    for name, k in (("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs)):
        if not is_int(k) or not 0 <= k <= MAX_TOPK_LOGPROBS:
            raise BadInput(f"{name} must be an integer in 0..{MAX_TOPK_LOGPROBS} (0 = off), got {k!r}", field=name)
    check_prompt_alt_tokens(prompt_alt_tokens_k)
    return SamplingSettings(max_tokens, float(temperature), float(top_p), max(top_k, 0), strings, num_samples, seed,
                            stop_tokens=tokens, eos=eos, prompt_logprobs=prompt_logprobs,
                            topk_prompt_logprobs=topk_prompt_logprobs, topk_sample_logprobs=topk_sample_logprobs,
                            prompt_alt_tokens_k=prompt_alt_tokens_k)


def check_prompt_alt_tokens(k: Any, prompt_lengths: list[int] | None = None) -> int:
    """prompt_alt_tokens_k: an integer in 0..MAX_PROMPT_ALT_TOKENS and, given the prompts' lengths in tokens, at most
    MAX_PROMPT_ALT_CELLS draws per prompt (k x (len - 1): the answer's size)."""
    field = "prompt_alt_tokens_k"
    if not is_int(k) or not 0 <= k <= MAX_PROMPT_ALT_TOKENS:
        raise BadInput(f"{field} must be an integer in 0..{MAX_PROMPT_ALT_TOKENS} (0 = off), got {k!r}", field=field)
    longest = max(prompt_lengths or [1])
    if k * (longest - 1) > MAX_PROMPT_ALT_CELLS:
        raise BadInput(f"{field} {k} x {longest - 1} prompt positions = {k * (longest - 1)} draws; a prompt gets at "
                       f"most {MAX_PROMPT_ALT_CELLS}", field=field)
    return int(k)
