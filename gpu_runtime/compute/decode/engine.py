"""A decode engine: continuous batching over a slot cache, one batched sampler, one host copy per step.

`DecodeEngine.add` queues a prompt's sequences (num_samples of them share one prefill); `step` prefills waiting
prompts by chunks within a token budget (`prefill_tokens`), then decodes one token for every running sequence, so a
long prompt never stalls sequences already decoding; a sequence whose prefill ends draws its first token in the same
step. Each step makes one device-to-host copy (tokens, logprobs, top-k and prompt scores packed together; on CUDA into
pinned memory, non_blocking, then one event wait); stop tokens, max tokens and stop strings are checked on the host
from it. `cancel` frees a sequence's slot at once.

Rows of a decode pass are slots [0, high-water): a free slot or a prompt still prefilling inside that range is a row
that computes and is ignored (it writes the scratch column; see slot_cache.py). Slots are taken lowest first, so the
range stays as tight as the live sequences allow without moving any KV.

Multi-LoRA: `adapter_index` is, during every forward, a [rows] int64 tensor of each row's adapter slot (-1: the base
alone) and `row_keys` the rows' routing keys. Given the base's `routing`, every forward and every head call routes
its rows through it row by row (lora/layer.py's `RowRouting`: adapter j is `adapter_keys[j]`). On CUDA the decode forward and its
sampling are captured as one CUDA graph per (rows bucket, columns bucket, sampling kernels) and replayed; everything
they read lives in static per-slot buffers (`next_token`, `length`, `active`, the parameter tables, `adapter`).
On the CPU the same code runs eagerly.

Prompt logprobs are computed as the prefill passes (the head applied to each chunk's hidden states); a prompt that
asks for them is prefilled in full (no prefix reuse), since reused columns have no hidden states.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_runtime.compute.decode.sampler import RowParams, Sampled, sample, split_seed
from gpu_runtime.compute.decode.slot_cache import Pass, SlotCache, SlotKV
from gpu_runtime.compute.decode.text import StopText
from gpu_runtime.compute.lora.layer import Routing, routed_rows

GRAPH_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # rows buckets of the graphed decode step
GRAPH_COLUMNS = 256  # the columns a graphed step reads, rounded up to a multiple of this


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

    @property
    def wants_prompt_scores(self) -> bool:
        return self.prompt_logprobs or self.prompt_topk > 0


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
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, (id, logprob) most likely first
    prompt_logprobs: list[float | None] | None = None  # None at position 0
    prompt_topk: list[list[tuple[int, float]] | None] | None = None
    reason: str | None = None  # "stop", "length", "cancelled"
    text: str | None = None  # the final text (with a `decode`); a stop string's match and after left out
    prompt_cache_hit_tokens: int = 0
    slot: int = -1
    kv: int = 0  # columns of KV written in its slot
    stops: StopText | None = None
    group: _Prefill | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def running(self) -> bool:
        return self.slot >= 0 and self.group is None and self.reason is None


@dataclass(eq=False)
class _Prefill:
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

    @property
    def started(self) -> bool:
        return self.slot >= 0


class DecodeEngine:
    def __init__(self, model: Any, cache: SlotCache, *, prefill_tokens: int = 512,
                 decode: Callable[[list[int]], str] | None = None, graphs: bool | None = None,
                 routing: Routing | None = None) -> None:
        self.model, self.cache = model, cache
        self.routing = routing
        self.adapter_keys: tuple[str, ...] = ()  # adapter index j routes to the LoRA registered under adapter_keys[j]
        self.adapter_epoch = 0  # one per set_adapters: the layers stack the adapters again
        self.device = cache.device
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        parameters = inspect.signature(self.decoder.forward).parameters
        self.cache_arg = "cache" if "cache" in parameters else "past_key_values"  # transformers 5.24's name, or older
        self.kv = SlotKV(cache)
        self.prefill_tokens = prefill_tokens
        self.decode_text = decode
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.dtype = cache.storage.dtype
        slots, dev = cache.count, self.device
        self.next_token = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.length = torch.zeros(slots, dtype=torch.int64, device=dev)
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.adapter = torch.full((slots,), -1, dtype=torch.int64, device=dev)
        self.floats = torch.zeros(slots, 2, dtype=torch.float32, device=dev)  # temperature, top_p
        self.ints = torch.zeros(slots, 4, dtype=torch.int64, device=dev)  # top_k, seed_lo, seed_hi, seq
        self.columns = torch.arange(cache.max_len, dtype=torch.int64, device=dev)
        self.layer_kinds = _layer_kinds(model.config)
        self.adapter_index: torch.Tensor = self.adapter[:0]  # the rows' adapter slots during a forward
        self.row_keys: list[str] = []  # the rows' routing keys during a forward
        self.waiting: deque[_Prefill] = deque()
        self.by_slot: dict[int, Handle] = {}  # running sequences by slot
        self.steps = 0
        self.prefilled = 0  # prompt tokens prefilled so far (the caller measures its prefill speed by them)
        self.passes = 0
        self._kernels: tuple[bool, int, torch.Tensor | None, int] | None = None  # the decode step's sampling choices
        self._graphs: dict[tuple[Any, ...], tuple[Any, tuple[torch.Tensor, ...]]] = {}
        self._graph_pool: Any = None
        self._host: torch.Tensor | None = None  # pinned buffer of the step's host copy (CUDA)

    # ---- the caller's side

    def add(self, prompt_ids: Sequence[int], settings: DecodeSettings, *, num_samples: int = 1,
            seq_ids: Sequence[int] | None = None, adapter: int = -1, key: str = "",
            stop_token_ids: Collection[int] = (), stop_strings: Sequence[str] = (), tag: Any = None,
            weights: int = 0) -> list[Handle]:
        """Queue `num_samples` sequences continuing `prompt_ids` (one prefill for all of them). `seq_ids` are their
        sequence indices in the sampler's counter (default 0..num_samples-1), so a request's samples differ from one
        another and each repeats itself under the same seed. `weights` names the weights the rows read (an adapter and
        its version): a prompt prefix is reused only from KV those weights computed. Raises ValueError when it cannot
        fit a slot."""
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("an empty prompt")
        if len(prompt) + settings.max_tokens > self.cache.max_len - 1:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({settings.max_tokens}) exceeds the slot's "
                             f"{self.cache.max_len - 1} tokens")
        if num_samples > self.cache.count:
            raise ValueError(f"{num_samples} samples, {self.cache.count} slots")
        if settings.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        ids = list(seq_ids) if seq_ids is not None else list(range(num_samples))
        if len(ids) != num_samples:
            raise ValueError("seq_ids must give one index per sample")
        stops = tuple(stop_strings)
        if stops and self.decode_text is None:
            raise ValueError("stop strings need the engine's `decode`")
        members = [Handle(prompt, settings, i, adapter, key, frozenset(stop_token_ids), stops, tag) for i in ids]
        group = _Prefill(prompt, members, salt=weights)
        for member in members:
            member.group = group
            if stops and self.decode_text is not None:
                member.stops = StopText(self.decode_text, stops)
        self.waiting.append(group)
        return members

    def cancel(self, handle: Handle) -> None:
        """End `handle` now ("cancelled", with what it has): its slot is free before the next step."""
        if handle.done:
            return
        handle.reason = "cancelled"
        group = handle.group
        if group is None:  # decoding
            self._leave([handle])
            return
        live = [m for m in group.members if not m.done]
        if group.started and len(group.reserved) > len(live) - 1 and live:
            self.cache.release(group.reserved.pop())
        if not live:
            self.waiting.remove(group)
            if group.started:
                self.cache.release(group.slot)
            for slot in group.reserved:
                self.cache.release(slot)
            for member in group.members:
                member.group = None

    def set_adapters(self, keys: Sequence[str]) -> None:
        """The routing keys of adapter indices 0.. from now on; call it again whenever an adapter's weights may have
        changed (a run trained). The layers stack the adapters again, so captured graphs go."""
        self.adapter_keys = tuple(keys)
        self.adapter_epoch += 1
        self._graphs.clear()

    def resize(self, slots: int, max_len: int) -> None:
        """Grow the cache to at least `slots` slots of `max_len` columns, keeping every slot's KV and bookkeeping (one
        copy of the storage): sequences in flight go on as they were."""
        old = self.cache.count
        self.cache.resize(slots, max_len)
        grow = self.cache.count - old
        if grow:
            def more(t: torch.Tensor, fill: float = 0) -> torch.Tensor:
                return torch.cat([t, t.new_full((grow, *t.shape[1:]), fill)])
            self.next_token, self.length, self.active = more(self.next_token), more(self.length), more(self.active)
            self.adapter, self.floats, self.ints = more(self.adapter, -1), more(self.floats), more(self.ints)
        self.columns = torch.arange(self.cache.max_len, dtype=torch.int64, device=self.device)
        self._graphs.clear()

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.by_slot)

    def result(self, handle: Handle) -> dict[str, Any]:
        """A sequence's answer (one SampledSequence's fields), plus the prompt's scores and
        its cache hits."""
        text = handle.text
        if text is None and self.decode_text is not None:
            text = self.decode_text(handle.tokens)
        out: dict[str, Any] = {"text": text, "tokens": handle.tokens, "logprobs": handle.logprobs,
                               "stop_reason": handle.reason or "length",
                               "prompt_cache_hit_tokens": handle.prompt_cache_hit_tokens}
        if handle.settings.logprobs_k:
            out["topk_logprobs"] = [[[t, v] for t, v in row] for row in handle.topk]
        if handle.settings.prompt_logprobs:
            out["prompt_logprobs"] = handle.prompt_logprobs
        if handle.settings.prompt_topk:
            out["topk_prompt_logprobs"] = [None if row is None else [[t, v] for t, v in row]
                                           for row in handle.prompt_topk or []]
        return out

    # ---- one step

    @torch.no_grad()
    def step(self) -> list[Handle]:
        """One prefill chunk (within `prefill_tokens`, if prompts wait) and one decode token for every running
        sequence; returns the sequences that ended in it."""
        self.steps += 1
        pieces: list[torch.Tensor] = []
        readers: list[tuple[Callable[[list[float], int], None], int]] = []
        offset = [0]

        def collect(tensor: torch.Tensor, read: Callable[[list[float], int], None]) -> None:
            flat = tensor.reshape(-1).to(torch.float64)
            readers.append((read, offset[0]))
            offset[0] += int(flat.numel())
            pieces.append(flat)

        running = list(self.by_slot.values())
        if running:
            self._decode(running, collect)
        joining = self._prefill(collect)
        if not pieces:
            return []
        values = self._to_host(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        for read, start in readers:
            read(values, start)
        ended = [h for h in running if h.done] + [h for h in joining if h.done]
        self._leave([h for h in ended if h.slot >= 0])
        return ended

    # ---- decode

    def _decode(self, running: list[Handle], collect: Callable[..., None]) -> None:
        rows = max(h.slot for h in running) + 1
        kv_len = min(self.cache.max_len, max(h.kv for h in running) + 1)
        if self._kernels is None:
            self._kernels = self._choices([h.settings for h in running], rows, running)
        any_sampled, top_k_cap, top_p_rows, logprobs_k = self._kernels
        graphed = self.graphs and self.device.type == "cuda"
        if graphed:
            rows = next((b for b in GRAPH_ROWS if b >= rows), rows)
            rows = min(rows, self.cache.count)
            kv_len = min(self.cache.max_len, -(-kv_len // GRAPH_COLUMNS) * GRAPH_COLUMNS)
            if top_p_rows is not None:
                top_p_rows = self.columns[:rows]  # every row sorts in a graph (rows with top_p 1 keep all)
            out = self._graphed((rows, kv_len, any_sampled, top_k_cap, top_p_rows is not None, logprobs_k),
                                lambda: self._decode_pass(rows, kv_len, any_sampled, top_k_cap, top_p_rows, logprobs_k))
        else:
            out = self._decode_pass(rows, kv_len, any_sampled, top_k_cap, top_p_rows, logprobs_k)
        tokens, logprobs = out[0], out[1]
        active = self.active[:rows]
        self.next_token[:rows] = torch.where(active, tokens, self.next_token[:rows])
        self.length[:rows] += active.to(torch.int64)
        self.passes += 1
        k = int(out[2].shape[1]) if len(out) > 2 else 0
        collect(torch.cat([tokens.to(torch.float64)[:, None], logprobs.to(torch.float64)[:, None]]
                          + ([out[2].to(torch.float64), out[3].to(torch.float64)] if k else []), dim=1),
                lambda values, start: self._read_decode(running, values, start, 2 + 2 * k, k))

    def _decode_pass(self, rows: int, kv_len: int, any_sampled: bool, top_k_cap: int, top_p_rows: torch.Tensor | None,
                     logprobs_k: int) -> tuple[torch.Tensor, ...]:
        """The decode forward and its sampling over slots [0, rows), reading only static per-slot buffers."""
        active = self.active[:rows]
        length = self.length[:rows]
        write = torch.where(active, length, self.cache.scratch)[:, None]
        positions = length * active  # inactive rows: position 0, attending column 0
        plan = Pass(0, rows, None, write, kv_len,
                    scatter_index=write[:, None, :, None].expand(rows, self.cache.kv_heads, 1, self.cache.head_dim))
        hidden = self._forward(self.next_token[:rows, None], positions[:, None], plan, self.adapter[:rows], None)
        logits = self._logits(hidden[:, -1], self.adapter[:rows])
        drawn = sample(logits, self._params(slice(0, rows)), length + 1, any_sampled=any_sampled,
                       top_k_cap=top_k_cap, top_p_rows=top_p_rows, logprobs_k=logprobs_k)
        return _outputs(drawn)

    def _read_decode(self, running: list[Handle], values: list[float], start: int, width: int, k: int) -> None:
        for handle in running:
            if handle.done:  # cancelled during this step's prefill bookkeeping: nothing more
                continue
            at = start + handle.slot * width
            self.cache.extend(handle.slot, handle.tokens[-1:])  # the token this pass wrote
            handle.kv += 1
            self._record(handle, int(values[at]), values[at + 1],
                         [(int(values[at + 2 + k + j]), values[at + 2 + j]) for j in range(k)])

    # ---- prefill

    def _prefill(self, collect: Callable[..., None]) -> list[Handle]:
        """One chunked pass over the prompts at the head of the queue (within `prefill_tokens`); sequences whose
        prompt ends in it draw their first token. Returns them."""
        budget = self.prefill_tokens
        chunks: list[tuple[_Prefill, int, int]] = []
        for group in self.waiting:
            if budget <= 0:
                break
            if not group.started and not self._start(group):
                break  # no slots for it yet: it and the prompts behind it wait (first come, first served)
            n = min(len(group.prompt) - group.filled, budget)
            chunks.append((group, group.filled, n))
            budget -= n
        if not chunks:
            return []
        chunks.sort(key=lambda c: c[0].slot)
        rows, width = len(chunks), max(n for _, _, n in chunks)
        kv_len = max(f + n for _, f, n in chunks)
        scratch = self.cache.scratch
        ids = [[0] * width for _ in range(rows)]
        write = [[scratch] * width for _ in range(rows)]
        positions = [[0] * width for _ in range(rows)]
        for i, (group, f, n) in enumerate(chunks):
            ids[i][:n] = group.prompt[f:f + n]
            write[i][:n] = range(f, f + n)
            positions[i][:n] = range(f, f + n)
        slots = [group.slot for group, _, _ in chunks]
        write_t = self._tensor(write)
        if slots == list(range(slots[0], slots[0] + rows)):
            plan = Pass(slots[0], slots[0] + rows, None, write_t, kv_len,
                        scatter_index=write_t[:, None, :, None].expand(rows, self.cache.kv_heads, width,
                                                                       self.cache.head_dim))
            adapters = self.adapter[slots[0]:slots[0] + rows]
        else:
            slot_t = self._tensor(slots)
            plan = Pass(None, None, slot_t, write_t, kv_len)
            adapters = self.adapter.index_select(0, slot_t)
        hidden = self._forward(self._tensor(ids), self._tensor(positions), plan, adapters,
                               [group.members[0].key for group, _, _ in chunks])
        self.passes += 1
        self.prefilled += sum(n for _, _, n in chunks)
        ended: list[int] = []
        for i, (group, f, n) in enumerate(chunks):
            self.cache.extend(group.slot, group.prompt[f:f + n])
            group.filled = f + n
            if group.members[0].settings.wants_prompt_scores:
                self._score(group, hidden[i, :n], f, collect)
            if group.filled == len(group.prompt):
                ended.append(i)
        joining: list[Handle] = []
        if ended:
            last = self._tensor([chunks[i][2] - 1 for i in ended])
            index = self._tensor(ended)
            logits = self._logits(hidden.index_select(0, index).gather(
                1, last[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1), adapters.index_select(0, index))
            expand: list[int] = []
            for j, i in enumerate(ended):
                group = chunks[i][0]
                self.waiting.remove(group)
                members = self._seat(group)
                joining += members
                expand += [j] * len(members)
            if joining:
                self._first_tokens(joining, logits.index_select(0, self._tensor(expand)), collect)
        return joining

    def _start(self, group: _Prefill) -> bool:
        """Reserve the group's slots and look for its prompt's prefix in the cache (False: not enough free slots)."""
        live = [m for m in group.members if not m.done]
        if self.cache.free < len(live):
            return False
        source, n = -1, 0
        if not group.members[0].settings.wants_prompt_scores:
            source, n = self.cache.match(group.prompt, len(group.prompt) - 1, group.salt)
        if source >= 0 and not self.cache.live[source]:
            self.cache.take(source)  # by reference: the freed slot as it is
            self.cache.truncate(source, n)
            group.slot = source
        else:
            group.slot = self.cache.acquire(group.salt)
            if source >= 0:
                self.cache.copy_prefix(source, group.slot, n)
        group.reserved = [self.cache.acquire(group.salt) for _ in live[1:]]
        group.filled = group.hits = n
        for member in group.members:
            member.prompt_cache_hit_tokens = n
        # Its settings into the per-slot tables now: the slots are its own from here on.
        self._set_rows([group.slot, *group.reserved], live)
        return True

    def _seat(self, group: _Prefill) -> list[Handle]:
        """The prompt is in `group.slot`: its live members take that slot and the reserved ones (a copy of the
        prompt's KV each); returns them."""
        live = [m for m in group.members if not m.done]
        for member in group.members:
            member.group = None
            member.prompt_logprobs = group.scores if member.settings.prompt_logprobs else None
            member.prompt_topk = group.tops if member.settings.prompt_topk else None
        if not live:
            self.cache.release(group.slot)
            return []
        slots = [group.slot, *group.reserved]
        self.cache.copy_prefix_many(group.slot, slots[1:], len(group.prompt))
        self._set_rows(slots, live)  # a member may have been cancelled since `_start`
        for member, slot in zip(live, slots):
            member.slot, member.kv = slot, len(group.prompt)
        return live

    def _first_tokens(self, members: list[Handle], logits: torch.Tensor, collect: Callable[..., None]) -> None:
        slot_t = self._tensor([m.slot for m in members])
        settings = [m.settings for m in members]
        any_sampled, top_k_cap, top_p_rows, logprobs_k = self._choices(settings, len(members), None)
        position = self._tensor([m.kv for m in members])
        drawn = sample(logits, self._params(slot_t), position, any_sampled=any_sampled, top_k_cap=top_k_cap,
                       top_p_rows=top_p_rows, logprobs_k=logprobs_k)
        self.next_token.index_copy_(0, slot_t, drawn.tokens)
        self.length.index_copy_(0, slot_t, position)
        self.active.index_fill_(0, slot_t, True)
        for m in members:
            self.by_slot[m.slot] = m
        self._kernels = None
        out = _outputs(drawn)
        k = int(out[2].shape[1]) if len(out) > 2 else 0
        collect(torch.cat([out[0].to(torch.float64)[:, None], out[1].to(torch.float64)[:, None]]
                          + ([out[2].to(torch.float64), out[3].to(torch.float64)] if k else []), dim=1),
                lambda values, start: self._read_first(members, values, start, 2 + 2 * k, k))

    def _read_first(self, members: list[Handle], values: list[float], start: int, width: int, k: int) -> None:
        for i, member in enumerate(members):
            at = start + i * width
            self._record(member, int(values[at]), values[at + 1],
                         [(int(values[at + 2 + k + j]), values[at + 2 + j]) for j in range(k)])

    def _score(self, group: _Prefill, hidden: torch.Tensor, first: int, collect: Callable[..., None]) -> None:
        """The prompt logprobs (and top-k) of the positions this chunk's columns predict: column c predicts c + 1."""
        prompt, n = group.prompt, int(hidden.shape[0])
        m = min(n, len(prompt) - 1 - first)  # the last prompt column predicts no prompt token
        if first == 0:
            group.scores, group.tops = [None], [None]
        if m <= 0:
            return
        logprobs = torch.log_softmax(self._logits(hidden[:m], self.adapter[group.slot:group.slot + 1].expand(m)), dim=-1)
        own = logprobs.gather(1, self._tensor(prompt[first + 1:first + 1 + m])[:, None])
        k = group.members[0].settings.prompt_topk
        parts = [own.to(torch.float64)]
        if k:
            values, ids = torch.topk(logprobs, min(k, int(logprobs.shape[-1])), dim=-1)
            k = int(values.shape[1])
            parts += [values.to(torch.float64), ids.to(torch.float64)]

        def read(values: list[float], start: int) -> None:
            width = 1 + 2 * k
            for j in range(m):
                at = start + j * width
                group.scores.append(values[at])
                if k:
                    group.tops.append([(int(values[at + 1 + k + i]), values[at + 1 + i]) for i in range(k)])

        collect(torch.cat(parts, dim=1), read)

    # ---- bookkeeping

    def _record(self, handle: Handle, token: int, logprob: float, top: list[tuple[int, float]]) -> None:
        if handle.done:
            return
        handle.tokens.append(token)
        handle.logprobs.append(logprob)
        if handle.settings.logprobs_k:
            handle.topk.append(top[:handle.settings.logprobs_k])
        if token in handle.stop_tokens:
            handle.reason = "stop"
            if self.decode_text is not None:
                handle.text = self.decode_text(handle.tokens[:-1])
            return
        if handle.stops is not None:
            cut = handle.stops.push(handle.tokens)
            if cut is not None:
                handle.reason, handle.text = "stop", handle.stops.text[:cut]
                return
        if len(handle.tokens) >= handle.settings.max_tokens:
            handle.reason = "length"

    def _leave(self, handles: list[Handle]) -> None:
        """Their slots free, their rows inactive (a device write, no sync)."""
        slots = [h.slot for h in handles if h.slot >= 0]
        if not slots:
            return
        freed = self._tensor(slots)
        self.active.index_fill_(0, freed, False)
        self.adapter.index_fill_(0, freed, -1)  # an idle row below high-water reads no adapter (its index may go)
        for handle in handles:
            if handle.slot >= 0:
                self.by_slot.pop(handle.slot, None)
                self.cache.release(handle.slot)
                handle.slot = -1
        self._kernels = None

    def _set_rows(self, slots: list[int], members: list[Handle]) -> None:
        floats, ints, adapters = [], [], []
        for member in members:
            s = member.settings
            lo, hi = split_seed(s.seed)
            floats.append([s.temperature, s.top_p])
            ints.append([s.top_k, lo, hi, member.seq_index & 0xFFFFFFFF])
            adapters.append(member.adapter)
        index = self._tensor(slots[:len(members)])
        self.floats.index_copy_(0, index, self._tensor(floats, torch.float32))
        self.ints.index_copy_(0, index, self._tensor(ints))
        self.adapter.index_copy_(0, index, self._tensor(adapters))

    def _params(self, rows: slice | torch.Tensor) -> RowParams:
        if isinstance(rows, slice):
            f, i = self.floats[rows], self.ints[rows]
        else:
            f, i = self.floats.index_select(0, rows), self.ints.index_select(0, rows)
        return RowParams(temperature=f[:, 0], top_p=f[:, 1], top_k=i[:, 0], seed_lo=i[:, 1], seed_hi=i[:, 2], seq=i[:, 3])

    def _choices(self, settings: list[DecodeSettings], rows: int, running: list[Handle] | None
                 ) -> tuple[bool, int, torch.Tensor | None, int]:
        """The sampling kernels a batch needs, from its settings (host values only)."""
        hot = [s for s in settings if s.temperature > 0]
        top_k_cap = max((s.top_k for s in hot), default=0)
        if running is not None:
            p_rows = sorted(h.slot for h in running if h.settings.temperature > 0 and h.settings.top_p < 1)
        else:
            p_rows = [i for i, s in enumerate(settings) if s.temperature > 0 and s.top_p < 1]
        logprobs_k = max((s.logprobs_k for s in settings), default=0)
        return bool(hot), top_k_cap, (self._tensor(p_rows) if p_rows else None), logprobs_k

    # ---- the model

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: Pass, adapters: torch.Tensor,
                 keys: list[str] | None) -> torch.Tensor:
        """The decoder over one pass; the final hidden states [rows, q, hidden]."""
        self.kv.plan = plan
        self.adapter_index = adapters
        self.row_keys = keys if keys is not None else [
            self.by_slot[r].key if r in self.by_slot else "" for r in range(int(adapters.shape[0]))]
        try:
            with self._routed(adapters):
                out = self.decoder(input_ids=input_ids, position_ids=positions, attention_mask=self._mask(positions, plan),
                                   use_cache=True, **{self.cache_arg: self.kv})
        finally:
            self.kv.plan = None
        hidden: torch.Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden

    def _mask(self, positions: torch.Tensor, plan: Pass) -> torch.Tensor | dict[str, torch.Tensor]:
        """[rows, 1, q, kv_len] additive: each query sees the columns at or before its position (and within the
        window, if any). A model mixing full and sliding-window layers (Gemma 2/3, GPT-OSS) gets one per layer kind,
        as the dict its decoder takes instead of building its own: every slot holds the whole sequence, and a sliding
        layer's mask reads only the window of it."""
        columns = self.columns[:plan.kv_len][None, None, :]
        at = positions[:, :, None]
        causal = columns <= at
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        low = torch.finfo(self.dtype).min
        if self.layer_kinds is not None:
            window = self.cache.window
            assert window is not None
            windowed = causal & (columns > at - window)
            return {kind: torch.where(windowed if kind == "sliding_attention" else causal, zero, low)[:, None]
                    for kind in self.layer_kinds}
        if self.cache.window is not None:
            causal = causal & (columns > at - self.cache.window)
        return torch.where(causal, zero, low)[:, None]

    def _routed(self, adapters: torch.Tensor) -> Any:
        """Each row through its key's slot of the base (compute/lora/slots.py), -1 for the base alone: read from the
        host's row keys, so routing a step reads nothing back from the device."""
        if self.routing is None or not self.adapter_keys:
            return contextlib.nullcontext()
        keys = self.row_keys
        if len(keys) != int(adapters.shape[0]):  # rows other than the forward's: their keys from the indices
            keys = [self.adapter_keys[i] if 0 <= i < len(self.adapter_keys) else "" for i in adapters.tolist()]
        routing = self.routing
        return routed_rows(routing, [routing.slot_of(key) if key else -1 for key in keys], keys)

    def _logits(self, hidden: torch.Tensor, adapters: torch.Tensor) -> torch.Tensor:
        with self._routed(adapters):  # the head may carry a run's LoRA (lm_head among its targets)
            logits: torch.Tensor = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # ---- the device

    def _tensor(self, values: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A small host list on the device: on CUDA through pinned memory, non_blocking (no stream sync)."""
        if self.device.type == "cuda":
            return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _to_host(self, packed: torch.Tensor) -> list[float]:
        """The step's one device-to-host copy."""
        if self.device.type != "cuda":
            values: list[float] = packed.tolist()
            return values
        n = int(packed.numel())
        if self._host is None or int(self._host.numel()) < n:
            self._host = torch.empty(max(n, 2 * (0 if self._host is None else int(self._host.numel()))),
                                     dtype=torch.float64, pin_memory=True)
        host = self._host[:n]
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        values = host.tolist()
        return values

    def _graphed(self, key: tuple[Any, ...], run: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """The decode pass of `key` as a CUDA graph: captured the first time (after an eager run on a side stream,
        whose results are this step's), replayed after. Its inputs are the static per-slot buffers."""
        graphed = self._graphs.get(key)
        if graphed is not None:
            graph, outputs = graphed
            graph.replay()
            return outputs
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            eager = run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            outputs = run()  # captured, not run: the eager results above are this step's
        self._graphs[key] = (graph, outputs)
        return eager


def _layer_kinds(config: Any) -> tuple[str, ...] | None:
    """The layer kinds of a model mixing full and sliding-window attention (None: one kind for every layer)."""
    kinds = tuple(sorted(set(getattr(config, "layer_types", None) or ())))
    return kinds if len(kinds) > 1 else None


def _outputs(drawn: Sampled) -> tuple[torch.Tensor, ...]:
    if drawn.top_values is not None and drawn.top_ids is not None:
        return drawn.tokens, drawn.logprobs, drawn.top_values, drawn.top_ids
    return drawn.tokens, drawn.logprobs


__all__ = ["DecodeEngine", "DecodeSettings", "Handle"]
