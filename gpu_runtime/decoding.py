"""Decode groups: the sample calls that arrived together, decoded as one batch in time-bounded chunks.

A group is formed when its requests are picked, from runs on one base; each run's rows go through
its own LoRA via the routing. Prompts are left-padded so every row's next token sits in the last
column. The group advances by chunks of `decode_chunk_seconds`, so other calls interleave with a
long generation; KV caches are never merged mid-flight: late sample calls form the next group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from gpu_runtime.contract import SamplingSettings
from gpu_runtime.multilora import Segment, routed
from gpu_runtime.pool import BaseEntry
from gpu_runtime.run_state import RunState
from gpu_runtime.sampling import choose_tokens
from gpu_runtime.scheduler import Request


@dataclass
class SampleJob:
    request: Request
    state: RunState | None  # the run whose current weights it samples (None: frozen weights, `key`)
    prompt_ids: list[list[int]]
    settings: SamplingSettings
    generator: torch.Generator
    step: int  # the run's step when sampling began
    start: int = 0  # its rows in the group
    end: int = 0
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)
    done: bool = False
    compute_seconds: float = 0.0  # its rows' share of the group's decode chunks
    key: str = ""  # its rows' routing key (gpu_runtime/weights_sources.py): a run, "<run>@<snapshot>", a base
    snapshot: Any = None  # the snapshot it reads (gpu_runtime/snapshots.py), held in use until it finishes


class DecodeGroup:
    def __init__(self, entry: BaseEntry, jobs: list[SampleJob], eos_ids: set[int]) -> None:
        self.entry = entry
        self.jobs = jobs
        self.eos_ids = eos_ids
        rows: list[list[int]] = []
        for job in jobs:
            job.start = len(rows)
            rows += [ids for ids in job.prompt_ids for _ in range(job.settings.num_samples)]
            job.end = len(rows)
            n = job.end - job.start
            job.tokens, job.logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
            job.reasons, job.texts = [None] * n, [None] * n
        self.rows = len(rows)
        self.segments = [Segment(job.key, job.start, job.end) for job in jobs]
        tokenizer = entry.base.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        width = max(len(p) for p in rows)
        input_ids = torch.full((self.rows, width), self.pad, dtype=torch.long)
        attention_mask = torch.zeros(self.rows, width, dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        device = next(entry.model.parameters()).device
        self.input_ids, self.attention_mask = input_ids.to(device), attention_mask.to(device)
        # Positions count real tokens only, so left padding does not shift them.
        self.position_ids = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.logits: torch.Tensor | None = None
        self.cache: Any = None
        self.t = 0
        self.passes = 0

    @property
    def run_ids(self) -> list[str]:
        return [job.key for job in self.jobs]

    @torch.no_grad()
    def advance(self, deadline: float) -> list[SampleJob]:
        """Decode until every job is done or `deadline` passes (at least one token); return jobs finished now."""
        finished: list[SampleJob] = []
        with routed(self.entry.routing, self.segments):
            if self.logits is None:
                out = self.entry.model(input_ids=self.input_ids, attention_mask=self.attention_mask,
                                       position_ids=self.position_ids, use_cache=True, logits_to_keep=1)
                self.logits, self.cache, self.passes = out.logits[:, -1, :].float(), out.cache, self.passes + 1
            while True:
                assert self.logits is not None
                chosen = torch.full((self.rows,), self.pad, dtype=torch.long, device=self.logits.device)
                for job in self.jobs:
                    if job.done:
                        continue
                    tokens, logprobs = choose_tokens(self.logits[job.start:job.end], job.settings, job.generator)
                    chosen[job.start:job.end] = tokens
                    self._record(job, tokens.tolist(), logprobs.tolist())
                    if all(r is not None for r in job.reasons) or self.t + 1 >= job.settings.max_tokens:
                        job.done = True
                        finished.append(job)
                self.t += 1
                if all(job.done for job in self.jobs):
                    return finished
                self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(self.rows, 1)], 1)
                self.position_ids = self.position_ids[:, -1:] + 1
                out = self.entry.model(input_ids=chosen[:, None], attention_mask=self.attention_mask,
                                       position_ids=self.position_ids, cache=self.cache, use_cache=True)
                self.logits, self.cache, self.passes = out.logits[:, -1, :].float(), out.cache, self.passes + 1
                if time.monotonic() >= deadline:
                    return finished

    @property
    def done(self) -> bool:
        return all(job.done for job in self.jobs)

    def _record(self, job: SampleJob, tokens: list[int], logprobs: list[float]) -> None:
        tokenizer = self.entry.base.tokenizer
        stops = job.settings.stop
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            if job.reasons[i] is not None:
                continue
            job.tokens[i].append(token)
            job.logprobs[i].append(logprob)
            if token in self.eos_ids:
                job.reasons[i] = "stop"
            elif stops:
                text = cast(str, tokenizer.decode(job.tokens[i], skip_special_tokens=True))  # one sequence in, one str out
                cut = min((k for k in (text.find(s) for s in stops) if k >= 0), default=-1)
                if cut >= 0:
                    job.reasons[i], job.texts[i] = "stop", text[:cut]

    def result(self, job: SampleJob) -> dict[str, Any]:
        tokenizer = self.entry.base.tokenizer
        results = []
        for i in range(job.end - job.start):
            text = job.texts[i]
            if text is None:
                body = job.tokens[i][:-1] if job.tokens[i] and job.tokens[i][-1] in self.eos_ids else job.tokens[i]
                text = cast(str, tokenizer.decode(body, skip_special_tokens=True))  # one sequence in, one str out
            results.append({"text": text, "tokens": job.tokens[i], "logprobs": job.logprobs[i],
                            "stop_reason": job.reasons[i] or "length"})
        n = job.settings.num_samples
        sequences = [results[i * n:(i + 1) * n] for i in range(len(job.prompt_ids))]
        return {"outputs": [s[0]["text"] for s in sequences], "sequences": sequences,
                "prompt_tokens": job.prompt_ids, "step": job.step}
