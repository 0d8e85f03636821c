"""Decode groups: the sample calls that arrived together, decoded as one batch in time-bounded chunks.

A group is formed when its requests are picked, from runs on one base, of users whose rows may share a pass
(`may_share`); each run's rows go through its own LoRA via the routing. Each prompt is prefilled once, whatever its
`num_samples`: the prefill has one row per prompt, goes by pieces sized to the time left (`PrefillRate`), and its KV
cache rows are then repeated for the samples before the first token is drawn. Prompts are left-padded so every row's
next token sits in the last column. The group advances by its share of each tick's `decode_chunk_seconds`, so other
calls interleave with a long generation. Late sample calls form a group of their own, and at a chunk boundary join an
older group on its base they may share with (`absorb`, continuous batching): their KV caches are left-padded to one
length and stacked, so concurrent requests on one model decode as one batch whenever they arrive. Rows of calls
already answered leave at that merge. Only plain full-attention caches merge (`mergeable`); a sliding-window or
recurrent one keeps its group apart, as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from gpu_runtime.compute.lora.layer import Segment, routed
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.sampling import PromptScores, choose_tokens, top_logprobs
from gpu_runtime.contract import SamplingSettings

# transformers 5.24 (pyproject's pin) calls the KV cache `cache`, argument and output; earlier 5.x releases (a GPU
# machine's own) call it `past_key_values`. Decoding reads and passes it under whichever name this one uses.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# Most rows a decode group holds whatever its calls' sizes: a pass over that many costs about one over a single row on
# an accelerator, while a CPU pass costs in proportion to its rows. Past them, groups merge only with groups of like
# size (at most LIKE_ROWS times the other's rows), so one user's many rows do not slow the passes of another's few.
SHARED_ROWS = {"cpu": 8}
SHARED_ROWS_ACCELERATOR = 256
LIKE_ROWS = 2


def may_share(rows: int, other: int, device: torch.device) -> bool:
    """Whether calls of `rows` rows and of `other` rows decode in one group (one batch per pass)."""
    shared = SHARED_ROWS.get(device.type, SHARED_ROWS_ACCELERATOR)
    return rows + other <= shared or max(rows, other) <= LIKE_ROWS * min(rows, other)


FIRST_PIECE_TOKENS = 512  # a base's first prefill piece, before its speed is known (rows x columns)
MIN_PIECE_TOKENS = 64  # a piece is at least this (or the rest of the prompt): tiny passes would waste the device


@dataclass
class PrefillRate:
    """A base's prefill speed, in prompt tokens a second, as its last pieces measured it: each piece is sized to the
    time its group has left in the chunk (issue 14 §7: a chunk, its prefill included, ends within its bound)."""

    tokens_per_second: float | None = None

    def piece(self, seconds: float, most: int) -> int:
        """Tokens for a piece that should take `seconds`, at most `most`."""
        if self.tokens_per_second is None:
            return min(FIRST_PIECE_TOKENS, most)
        return min(most, max(MIN_PIECE_TOKENS, int(self.tokens_per_second * seconds)))

    def measured(self, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-6)
        self.tokens_per_second = rate if self.tokens_per_second is None else (self.tokens_per_second + rate) / 2


@dataclass
class SampleJob:
    request: Any  # the engine's Request: decoding reads only its user_id (a group's users share its chunk)
    state: Any  # the engine's RunState whose current weights it samples (None: frozen weights, `key`)
    prompt_ids: list[list[int]]
    settings: SamplingSettings
    generator: torch.Generator
    step: int  # the run's step when sampling began
    start: int = 0  # its decode rows in the group (prompt by prompt, num_samples each)
    t0: int = 0  # the group's `t` when this job's first token was chosen (it may have joined a group mid-flight)
    end: int = 0
    prefill_start: int = 0  # its prefill rows (one per prompt)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    topk: list[list[list[list[float]]]] = field(default_factory=list)  # per row, per token: [token, logprob] pairs
    reasons: list[str | None] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)
    prompt_logprobs: list[list[float | None]] | None = None
    topk_prompt_logprobs: list[list[list[list[float]] | None]] | None = None
    done: bool = False
    compute_seconds: float = 0.0  # its rows' share of the group's decode chunks
    key: str = ""  # its rows' routing key (gpu_runtime/engine/weights_sources.py): a run, "<run>@<snapshot>", a base
    snapshot: Any = None  # the snapshot it reads (gpu_runtime/engine/snapshots.py), held in use until it finishes
    streams: list[Any] = field(default_factory=list)  # a streamed call's IncrementalText per row (sampling_calls.py)


class DecodeGroup:
    def __init__(self, entry: BaseEntry, jobs: list[SampleJob], eos_ids: set[int], prefill_tokens: int = 2**62,
                 rate: PrefillRate | None = None) -> None:
        self.entry = entry
        self.jobs = jobs
        self.eos_ids = eos_ids
        prompts: list[list[int]] = []
        expand: list[int] = []  # the prefill row each decode row continues
        for job in jobs:
            job.prefill_start, job.start = len(prompts), len(expand)
            for ids in job.prompt_ids:
                expand += [len(prompts)] * job.settings.num_samples
                prompts.append(ids)
            job.end = len(expand)
            n = job.end - job.start
            job.tokens, job.logprobs, job.topk = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
            job.reasons, job.texts = [None] * n, [None] * n
        self.rows, self.prefill_rows = len(expand), len(prompts)
        self.segments = [Segment(job.key, job.start, job.end) for job in jobs]
        self.prefill_segments = [Segment(job.key, job.prefill_start, job.prefill_start + len(job.prompt_ids))
                                 for job in jobs]
        tokenizer = entry.base.tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        width = max(len(p) for p in prompts)
        input_ids = torch.full((self.prefill_rows, width), self.pad, dtype=torch.long)
        attention_mask = torch.zeros(self.prefill_rows, width, dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        self.device = next(entry.model.parameters()).device
        self.input_ids, self.attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        self.expand = torch.tensor(expand, dtype=torch.long, device=self.device)
        # Positions count real tokens only, so left padding does not shift them.
        self.position_ids = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.logits: torch.Tensor | None = None
        self.cache: Any = None
        self.t = 0
        self.passes = 0
        # The prefill goes by pieces of at most `prefill_tokens` (rows x columns), each sized by the base's measured
        # speed to the time left, so a long prompt's prefill yields to other work between pieces (issue 14 §7)
        # instead of holding a tick for one pass over all of it.
        self.prefill_tokens = prefill_tokens
        self.rate = rate if rate is not None else PrefillRate()
        self.filled = 0  # prompt columns prefilled so far
        self.scores: dict[int, PromptScores] = {}  # the prompt scores of the jobs that asked, by id(job), piece by piece

    @property
    def users(self) -> set[str]:
        return {job.request.user_id for job in self.jobs if not job.done}

    @property
    def run_ids(self) -> list[str]:
        return [job.key for job in self.jobs]

    @torch.no_grad()
    def advance(self, deadline: float) -> list[SampleJob]:
        """Decode until every job is done, a job finishes or `deadline` passes (at least one token, or one piece of a
        prefill); return jobs finished now."""
        finished: list[SampleJob] = []
        if self.logits is None and not self._prefill(deadline):
            return finished  # still prefilling: the rest of the prompt at the next turn
        with routed(self.entry.routing, self.segments):
            while True:
                assert self.logits is not None
                chosen = torch.full((self.rows,), self.pad, dtype=torch.long, device=self.logits.device)
                for job in self.jobs:
                    if job.done:
                        continue
                    logits = self.logits[job.start:job.end]
                    tokens, logprobs = choose_tokens(logits, job.settings, job.generator)
                    chosen[job.start:job.end] = tokens
                    topk = top_logprobs(logits, job.settings.topk_sample_logprobs) if job.settings.topk_sample_logprobs else None
                    self._record(job, tokens.tolist(), logprobs.tolist(), topk)
                    if all(r is not None for r in job.reasons) or self.t - job.t0 + 1 >= job.settings.max_tokens:
                        job.done = True
                        finished.append(job)
                self.t += 1
                if all(job.done for job in self.jobs):
                    return finished
                self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones(self.rows, 1)], 1)
                self.position_ids = self.position_ids[:, -1:] + 1
                out = self.entry.model(input_ids=chosen[:, None], attention_mask=self.attention_mask,
                                       position_ids=self.position_ids, use_cache=True, **{CACHE: self.cache})
                self.logits, self.cache, self.passes = out.logits[:, -1, :].float(), out[CACHE], self.passes + 1
                if finished or time.monotonic() >= deadline:
                    return finished  # a finished call is answered now, not at the chunk's end

    @property
    def started(self) -> bool:
        """Prefilled: it has decoded a chunk."""
        return self.logits is not None

    @property
    def mergeable(self) -> bool:
        """At a chunk boundary with calls still decoding, and a cache of plain full-attention layers (a sliding window's
        or a recurrent state's rows cannot be left-padded into another's)."""
        layers = getattr(self.cache, "layers", None) or []
        return (self.started and not self.done and bool(layers)
                and all(type(layer) is DynamicLayer for layer in layers))

    @torch.no_grad()
    def absorb(self, others: list[DecodeGroup]) -> None:
        """Take the calls still decoding in `others` (on this base, at a chunk boundary, `mergeable`) into this group:
        each group's rows of calls not yet answered, their caches and masks left-padded to the longest, stacked in
        one batch. Positions stay each row's own, so every row computes what it would have alone."""
        groups = [self, *others]
        length = max(int(group.attention_mask.shape[1]) for group in groups)
        layers = len(self.cache.layers)
        keys: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        masks, positions, logits, jobs, clocks = [], [], [], [], []
        for group in groups:
            live = [job for job in group.jobs if not job.done]
            rows = torch.tensor([r for job in live for r in range(job.start, job.end)], device=self.device)
            pad = length - int(group.attention_mask.shape[1])
            masks.append(F.pad(group.attention_mask[rows], (pad, 0)))  # zeros on the left: padding, never attended
            positions.append(group.position_ids[rows])
            assert group.logits is not None
            logits.append(group.logits[rows])
            for i, layer in enumerate(group.cache.layers):
                keys[i].append(F.pad(layer.keys[rows], (0, 0, pad, 0)))  # (batch, heads, sequence, head_dim)
                values[i].append(F.pad(layer.values[rows], (0, 0, pad, 0)))
            jobs += live
            clocks += [self.t - (group.t - job.t0) for job in live]  # its tokens so far, on this group's clock
        mask, position_ids, next_logits = torch.cat(masks), torch.cat(positions), torch.cat(logits)
        # Columns no row attends to (left by rows that have left) are dropped: the batch is as wide as it needs.
        first = int(mask.any(0).nonzero()[0])
        mask = mask[:, first:]
        stacked = [(torch.cat(keys[i])[:, :, first:], torch.cat(values[i])[:, :, first:]) for i in range(layers)]
        # Nothing changed above: a failure there leaves every group as it was. The new rows from here on.
        for layer, (k, v) in zip(self.cache.layers, stacked):
            layer.keys, layer.values = k, v
        self.attention_mask, self.position_ids, self.logits = mask, position_ids, next_logits
        start = 0
        for job, t0 in zip(jobs, clocks):
            job.t0, job.start, job.end = t0, start, start + len(job.tokens)
            start = job.end
        self.jobs, self.rows = jobs, start
        self.segments = [Segment(job.key, job.start, job.end) for job in jobs]

    @property
    def live_rows(self) -> int:
        """Rows of calls still decoding (a finished call's rows stay in the batch until it is compacted)."""
        return sum(job.end - job.start for job in self.jobs if not job.done)

    def _prefill(self, deadline: float) -> bool:
        """Each prompt once, piece by piece (columns, with the cache of the pieces before) until the prompts are done
        or `deadline` passes (one piece at least); the prompt logprobs of the jobs that asked, from the final hidden
        state. Once done (True): the cache, mask, positions and next-token logits repeated into one row per sample."""
        width = int(self.input_ids.shape[1])
        with routed(self.entry.routing, self.prefill_segments), self._scoring_prompts():
            while True:
                tokens = self.rate.piece(deadline - time.monotonic(), self.prefill_tokens)
                start = self.filled
                end = min(start + max(1, tokens // self.prefill_rows), width)
                began = time.perf_counter()
                out = self.entry.model(input_ids=self.input_ids[:, start:end], attention_mask=self.attention_mask[:, :end],
                                       position_ids=self.position_ids[:, start:end], use_cache=True, logits_to_keep=1,
                                       **{CACHE: self.cache})
                self.cache, self.filled, self.passes = out[CACHE], end, self.passes + 1
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # its kernels done: the measured time is the piece's
                self.rate.measured(self.prefill_rows * (end - start), time.perf_counter() - began)
                if end == width:
                    break
                if time.monotonic() >= deadline:
                    return False
        for job in self.jobs:
            scores = self.scores.pop(id(job), None)
            if scores is not None:
                prompt, top = scores.result()
                job.prompt_logprobs = prompt if job.settings.prompt_logprobs else None
                job.topk_prompt_logprobs = top if job.settings.topk_prompt_logprobs else None
        self.logits = out.logits[:, -1, :].float()
        if self.rows == self.prefill_rows:
            return True  # one sample per prompt: nothing to repeat
        self.cache.reorder_cache(self.expand)  # each layer's keys and values, index_select on the batch dimension
        self.logits = self.logits.index_select(0, self.expand)
        self.attention_mask = self.attention_mask.index_select(0, self.expand)
        self.position_ids = self.position_ids.index_select(0, self.expand)
        return True

    @contextmanager
    def _scoring_prompts(self) -> Iterator[None]:
        """While the prefill runs, score the prompts of the jobs that asked: hooked on the decoder, so the vocabulary
        projection runs inside the model's own forward (where a sharded base has its head gathered), in chunks, each
        prefill piece's columns as that piece passes."""
        asking = [job for job in self.jobs if job.settings.wants_prompt_logprobs]
        if not asking:
            yield
            return
        model = cast(Any, self.entry.model)  # a PreTrainedModel: get_decoder, get_output_embeddings, config
        head, routing = model.get_output_embeddings(), self.entry.routing
        cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2 caps its logits after the head
        vocab = int(head.weight.shape[0])

        def score(module: torch.nn.Module, args: Any, output: Any) -> None:
            hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            outer = routing.segments
            try:
                for job in asking:
                    rows = slice(job.prefill_start, job.prefill_start + len(job.prompt_ids))
                    routing.segments = [Segment(job.key, 0, len(job.prompt_ids))]  # the head's LoRA, if any

                    def project(h: torch.Tensor) -> torch.Tensor:
                        logits: torch.Tensor = head(h)
                        return torch.tanh(logits / cap) * cap if cap else logits

                    scores = self.scores.setdefault(id(job), PromptScores(
                        self.input_ids[rows], [len(p) for p in job.prompt_ids], job.settings.topk_prompt_logprobs))
                    scores.add(hidden[rows], self.filled, vocab, project)
            finally:
                routing.segments = outer

        handle = model.get_decoder().register_forward_hook(score)
        try:
            yield
        finally:
            handle.remove()

    @property
    def done(self) -> bool:
        return all(job.done for job in self.jobs)

    def _record(self, job: SampleJob, tokens: list[int], logprobs: list[float],
                topk: list[list[list[float]]] | None) -> None:
        tokenizer = self.entry.base.tokenizer
        settings = job.settings
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            if job.reasons[i] is not None:
                continue
            job.tokens[i].append(token)
            job.logprobs[i].append(logprob)
            if topk is not None:
                job.topk[i].append(topk[i])
            if token in settings.stop_tokens or (settings.eos and token in self.eos_ids):
                # The stop token is the sequence's last; the text ends before it.
                job.reasons[i] = "stop"
                job.texts[i] = cast(str, tokenizer.decode(job.tokens[i][:-1], skip_special_tokens=True))
            elif settings.stop:
                text = cast(str, tokenizer.decode(job.tokens[i], skip_special_tokens=True))  # one sequence in, one str out
                cut = min((k for k in (text.find(s) for s in settings.stop) if k >= 0), default=-1)
                if cut >= 0:
                    job.reasons[i], job.texts[i] = "stop", text[:cut]

    def result(self, job: SampleJob) -> dict[str, Any]:
        tokenizer = self.entry.base.tokenizer
        results = []
        for i in range(job.end - job.start):
            text = job.texts[i]
            if text is None:
                text = cast(str, tokenizer.decode(job.tokens[i], skip_special_tokens=True))  # one sequence in, one str
            sequence: dict[str, Any] = {"text": text, "tokens": job.tokens[i], "logprobs": job.logprobs[i],
                                        "stop_reason": job.reasons[i] or "length"}
            if job.settings.topk_sample_logprobs:
                sequence["topk_logprobs"] = job.topk[i]
            results.append(sequence)
        n = job.settings.num_samples
        sequences = [results[i * n:(i + 1) * n] for i in range(len(job.prompt_ids))]
        result: dict[str, Any] = {"outputs": [s[0]["text"] for s in sequences], "sequences": sequences,
                                  "prompt_tokens": job.prompt_ids, "step": job.step}
        if job.prompt_logprobs is not None:
            result["prompt_logprobs"] = job.prompt_logprobs
        if job.topk_prompt_logprobs is not None:
            result["topk_prompt_logprobs"] = job.topk_prompt_logprobs
        return result
