"""A base's decoder: the sample calls on one base, on its one decode engine (compute/decode/engine.py).

Every sample call on a base decodes in that base's `DecodeEngine`, whenever it arrives (continuous batching over a
slot cache): each prompt is prefilled once for its `num_samples` sequences, prefill goes by chunks sized to the time
left (`PrefillRate`) between decode steps, and each sequence's rows read its own adapter per row (the multi-LoRA
layers' `RowRouting`; `adapter_ids` gives each routing key an index while calls on it decode). Prompts enter the engine
as its slots allow, the user with the fewest rows decoding first, so one user's many rows never keep another's few
waiting behind them. The cache grows with the calls (more slots, longer ones) within its byte budget: on CUDA a
fraction of the free memory, on the CPU `CPU_CACHE_BYTES`; a call that needs longer slots than the budget allows
beside the ones decoding waits until they are done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.fsdp import FSDPModule

from gpu_runtime.compute.decode.engine import DecodeEngine, DecodeSettings, Handle
from gpu_runtime.compute.decode.recurrent import state_bytes
from gpu_runtime.compute.decode.slot_cache import DEFAULT_MEMORY_FRACTION, SlotCache, kv_shape
from gpu_runtime.compute.decode.turns import fair_pass_rows
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.contract import SampledSequence, SamplingSettings

CPU_CACHE_BYTES = 1 << 30  # the KV cache's budget on a CPU (on CUDA: DEFAULT_MEMORY_FRACTION of the free memory)
SLOT_COLUMNS = 64  # slot lengths round up to a multiple of this (fewer resizes, fewer graph shapes)
SLOTS_STEP = 8  # and slot counts to a multiple of this

FIRST_PIECE_TOKENS = 512  # a base's first prefill chunk, before its speed is known
MIN_PIECE_TOKENS = 64  # a chunk is at least this (or the rest of the prompts): tiny passes would waste the device


@dataclass
class PrefillRate:
    """A base's prefill speed, in prompt tokens a second, as its last steps measured it: each chunk is sized to the
    time the tick has left (issue 14 §7: a chunk, its prefill included, ends within its bound)."""

    tokens_per_second: float | None = None

    def piece(self, seconds: float, most: int) -> int:
        """Tokens for a chunk that should take `seconds`, at most `most`."""
        if self.tokens_per_second is None:
            return min(FIRST_PIECE_TOKENS, most)
        return min(most, max(MIN_PIECE_TOKENS, int(self.tokens_per_second * seconds)))

    def measured(self, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-6)
        self.tokens_per_second = rate if self.tokens_per_second is None else (self.tokens_per_second + rate) / 2


@dataclass
class SampleJob:
    request: Any  # the engine's Request: decoding reads only its user_id (fair admission)
    state: Any  # the engine's RunState whose current weights it samples (None: frozen weights, `key`)
    prompt_ids: list[list[int]]
    settings: SamplingSettings
    step: int  # the run's step when sampling began
    weights: int = 0  # its weights' version (a run's weights_version; 0: a base): the prefix cache's salt with `key`
    key: str = ""  # its rows' routing key (gpu_runtime/engine/weights_sources.py): a run, "<run>@<snapshot>", a base
    routed: bool = False  # its rows read an adapter (False: the base alone)
    snapshot: Any = None  # the snapshot it reads (gpu_runtime/engine/snapshots.py), held in use until it finishes
    streams: list[Any] = field(default_factory=list)  # a streamed call's IncrementalText per row (sampling_calls.py)
    handles: list[list[Handle]] = field(default_factory=list)  # per prompt added to the engine, its samples
    done: bool = False
    parked: bool = False  # held by a failpoint: out of the engine, waiting for its cancel
    compute_seconds: float = 0.0  # its rows' share of the steps it decoded in

    @property
    def rows(self) -> int:
        return len(self.prompt_ids) * self.settings.num_samples

    @property
    def live(self) -> int:
        """Its sequences in the engine, not ended (and those of prompts not yet added)."""
        waiting = (len(self.prompt_ids) - len(self.handles)) * self.settings.num_samples
        return waiting + sum(not h.done for hs in self.handles for h in hs)

    @property
    def finished(self) -> bool:
        return len(self.handles) == len(self.prompt_ids) and all(h.done for hs in self.handles for h in hs)

    def sequences(self) -> list[list[Handle]]:
        """Per prompt, per sample, its sequence so far ([] for a prompt not yet added)."""
        return self.handles + [[] for _ in range(len(self.prompt_ids) - len(self.handles))]


class BaseDecoder:
    """One base's decode engine and the sample calls on it."""

    def __init__(self, entry: BaseEntry, eos_ids: set[int], prefill_tokens: int) -> None:
        self.entry = entry
        self.eos_ids = eos_ids
        self.prefill_tokens = prefill_tokens  # the most prompt tokens one step prefills
        self.device = next(entry.model.parameters()).device
        self.dtype = next(entry.model.parameters()).dtype
        self.rate = PrefillRate()
        self.jobs: list[SampleJob] = []
        self.keys: list[str] = []  # adapter index -> routing key ("" free)
        self.users_of_key: dict[str, int] = {}  # calls decoding on each key
        config = entry.model.config
        layers, kv_heads, head_dim = kv_shape(config)
        self.column_bytes = layers * 2 * kv_heads * head_dim * torch.empty((), dtype=self.dtype).element_size()
        self.state_bytes = state_bytes(config, self.dtype)  # a hybrid model's recurrent state, per slot (Qwen3.5)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            self.budget = int(free * DEFAULT_MEMORY_FRACTION)
        else:
            self.budget = CPU_CACHE_BYTES
        self.engine: DecodeEngine | None = None

    # ---- capacity

    def columns_for(self, job: SampleJob) -> int:
        """The slot length `job` needs: its longest prompt, its tokens and the scratch column, rounded up."""
        need = max(len(p) for p in job.prompt_ids) + job.settings.max_tokens + 1
        return -(-need // SLOT_COLUMNS) * SLOT_COLUMNS

    def fits(self, job: SampleJob) -> bool:
        """Whether one prompt's samples fit the budget alone (else the call cannot be served here)."""
        return job.settings.num_samples * (self.columns_for(job) * self.column_bytes + self.state_bytes) <= self.budget

    def _room(self, job: SampleJob) -> bool:
        """Make the cache hold `job`'s slots if the budget allows: grown (one copy, sequences decoding go on) or made
        anew when idle and too long-slotted for the budget. False: it waits until the sequences decoding are done."""
        engine = self.engine
        busy = engine is not None and engine.busy
        length = max(self.columns_for(job), engine.cache.max_len if engine is not None else 0)
        most = self.budget // (length * self.column_bytes + self.state_bytes)
        live = sum(j.live for j in self.jobs if j is not job and j.handles and not j.done and not j.parked)
        wanted = max(job.settings.num_samples, min(most, -(-(live + job.rows) // SLOTS_STEP) * SLOTS_STEP))
        if engine is not None and engine.cache.count <= most:
            if length > engine.cache.max_len or wanted > engine.cache.count:
                engine.resize(max(wanted, engine.cache.count), length)
            return True
        if busy:
            return False  # longer slots for every sequence decoding would pass the budget: after them
        length = self.columns_for(job)
        wanted = max(job.settings.num_samples,
                     min(self.budget // (length * self.column_bytes + self.state_bytes),
                         -(-job.rows // SLOTS_STEP) * SLOTS_STEP))
        tokenizer = self.entry.base.tokenizer

        def decode(ids: list[int]) -> str:
            return cast(str, tokenizer.decode(ids, skip_special_tokens=True))  # one sequence in, one str out

        self.engine = None  # the old cache's memory goes first
        cache = SlotCache(self.entry.model.config, length, slots=wanted, dtype=self.dtype, device=self.device)
        sharded = isinstance(self.entry.model, FSDPModule)  # its forwards gather from the other ranks: never captured
        self.engine = DecodeEngine(self.entry.model, cache, prefill_tokens=self.prefill_tokens, decode=decode,
                                   routing=self.entry.routing, graphs=False if sharded else None,
                                   fair_rows=fair_pass_rows(self.device.type))
        self.engine.set_adapters(self.keys)
        return True

    # ---- calls

    def start(self, job: SampleJob) -> None:
        self.jobs.append(job)
        if job.routed and self.users_of_key.get(job.key, 0) == 0:
            index = self.keys.index("") if "" in self.keys else len(self.keys)
            self.keys[index:index + 1] = [job.key]
        if job.routed:
            self.users_of_key[job.key] = self.users_of_key.get(job.key, 0) + 1
            if self.engine is not None:
                self.engine.set_adapters(self.keys)  # its run may have trained since its last sample

    def _forget(self, job: SampleJob) -> None:
        """`job` leaves: its sequences out of the engine, its adapter index free once no call reads it."""
        if job in self.jobs:
            self.jobs.remove(job)
        if self.engine is not None:
            for handles in job.handles:
                for handle in handles:
                    self.engine.cancel(handle)
        if job.routed and job.key in self.users_of_key:
            self.users_of_key[job.key] -= 1
            if not self.users_of_key[job.key]:
                del self.users_of_key[job.key]
                self.keys[self.keys.index(job.key)] = ""
                while self.keys and not self.keys[-1]:
                    self.keys.pop()
                if self.engine is not None:
                    self.engine.set_adapters(self.keys)

    def stop(self, job: SampleJob) -> None:
        """End `job` now (cancelled, deadline, failure): its sequences that have not ended are "cancelled"."""
        job.done = True
        self._forget(job)
        for handles in job.handles:
            for handle in handles:
                handle.reason = handle.reason or "cancelled"

    def park(self, job: SampleJob) -> None:
        """A failpoint holds `job` (tests/faults): out of the engine with what it has, until its cancel."""
        job.parked = True
        if self.engine is not None:
            for handles in job.handles:
                for handle in handles:
                    self.engine.cancel(handle)

    def _admit(self) -> None:
        """Prompts into the engine while its slots allow: the next prompt of the user with the fewest rows decoding
        (their oldest call), so users share the slots. A call that needs a longer cache than can be made beside the
        sequences decoding blocks later calls until it is in."""
        rows: dict[str, int] = {}
        for job in self.jobs:
            if not job.done and not job.parked:
                rows[job.request.user_id] = rows.get(job.request.user_id, 0) + sum(
                    not h.done for hs in job.handles for h in hs)
        waiting = [job for job in self.jobs if not job.done and not job.parked and len(job.handles) < len(job.prompt_ids)]
        while waiting:
            job = min(waiting, key=lambda j: rows[j.request.user_id])
            if not self._room(job):
                return
            engine = self.engine
            assert engine is not None
            queued = sum(len(group.members) for group in engine.waiting if not group.started)
            if engine.busy and engine.cache.free - queued < job.settings.num_samples:
                return  # no slots for it now: it stays out of the engine's queue, so the next free ones are fair
            self._add(engine, job)
            rows[job.request.user_id] += job.settings.num_samples
            if len(job.handles) == len(job.prompt_ids):
                waiting.remove(job)

    def _add(self, engine: DecodeEngine, job: SampleJob) -> None:
        s, p = job.settings, len(job.handles)
        settings = DecodeSettings(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                  seed=s.seed, logprobs_k=s.topk_sample_logprobs, prompt_logprobs=s.prompt_logprobs,
                                  prompt_topk=s.topk_prompt_logprobs, prompt_alt_k=s.prompt_alt_tokens_k)
        stops = set(s.stop_tokens) | (self.eos_ids if s.eos else set())
        n = s.num_samples
        adapter = self.keys.index(job.key) if job.routed else -1
        job.handles.append(engine.add(job.prompt_ids[p], settings, num_samples=n, seq_ids=range(p * n, (p + 1) * n),
                                      adapter=adapter, key=job.key, stop_token_ids=stops, stop_strings=s.stop, tag=job,
                                      weights=hash((weights_of(job), job.weights)), owner=job.request.user_id))

    @property
    def busy(self) -> bool:
        return any(not job.done and not job.parked for job in self.jobs)

    @torch.no_grad()
    def advance(self, deadline: float, seconds_since: Any) -> list[SampleJob]:
        """Step the engine until `deadline` (one step at least) or a call finishes; returns the calls finished.
        Each step's seconds (`seconds_since(start)`) are shared by the calls' sequences in it."""
        finished: list[SampleJob] = []
        while True:
            self._admit()
            engine = self.engine
            if engine is None or not engine.busy:
                return finished
            active = [job for job in self.jobs if not job.done and not job.parked and job.handles]
            live = {id(job): sum(not h.done for hs in job.handles for h in hs) for job in active}
            engine.prefill_tokens = self.rate.piece(deadline - time.monotonic(), self.prefill_tokens)
            before, started = engine.prefilled, time.perf_counter()
            engine.step()
            if engine.prefilled > before:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # its kernels done: the measured time is the step's
                self.rate.measured(engine.prefilled - before, time.perf_counter() - started)
            seconds = seconds_since(started)
            total = max(sum(live.values()), 1)
            for job in active:
                job.compute_seconds += seconds * live[id(job)] / total
                if job.finished:
                    job.done = True
                    self._forget(job)
                    finished.append(job)
            if finished or time.monotonic() >= deadline:
                return finished

    def result(self, job: SampleJob) -> dict[str, Any]:
        """The call's answer (contract SampleResult's fields, compute_seconds apart)."""
        engine = self.engine
        sequences: list[list[SampledSequence]] = []
        hits = 0
        for handles in job.sequences():
            row: list[SampledSequence] = []
            for handle in handles:
                text = handle.text
                if text is None and engine is not None and engine.decode_text is not None:
                    text = engine.decode_text(handle.tokens)
                row.append(SampledSequence(
                    text=text or "", tokens=handle.tokens, logprobs=handle.logprobs,
                    stop_reason=handle.reason or "length",
                    topk_logprobs=[[[float(t), v] for t, v in top] for top in handle.topk]
                    if job.settings.topk_sample_logprobs else None))
            hits += handles[0].prompt_cache_hit_tokens if handles else 0
            sequences.append(row)
        result: dict[str, Any] = {"outputs": [row[0].text if row else "" for row in sequences],
                                  "sequences": [[s.to_dict() for s in row] for row in sequences],
                                  "prompt_tokens": job.prompt_ids, "step": job.step, "prompt_cache_hit_tokens": hits}
        firsts = [handles[0] if handles else None for handles in job.sequences()]
        if job.settings.prompt_logprobs:
            result["prompt_logprobs"] = [h.prompt_logprobs if h is not None and h.prompt_logprobs is not None else []
                                         for h in firsts]
        if job.settings.topk_prompt_logprobs:
            result["topk_prompt_logprobs"] = [
                [None if top is None else [[float(t), v] for t, v in top] for top in h.prompt_topk or []]
                if h is not None else [] for h in firsts]
        if job.settings.prompt_alt_tokens_k:
            result["prompt_alt_tokens"] = [[[[float(t), v] for t, v in row] for row in h.prompt_alts or []]
                                           if h is not None else [] for h in firsts]
        return result

    def fail(self) -> list[SampleJob]:
        """Every call on this base ends (the engine failed); the engine goes, its cache with it."""
        jobs = [job for job in self.jobs if not job.done]
        for job in jobs:
            job.done = True
        self.jobs, self.engine = [], None
        self.keys, self.users_of_key = [], {}
        return jobs

    @property
    def run_ids(self) -> list[str]:
        return [job.key for job in self.jobs if not job.done]


def weights_of(job: SampleJob) -> str:
    """Whose weights a job's KV is computed with, for the prefix cache's reuse (with the weights' version, `weights`):
    a run's own, or a copy of its latest (a /v1 or playground sample; a copy per version under a fresh name) counted
    as the run's, since the copy carries the run's version; a named snapshot, checkpoint or base by its key."""
    snapshot = job.snapshot
    return str(snapshot.run_id) if snapshot is not None and getattr(snapshot, "latest", False) else job.key
