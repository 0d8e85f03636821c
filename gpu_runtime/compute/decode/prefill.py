"""A decode engine's prefill: prompts at the head of the queue (the user with the fewest rows first, turns.py)
prefilled by chunks within a token budget, a prompt's
prefix reused from the slot cache (by reference from a freed slot, by an on-device copy from a live one), its
`num_samples` sequences seated in their slots, their first tokens drawn, and prompt logprobs scored (and a prompt's
alternative tokens drawn, sampler.prompt_draws) as the chunks pass."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_runtime.compute.decode.handles import Handle, Prefill, outputs
from gpu_runtime.compute.decode.passes import SlotPasses
from gpu_runtime.compute.decode.sampler import prompt_draws, sample
from gpu_runtime.compute.decode.slot_cache import Pass
from gpu_runtime.compute.decode.turns import FAIR_GRACE_STEPS, prefill_order


class Prefilling(SlotPasses):
    def _lately(self) -> set[str]:
        """Users whose rows ended within FAIR_GRACE_STEPS steps: they still count in the passes' fair shares."""
        self.ended_at = {owner: step for owner, step in self.ended_at.items() if self.steps - step <= FAIR_GRACE_STEPS}
        return set(self.ended_at)

    def _prefill(self, collect: Callable[..., None]) -> list[Handle]:
        """One chunked pass over the prompts at the head of the queue (within `prefill_tokens`); sequences whose
        prompt ends in it draw their first token. Returns them."""
        if not self.waiting:  # most steps: skip the per-row owner count below
            return []
        budget = self.prefill_tokens
        chunks: list[tuple[Prefill, int, int]] = []
        running: dict[str, int] = {}
        for handle in self.by_slot.values():
            running[handle.owner] = running.get(handle.owner, 0) + 1
        queue = list(self.waiting)
        order = prefill_order([(g.members[0].owner, g.started, len(g.members)) for g in queue], running,
                              self.fair_rows, self._lately())
        for group in (queue[i] for i in order):
            if budget <= 0:
                break
            if not group.started and not self._start(group):
                break  # no slots for it yet: it and the prompts behind it wait (fewest rows first, then first come)
            n = min(len(group.prompt) - group.filled, budget)
            chunks.append((group, group.filled, n))
            budget -= n
        if not chunks:
            return []
        if self.cache.states is not None:  # recurrent state would run through a ragged chunk's padding: one width
            width = chunks[0][2]
            chunks = [(group, f, width) for group, f, n in chunks if n >= width]
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
                        flat_write=self.cache.flat_write(slots[0], write_t))
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

    def _start(self, group: Prefill) -> bool:
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

    def _seat(self, group: Prefill) -> list[Handle]:
        """The prompt is in `group.slot`: its live members take that slot and the reserved ones (a copy of the
        prompt's KV each); returns them."""
        live = [m for m in group.members if not m.done]
        for member in group.members:
            member.group = None
            member.prompt_logprobs = group.scores if member.settings.prompt_logprobs else None
            member.prompt_topk = group.tops if member.settings.prompt_topk else None
            member.prompt_alts = group.alts if member.settings.prompt_alt_k else None
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
        out = outputs(drawn)
        k = int(out[2].shape[1]) if len(out) > 2 else 0
        collect(torch.cat([out[0].to(torch.float64)[:, None], out[1].to(torch.float64)[:, None]]
                          + ([out[2].to(torch.float64), out[3].to(torch.float64)] if k else []), dim=1),
                lambda values, start: self._read_first(members, values, start, 2 + 2 * k, k))

    def _read_first(self, members: list[Handle], values: list[float], start: int, width: int, k: int) -> None:
        for i, member in enumerate(members):
            at = start + i * width
            self._record(member, int(values[at]), values[at + 1],
                         [(int(values[at + 2 + k + j]), values[at + 2 + j]) for j in range(k)])

    def _score(self, group: Prefill, hidden: torch.Tensor, first: int, collect: Callable[..., None]) -> None:
        """The prompt logprobs (and top-k, and the alternative draws) of the positions this chunk's columns predict:
        column c predicts c + 1."""
        prompt, n = group.prompt, int(hidden.shape[0])
        m = min(n, len(prompt) - 1 - first)  # the last prompt column predicts no prompt token
        if first == 0:
            group.scores, group.tops, group.alts = [None], [None], []
        if m <= 0:
            return
        lead = group.members[0]
        logits = self._logits(hidden[:m], self.adapter[group.slot:group.slot + 1].expand(m))
        logprobs = torch.log_softmax(logits, dim=-1)
        own = logprobs.gather(1, self._tensor(prompt[first + 1:first + 1 + m])[:, None])
        k = lead.settings.prompt_topk
        parts = [own.to(torch.float64)]
        if k:
            values, ids = torch.topk(logprobs, min(k, int(logprobs.shape[-1])), dim=-1)
            k = int(values.shape[1])
            parts += [values.to(torch.float64), ids.to(torch.float64)]
        a = lead.settings.prompt_alt_k
        if a:  # keyed by the prompt's first sequence (its request's own index), as its first token's draw is
            drawn, drawn_logprobs = prompt_draws(logits, torch.arange(first + 1, first + 1 + m, device=self.device), a,
                                                 lead.settings.temperature, lead.settings.seed, lead.seq_index)
            parts += [drawn.to(torch.float64), drawn_logprobs.to(torch.float64)]

        def read(values: list[float], start: int) -> None:
            width = 1 + 2 * k + 2 * a
            for j in range(m):
                at = start + j * width
                group.scores.append(values[at])
                if k:
                    group.tops.append([(int(values[at + 1 + k + i]), values[at + 1 + i]) for i in range(k)])
                if a:
                    at += 1 + 2 * k
                    group.alts.append([(int(values[at + i]), values[at + a + i]) for i in range(a)])

        collect(torch.cat(parts, dim=1), read)
