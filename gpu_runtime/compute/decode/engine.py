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

from collections.abc import Callable, Collection, Sequence
from operator import attrgetter
from typing import Any

import torch

from gpu_runtime.compute.decode.handles import DecodeSettings, Handle, Prefill, outputs
from gpu_runtime.compute.decode.prefill import Prefilling
from gpu_runtime.compute.decode.sampler import sample
from gpu_runtime.compute.decode.slot_cache import Pass
from gpu_runtime.compute.decode.text import StopText
from gpu_runtime.compute.decode.turns import Row, decode_turn, uncapped

GRAPH_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # rows buckets of the graphed decode step
GRAPH_COLUMNS = 256  # the columns a graphed step reads, rounded up to a multiple of this
_TURN_ORDER = attrgetter("turn", "slot")  # turns.decode_turn's order: least recently decoded first
_SLOT = attrgetter("slot")
_NO_TOP: list[tuple[int, float]] = []  # a row's top logprobs when none are asked (read, never written)


class DecodeEngine(Prefilling):
    # ---- the caller's side

    def add(self, prompt_ids: Sequence[int], settings: DecodeSettings, *, num_samples: int = 1,
            seq_ids: Sequence[int] | None = None, adapter: int = -1, key: str = "",
            stop_token_ids: Collection[int] = (), stop_strings: Sequence[str] = (), tag: Any = None,
            weights: int = 0, owner: str = "") -> list[Handle]:
        """Queue `num_samples` sequences continuing `prompt_ids` (one prefill for all of them). `seq_ids` are their
        sequence indices in the sampler's counter (default 0..num_samples-1), so a request's samples differ from one
        another and each repeats itself under the same seed. `weights` names the weights the rows read (an adapter and
        its version): a prompt prefix is reused only from KV those weights computed. `owner`: the user it samples for
        (passes and prefills take turns by owner, turns.py). Raises ValueError when it cannot fit a slot."""
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
        members = [Handle(prompt, settings, i, adapter, key, frozenset(stop_token_ids), stops, tag, owner=owner)
                   for i in ids]
        group = Prefill(prompt, members, salt=weights)
        for member in members:
            member.group = group
            if stops and self.decode_text is not None:
                member.stops = StopText(self.decode_text, stops)
        self.waiting.append(group)
        return list(members)  # the caller's own list: extending it must not add to the group

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
        self._range_params.clear()  # views of the tables just replaced
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
        if handle.settings.prompt_alt_k:
            out["prompt_alt_tokens"] = [[[t, v] for t, v in row] for row in handle.prompt_alts or []]
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
        self.ended_at.update((h.owner, self.steps) for h in ended)
        self._leave([h for h in ended if h.slot >= 0])
        return ended

    # ---- decode

    def _decode(self, running: list[Handle], collect: Callable[..., None]) -> None:
        if uncapped(self.fair_rows, len(running)):  # decode_turn's answer without its per-row tuples and owner sets
            order = sorted(running, key=_TURN_ORDER)
        else:
            order = [self.by_slot[slot] for slot in decode_turn(
                [Row(h.owner, h.turn, h.slot) for h in running], self.fair_rows,
                {group.members[0].owner for group in self.waiting} | self._lately())]
        turns = self.turns
        for handle in order:  # numbered in the order chosen: rows decoded together keep their order for the next turn
            turns += 1
            handle.turn = turns
        self.turns = turns
        if len(order) < len(running):
            self._decode_some(sorted(order, key=_SLOT), collect)
            return
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
        self.length[:rows].add_(active)
        self.passes += 1
        self.rows_decoded += rows
        k = int(out[2].shape[1]) if len(out) > 2 else 0
        collect(torch.cat([tokens.to(torch.float64)[:, None], logprobs.to(torch.float64)[:, None]]
                          + ([out[2].to(torch.float64), out[3].to(torch.float64)] if k else []), dim=1),
                lambda values, start: self._read_decode(running, [h.slot for h in running], values, start, 2 + 2 * k, k))

    def _decode_some(self, chosen: list[Handle], collect: Callable[..., None]) -> None:
        """A decode pass over some running rows (a turn, turns.py): gathered by slot, eager (never graphed; a cap
        applies only where rows cost time, not on CUDA), the others left as they are for a later pass."""
        slot_t = self._tensor([h.slot for h in chosen])
        length = self.length.index_select(0, slot_t)
        kv_len = min(self.cache.max_len, max(h.kv for h in chosen) + 1)
        adapters = self.adapter.index_select(0, slot_t)
        hidden = self._forward(self.next_token.index_select(0, slot_t)[:, None], length[:, None],
                               Pass(None, None, slot_t, length[:, None], kv_len), adapters, [h.key for h in chosen])
        any_sampled, top_k_cap, top_p_rows, logprobs_k = self._choices([h.settings for h in chosen], len(chosen), None)
        drawn = sample(self._logits(hidden[:, -1], adapters), self._params(slot_t), length + 1,
                       any_sampled=any_sampled, top_k_cap=top_k_cap, top_p_rows=top_p_rows, logprobs_k=logprobs_k)
        out = outputs(drawn)
        self.next_token.index_copy_(0, slot_t, out[0])
        self.length.index_copy_(0, slot_t, length + 1)
        self.passes += 1
        self.rows_decoded += len(chosen)
        k = int(out[2].shape[1]) if len(out) > 2 else 0
        collect(torch.cat([out[0].to(torch.float64)[:, None], out[1].to(torch.float64)[:, None]]
                          + ([out[2].to(torch.float64), out[3].to(torch.float64)] if k else []), dim=1),
                lambda values, start: self._read_decode(chosen, list(range(len(chosen))), values, start,
                                                        2 + 2 * k, k))

    def _decode_pass(self, rows: int, kv_len: int, any_sampled: bool, top_k_cap: int, top_p_rows: torch.Tensor | None,
                     logprobs_k: int) -> tuple[torch.Tensor, ...]:
        """The decode forward and its sampling over slots [0, rows), reading only static per-slot buffers."""
        active = self.active[:rows]
        length = self.length[:rows]
        write = torch.where(active, length, self.cache.scratch)[:, None]
        positions = length * active  # inactive rows: position 0, attending column 0
        plan = Pass(0, rows, None, write, kv_len, flat_write=self.cache.flat_write(0, write))
        hidden = self._forward(self.next_token[:rows, None], positions[:, None], plan, self.adapter[:rows], None)
        logits = self._logits(hidden[:, -1], self.adapter[:rows])
        drawn = sample(logits, self._params(rows), length + 1, any_sampled=any_sampled,
                       top_k_cap=top_k_cap, top_p_rows=top_p_rows, logprobs_k=logprobs_k)
        return outputs(drawn)

    def _read_decode(self, running: list[Handle], rows: list[int], values: list[float], start: int, width: int,
                     k: int) -> None:
        """Each handle's token from its row (`rows`, in the pass's order) of the step's host copy."""
        append, record = self.cache.append, self._record  # once per row per step: no attribute look-ups in the loop
        for handle, row in zip(running, rows):
            if handle.reason is not None:  # cancelled during this step's prefill bookkeeping: nothing more
                continue
            at = start + row * width
            append(handle.slot, handle.tokens[-1])  # the token this pass wrote (a running row has drawn one)
            handle.kv += 1
            record(handle, int(values[at]), values[at + 1],
                   [(int(values[at + 2 + k + j]), values[at + 2 + j]) for j in range(k)] if k else _NO_TOP)


__all__ = ["DecodeEngine", "DecodeSettings", "Handle"]
