"""The decode engine's per-slot tables and its model passes: the decoder over one pass of the slot cache (its mask,
each row's adapter), the head, the small host-to-device copies, the step's one device-to-host copy and, on CUDA, a
pass captured as a graph. `SlotPasses` is the base the prefill (prefill.py) and the engine (engine.py) build on; it
also keeps a sequence's bookkeeping (`_record`, `_leave`), which both read."""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from gpu_runtime.compute.decode.handles import DecodeSettings, Handle, Prefill
from gpu_runtime.compute.decode.sampler import RowParams, split_seed
from gpu_runtime.compute.decode.slot_cache import Pass, SlotCache, SlotKV
from gpu_runtime.compute.lora.layer import Routing, routed_rows


class SlotPasses:
    """The per-slot tables, the model passes and the device copies of one base's decode engine."""

    def __init__(self, model: Any, cache: SlotCache, *, prefill_tokens: int = 512,
                 decode: Callable[[list[int]], str] | None = None, graphs: bool | None = None,
                 routing: Routing | None = None, fair_rows: int | None = None) -> None:
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
        self._range_params: dict[int, RowParams] = {}  # `_params` of slots [0, rows): 8 views a step otherwise
        self.layer_kinds = _layer_kinds(model.config)
        self._zero = torch.zeros((), dtype=self.dtype, device=dev)  # the masks' open value, made once
        self.adapter_index: torch.Tensor = self.adapter[:0]  # the rows' adapter slots during a forward
        self.row_keys: list[str] | None = None  # the rows' routing keys during a forward (None: from by_slot, if routed)
        self.waiting: deque[Prefill] = deque()
        self.by_slot: dict[int, Handle] = {}  # running sequences by slot
        self.steps = 0
        self.prefilled = 0  # prompt tokens prefilled so far (the caller measures its prefill speed by them)
        self.passes = 0
        self.turns = 0  # rows decoded so far, counted in the order turns.py chose them (a Handle's `turn`)
        self.rows_decoded = 0  # rows computed by decode passes so far (a pass's work, rows included that were idle)
        self.fair_rows = fair_rows  # the most rows a decode pass takes while several users decode (turns.py; None: all)
        self.ended_at: dict[str, int] = {}  # user → the step its last rows ended in (turns.FAIR_GRACE_STEPS)
        self._kernels: tuple[bool, int, torch.Tensor | None, int] | None = None  # the decode step's sampling choices
        self._graphs: dict[tuple[Any, ...], tuple[Any, tuple[torch.Tensor, ...]]] = {}
        self._graph_pool: Any = None
        self._host: torch.Tensor | None = None  # pinned buffer of the step's host copy (CUDA)

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

    def _params(self, rows: int | torch.Tensor) -> RowParams:
        """The sampling settings of slots [0, rows) (views of the tables, kept until `resize`), or of these slots."""
        if isinstance(rows, int):
            params = self._range_params.get(rows)
            if params is None:
                params = self._range_params[rows] = self._params_of(self.floats[:rows], self.ints[:rows])
            return params
        return self._params_of(self.floats.index_select(0, rows), self.ints.index_select(0, rows))

    @staticmethod
    def _params_of(f: torch.Tensor, i: torch.Tensor) -> RowParams:
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
        self.row_keys = keys  # a decode pass's are listed by `_routed`, only when it routes (a loop over its rows)
        try:
            with self._routed(adapters):
                out = self.decoder(input_ids=input_ids, position_ids=positions, attention_mask=self._mask(positions, plan),
                                   use_cache=True, **{self.cache_arg: self.kv})
        finally:
            self.kv.plan = None
        hidden: torch.Tensor = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden

    def _mask(self, positions: torch.Tensor, plan: Pass) -> torch.Tensor | dict[str, torch.Tensor | None]:
        """[rows, 1, q, kv_len] additive: each query sees the columns at or before its position (and within the
        window, if any). A model mixing full and sliding-window layers (Gemma 2/3, GPT-OSS) gets one per layer kind,
        as the dict its decoder takes instead of building its own: every slot holds the whole sequence, and a sliding
        layer's mask reads only the window of it. Linear-attention layers (Qwen3.5) get none: a prefill pass of such
        a model has no padding (prefill.py), and a decode pass's idle rows keep their state (slot_cache.py)."""
        columns = self.columns[:plan.kv_len][None, None, :]
        at = positions[:, :, None]
        causal = columns <= at
        zero = self._zero
        low = torch.finfo(self.dtype).min
        if self.layer_kinds is not None:
            window = self.cache.window
            windowed = causal & (columns > at - window) if window is not None else causal
            return {kind: None if kind == "linear_attention" else
                    torch.where(windowed if kind == "sliding_attention" else causal, zero, low)[:, None]
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
        if keys is None:  # a decode pass over slots [0, rows)
            keys = self.row_keys = [self.by_slot[r].key if r in self.by_slot else "" for r in range(int(adapters.shape[0]))]
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

