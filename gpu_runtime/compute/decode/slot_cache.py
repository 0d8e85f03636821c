"""A preallocated KV cache of slots for one base, usable by transformers' models as their `Cache`.

One tensor holds every layer's keys and values: [layers, 2, slots, kv_heads, max_len, head_dim] in the model's dtype,
sized from a byte budget (on CUDA, without one, from a fraction of `torch.cuda.mem_get_info`'s free bytes). A
sequence holds one slot from its prefill to its end (`acquire`/`release`); sequences join and leave at any step with
no re-padding, stacking or copying of other sequences' KV.

A pass writes through `SlotKV`, a `Cache` whose layers' `update` scatter each row's new keys and values at that
row's own positions and hand attention a view of the buffers: the decode batch is slots [0, high-water) read as
`storage[layer, k|v, 0:rows, :, 0:kv_len]` with a per-row mask (as gpt-fast attends over a static cache), never a
concatenation. A prefill pass over slots that are not one range reads `storage[..., slots, :, 0:kv_len]`, a gather
of its rows' columns only (its attention is already rows x columns x columns). Column max_len - 1 of every slot is
scratch: rows of a batch that are not decoding (free slots, prompts still prefilling) and the padding of a ragged
prefill chunk write there, and no mask reads it, so sequences hold at most max_len - 1 tokens.

Prompt prefixes: the slots remember the tokens whose KV they hold, live or freed (a freed slot keeps its KV until it
is taken again, least recently freed first), indexed by the hash of every 16-token block prefix, a chain seeded by
the slot's `salt`: the weights that computed its KV (another adapter's KV of the same tokens is not the same). `match` finds the
slot sharing the longest prefix with a prompt; a freed slot is taken as it is (by reference, no copy), a live one's
prefix is copied into the new slot in one on-device copy across all layers (`copy_prefix`).

Families: full attention everywhere, one sliding window on every layer (Mistral), or both kinds mixed (Gemma 2/3,
GPT-OSS, Qwen2 with max_window_layers, Cohere 2): a window is a mask over the full-length slot, so the slot holds the
whole sequence, and the engine hands a mixed model one mask per layer kind. Hybrid models (Qwen3.5: Gated DeltaNet
layers between full-attention ones) hold KV for their attention layers only and, per slot, the linear layers'
recurrent state (recurrent.py); for them no cached prefix is looked for (`match`). Refused, with a reason from
`refusal`: other recurrent layers, encoder-decoders, and attention implementations other than sdpa and eager
(flash-attention takes no 4D mask); no family of the catalogue is among them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from gpu_runtime.compute.decode.recurrent import RECURRENT_KINDS, SlotStates, missing_fields, recurrent_layers

BLOCK = 16  # prefix hashes every BLOCK tokens; a shared prefix shorter than one block is not looked for
DEFAULT_MEMORY_FRACTION = 0.4  # of the device's free bytes, when no budget is given on CUDA


def refusal(config: Any) -> str | None:
    """Why a model with this config cannot decode on a slot cache (None: it can)."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models keep a cross-attention cache: not a slot cache"
    layer_types = getattr(config, "layer_types", None)
    kinds = set(layer_types) if layer_types else {"full_attention"}
    other = kinds - {"full_attention", "sliding_attention"} - RECURRENT_KINDS
    if other:
        return f"layers of kind {sorted(other)} (linear attention or recurrent state) are not a KV cache of slots"
    missing = missing_fields(config) if kinds & RECURRENT_KINDS else []
    if missing:
        return f"linear-attention layers with no Gated DeltaNet state shape in the config (no {', '.join(missing)})"
    if "sliding_attention" in kinds and len(kinds) > 1 and not getattr(config, "sliding_window", None):
        return "sliding-window layers with no sliding_window in the config"
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} takes no 4D mask: load the model with sdpa or eager"
    if getattr(config, "num_hidden_layers", None) is None or getattr(config, "num_attention_heads", None) is None:
        return "the config names no num_hidden_layers or num_attention_heads"
    return None


def sliding_window(config: Any) -> int | None:
    """The one window every layer attends within (None: full attention)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers holding KV, kv_heads, head_dim) of a decoder config: a hybrid model's linear layers hold none."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return int(config.num_hidden_layers) - len(recurrent_layers(config)), kv_heads, head_dim


@dataclass
class Pass:
    """What one forward writes and reads: its rows (a range of slots, or slot indices), the column each of its query
    tokens writes (`write` [rows, q]; scratch for rows and tokens that do not count) and the columns read."""

    start: int | None  # rows are slots [start, stop) ...
    stop: int | None
    slots: torch.Tensor | None  # ... or these slots, [rows] int64 on the device
    write: torch.Tensor  # [rows, q] int64
    kv_len: int
    flat_write: torch.Tensor | None = None  # range passes: `write` as rows of a layer's flat view (SlotCache.flat_write)


class SlotLayer(CacheLayerMixin):
    """One decoder layer's view of the slot cache; `update` writes and reads through the owner's current pass."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: SlotKV, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init__ unannotated
        self.owner, self.layer = owner, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.write_read(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        plan = self.owner.plan
        return (plan.kv_len if plan is not None else query_length), 0

    def get_seq_length(self) -> int:
        plan = self.owner.plan
        return plan.kv_len if plan is not None else 0

    def get_max_length(self) -> int:
        return self.owner.slots.max_len


class SlotKV(Cache):
    """The slot cache as transformers' `Cache` for one pass at a time (`plan`, set by the engine before the forward).
    A hybrid model's linear layers read and write their rows' recurrent state through the methods transformers'
    Gated DeltaNet calls (`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`)."""

    def __init__(self, slots: SlotCache) -> None:
        self.slots = slots
        self.plan: Pass | None = None
        self._states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a linear layer's rows' states in this pass
        super().__init__(layers=[SlotLayer(self, i) for i in slots.kv_index])

    # ---- a hybrid model's linear layers: the conv state is read first, the recurrent state written last

    def _rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        states = self._states.get(layer)
        if states is None:
            plan, store = self.plan, self.slots.states
            assert plan is not None and store is not None, "recurrent state read outside a pass"
            states = self._states[layer] = store.read(layer, plan.start, plan.stop, plan.slots)
        return states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._rows(layer_idx)[0]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._rows(layer_idx)[1]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
                          ) -> torch.Tensor:
        """A prefill chunk: the conv sees the rows' last `kernel` inputs before it; they keep the chunk's last ones."""
        conv, recurrent = self._rows(layer_idx)
        full = torch.cat([conv, conv_states.to(conv.dtype)], dim=-1)
        self._states[layer_idx] = (full[..., -int(conv.shape[-1]):], recurrent)
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        plan, store = self.plan, self.slots.states
        assert plan is not None and store is not None
        conv, _ = self._states.pop(layer_idx)
        keep = plan.write[:, 0] != self.slots.scratch  # a decode pass's idle rows write the scratch column
        store.write(layer_idx, plan.start, plan.stop, plan.slots, keep, conv, recurrent_states)
        return recurrent_states

    def write_read(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        assert plan is not None, "SlotKV used outside a pass"
        keys, values, flat_keys, flat_values = self.slots.views[layer]  # [slots, kv_heads, max_len, dim], and flat
        if key_states.dtype != keys.dtype:
            key_states, value_states = key_states.to(keys.dtype), value_states.to(keys.dtype)
        if plan.slots is None:
            assert plan.flat_write is not None
            # One index_copy_ of whole head_dim rows: half a scatter_'s cost per layer at 64 rows (element-wise index).
            dim = int(key_states.shape[-1])
            flat_keys.index_copy_(0, plan.flat_write, key_states.reshape(-1, dim))
            flat_values.index_copy_(0, plan.flat_write, value_states.reshape(-1, dim))
            return (keys[plan.start:plan.stop].narrow(2, 0, plan.kv_len),
                    values[plan.start:plan.stop].narrow(2, 0, plan.kv_len))
        rows = plan.slots[:, None]
        keys[rows, :, plan.write] = key_states.transpose(1, 2)  # [rows, q, kv_heads, dim] at (slot, column)
        values[rows, :, plan.write] = value_states.transpose(1, 2)
        return keys[plan.slots, :, :plan.kv_len], values[plan.slots, :, :plan.kv_len]


class SlotCache:
    """The slots of one base: storage, which are free, and which tokens' KV each holds (for prefix reuse)."""

    def __init__(self, config: Any, max_len: int, *, budget_bytes: int | None = None, slots: int | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> None:
        reason = refusal(config)
        if reason is not None:
            raise ValueError(f"no slot cache for this model: {reason}")
        self.device = torch.device(device)
        self.layers, self.kv_heads, self.head_dim = kv_shape(config)
        linear = set(recurrent_layers(config))
        attention = [i for i in range(int(config.num_hidden_layers)) if i not in linear]
        self.kv_index = [attention.index(i) if i in attention else -1 for i in range(int(config.num_hidden_layers))]
        self.max_len = max_len
        self.window = sliding_window(config)
        self.slot_bytes = self.layers * 2 * self.kv_heads * max_len * self.head_dim * torch.empty((), dtype=dtype).element_size()
        self.states: SlotStates | None = None
        if linear:
            self.states = SlotStates(config, 0, dtype, self.device)
            self.slot_bytes += self.states.slot_bytes
        if budget_bytes is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget_bytes = int(free * memory_fraction)
        if slots is None:
            if budget_bytes is None:
                raise ValueError("give slots or budget_bytes (on CUDA the free memory sizes it)")
            slots = budget_bytes // self.slot_bytes
        elif budget_bytes is not None:
            slots = min(slots, budget_bytes // self.slot_bytes)
        if slots < 1:
            raise ValueError(f"a budget of {budget_bytes} bytes holds no slot of {self.slot_bytes} bytes "
                             f"(max_len {max_len})")
        self.count = int(slots)
        self.budget_bytes = budget_bytes
        self.storage = torch.zeros(self.layers, 2, self.count, self.kv_heads, max_len, self.head_dim,
                                   dtype=dtype, device=self.device)
        if self.states is not None:
            self.states.resize(self.count)
        self.scratch = max_len - 1
        self._viewed()
        self.live = [False] * self.count
        self._clean: list[int] = list(range(self.count))  # free and holding nothing: a heap, lowest first
        self._cached: OrderedDict[int, None] = OrderedDict()  # free and holding KV: least recently freed first
        self.tokens: list[list[int]] = [[] for _ in range(self.count)]  # whose KV each slot holds, in order
        self._hashes: list[list[int]] = [[] for _ in range(self.count)]  # prefix hash at each full block
        self.salts: list[int] = [0] * self.count  # the weights each slot's KV was computed with
        self._index: dict[int, set[int]] = {}  # block prefix hash -> slots holding that prefix

    def flat_write(self, start: int, write: torch.Tensor) -> torch.Tensor:
        """A range pass's `write` [rows, q] (rows are slots start..) as indices into a layer's keys or values viewed
        [slots * kv_heads * max_len, dim], in the order of key_states [rows, kv_heads, q, dim] flattened: computed once
        a pass, read by every layer."""
        return (self._row_heads[start:start + int(write.shape[0])] + write[:, None, :]).reshape(-1)

    def _viewed(self) -> None:
        """Each layer's keys and values views of `storage` (also flat, [slots * kv_heads * max_len, dim]) and where
        each (slot, kv head) starts in the flat ones: made once per storage, not per layer per pass."""
        heads = torch.arange(self.count * self.kv_heads, dtype=torch.int64, device=self.device) * self.max_len
        self._row_heads = heads.view(self.count, self.kv_heads, 1)
        self.views = [(self.storage[i, 0], self.storage[i, 1], self.storage[i, 0].view(-1, self.head_dim),
                       self.storage[i, 1].view(-1, self.head_dim)) for i in range(self.layers)]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def free(self) -> int:
        return len(self._clean) + len(self._cached)

    def high_water(self) -> int:
        """One past the highest live slot (0: none)."""
        for slot in range(self.count - 1, -1, -1):
            if self.live[slot]:
                return slot + 1
        return 0

    def acquire(self, salt: int = 0) -> int:
        """A free slot for KV of weights `salt`: the lowest one holding nothing, else the least recently freed (its KV
        forgotten)."""
        if self._clean:
            slot = heapq.heappop(self._clean)
        elif self._cached:
            slot, _ = self._cached.popitem(last=False)
            self.truncate(slot, 0)
        else:
            raise RuntimeError("no free slot")
        self.live[slot] = True
        self.salts[slot] = salt
        if self.states is not None:
            self.states.zero(slot)
        return slot

    def take(self, slot: int) -> None:
        """Acquire this freed slot with its KV (a prefix reused by reference)."""
        assert not self.live[slot] and slot in self._cached
        del self._cached[slot]
        self.live[slot] = True

    def release(self, slot: int) -> None:
        """Free `slot`; its KV stays for prefix reuse until the slot is taken again."""
        assert self.live[slot]
        self.live[slot] = False
        if self.tokens[slot]:
            self._cached[slot] = None
        else:
            heapq.heappush(self._clean, slot)

    def truncate(self, slot: int, length: int) -> None:
        """The slot holds only its first `length` tokens' KV from now on."""
        del self.tokens[slot][length:]
        hashes = self._hashes[slot]
        for h in hashes[length // BLOCK:]:
            holders = self._index.get(h)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._index[h]
        del hashes[length // BLOCK:]

    def extend(self, slot: int, tokens: Sequence[int]) -> None:
        """The KV of `tokens` was written after what the slot held."""
        self.tokens[slot].extend(tokens)
        self._index_blocks(slot)

    def append(self, slot: int, token: int) -> None:
        """`extend` by one token (a decode step's, once per row): the block index only when a block fills."""
        held = self.tokens[slot]
        held.append(token)
        if len(held) >= (len(self._hashes[slot]) + 1) * BLOCK:
            self._index_blocks(slot)

    def _index_blocks(self, slot: int) -> None:
        """Hash the slot's full blocks not yet indexed."""
        held, hashes = self.tokens[slot], self._hashes[slot]
        while (len(hashes) + 1) * BLOCK <= len(held):
            k = len(hashes)
            h = hash((hashes[-1] if hashes else self.salts[slot], tuple(held[k * BLOCK:(k + 1) * BLOCK])))
            hashes.append(h)
            self._index.setdefault(h, set()).add(slot)

    def match(self, prompt: Sequence[int], most: int, salt: int = 0) -> tuple[int, int]:
        """(slot, n): a slot (live or freed) whose first n tokens' KV, computed by weights `salt`, are the prompt's
        first n, n <= `most` and as large as any slot offers; (-1, 0) when no slot shares a whole block."""
        if self.states is not None:
            return -1, 0  # a slot's recurrent state is its whole sequence's, no prefix's: nothing to reuse
        h, found = salt, -1
        candidates: set[int] = set()
        for k in range(min(len(prompt), most) // BLOCK):
            h = hash((h, tuple(prompt[k * BLOCK:(k + 1) * BLOCK])))
            holders = self._index.get(h)
            if not holders:
                break
            candidates, found = holders, k
        if found < 0:
            return -1, 0
        best, best_n = -1, 0
        for slot in sorted(candidates, key=lambda s: (self.live[s], s))[:4]:  # freed first: reused without a copy
            held = self.tokens[slot]
            limit = min(len(held), most, len(prompt))
            n = 0
            while n < limit and held[n] == prompt[n]:
                n += 1
            if n > best_n:
                best, best_n = slot, n
        return best, best_n

    def resize(self, slots: int, max_len: int) -> None:
        """At least `slots` slots of at least `max_len` columns: a new storage with every slot's KV copied in (the
        old scratch column left behind), so live sequences and the prefix index stay as they were."""
        slots, max_len = max(slots, self.count), max(max_len, self.max_len)
        if slots == self.count and max_len == self.max_len:
            return
        storage = torch.zeros(self.layers, 2, slots, self.kv_heads, max_len, self.head_dim, dtype=self.storage.dtype,
                              device=self.device)
        storage[:, :, :self.count, :, :self.scratch].copy_(self.storage[:, :, :, :, :self.scratch])
        self.storage = storage
        state = self.states.slot_bytes if self.states is not None else 0
        self.slot_bytes = (self.slot_bytes - state) // self.max_len * max_len + state
        if self.states is not None:
            self.states.resize(slots)
        for slot in range(self.count, slots):
            heapq.heappush(self._clean, slot)
        self.live += [False] * (slots - self.count)
        self.tokens += [[] for _ in range(slots - self.count)]
        self._hashes += [[] for _ in range(slots - self.count)]
        self.salts += [0] * (slots - self.count)
        self.count, self.max_len, self.scratch = slots, max_len, max_len - 1
        self._viewed()

    def copy_prefix(self, source: int, target: int, n: int) -> None:
        """The first n columns of `source`'s KV into `target`, every layer, keys and values: one on-device copy. A
        hybrid model's recurrent state is copied whole: it is that of `source`'s n tokens only when it holds n."""
        self.storage[:, :, target, :, :n].copy_(self.storage[:, :, source, :, :n])
        if self.states is not None:
            self.states.copy(source, torch.tensor([target], dtype=torch.int64, device=self.device))
        self.truncate(target, 0)
        self.salts[target] = self.salts[source]
        self.extend(target, self.tokens[source][:n])

    def copy_prefix_many(self, source: int, targets: Sequence[int], n: int) -> None:
        """`copy_prefix` into several slots at once (a prompt's samples): one on-device copy for all of them."""
        if not targets:
            return
        if len(targets) == 1:
            self.copy_prefix(source, targets[0], n)
            return
        index = torch.tensor(list(targets), dtype=torch.int64, pin_memory=self.device.type == "cuda").to(
            self.device, non_blocking=True)
        view = self.storage[:, :, :, :, :n]
        view.index_copy_(2, index, view[:, :, source:source + 1].expand(-1, -1, len(targets), -1, -1, -1))
        if self.states is not None:
            self.states.copy(source, index)
        held = self.tokens[source][:n]
        for target in targets:
            self.truncate(target, 0)
            self.salts[target] = self.salts[source]
            self.extend(target, held)
