"""Training items → datums (token level, Tinker's shape), validated, then collated into tensors.

A datum is `model_input` (N token ids) and per-position inputs of length N: position i predicts
`targets[i]`, weighted by `weights[i]`. Targets are explicit and already shifted: nothing here
shifts them again or assumes targets[i] == model_input[i + 1] (an RL datum pads its prompt with
target 0). Signal's own items (text, input/output, messages, tokens + weights) render into this
form: tokens t with weights w become model_input = t[:-1], targets = t[1:], weights = w[1:] (w[0]
weighs nothing: nothing predicts the first token). Journals written before datums (records of
{tokens, weights, extras}) render the same way (`shifted`), so they replay bitwise.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from gpu_runtime.contract.batch_items import (
    BatchItem,
    ChatItem,
    DatumItem,
    Message,
    PackedItem,
    PromptCompletion,
    TextItem,
    TokensItem,
)
from gpu_runtime.contract.custom_loss import CUSTOM_LOSS_FN, own_input
from gpu_runtime.contract.json_types import get_list, get_object
from gpu_runtime.contract.results import RenderedDatum
from gpu_runtime.contract.training_settings import (
    DATUM_INPUTS,
    MAX_SOFT_TARGETS,
    PACKED_KEY,
    PACKED_TOKENS,
    RL_LOSSES,
)
from gpu_runtime.errors import BadInput

IGNORED = -100  # a target id no position predicts: logprob 0, no gradient (torch's ignore_index)


@dataclass
class Datum:
    model_input: list[int]
    targets: list[int]
    weights: list[float] | None  # None: every position weighs 1 (RL losses: their mean counts non-zero advantages)
    inputs: dict[str, list[float]] = field(default_factory=dict)  # advantages, logprobs, clip thresholds
    # cross_entropy's soft targets, (N, K) ids and weights: position i scores Σ_k w[i][k]·logp(ids[i][k]); `targets`
    # are then IGNORED and `weights` 1 where a position has any weight (the pass adds the weighted sum in their place)
    soft_targets: list[list[int]] | None = None
    soft_weights: list[list[float]] | None = None
    shaped: dict[str, float | list[list[float]]] = field(default_factory=dict)  # a custom loss's scalars and (N, K)

    @property
    def length(self) -> int:
        return len(self.model_input)

    @property
    def cost(self) -> int:
        """Tokens the scheduler prices the row at: its input and its last target (as `tokens` items counted)."""
        return len(self.model_input) + 1

    @property
    def num_targets(self) -> int:
        """Positions that count: non-zero weight (or, without weights, non-zero advantage where there are any)."""
        if self.weights is not None:
            return sum(1 for w in self.weights if w != 0)
        if "advantages" in self.inputs:
            return sum(1 for a in self.inputs["advantages"] if a != 0)
        return len(self.targets)

    def to_dict(self) -> RenderedDatum:
        """Tinker's datum shape (what renderDatums returns and new journal records hold)."""
        inputs: dict[str, list[Any]] = {"target_tokens": list(self.targets)}
        if self.weights is not None:
            inputs["weights"] = list(self.weights)
        if self.soft_targets is not None and self.soft_weights is not None:
            inputs.update(target_tokens=[list(r) for r in self.soft_targets], weights=[list(r) for r in self.soft_weights])
        inputs.update({k: list(v) for k, v in sorted(self.inputs.items())})
        # a scalar as one value, as Tinker's wire sends it (from_dict reads a list not N long as one)
        inputs.update({k: [v] if isinstance(v, float) else [list(r) for r in v] for k, v in sorted(self.shaped.items())})
        return {"model_input": list(self.model_input), "loss_fn_inputs": inputs}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Datum:
        """A datum as `to_dict` wrote it (a journal record's; engine/journal_records.py upgrades older forms)."""
        # to_dict wrote these lists from typed ones: their items are what the types say.
        inputs = dict(get_object(data, "loss_fn_inputs"))
        targets, weights = cast(list[Any], inputs.pop("target_tokens")), cast("list[Any] | None", inputs.pop("weights", None))
        model_input = list(cast(list[int], get_list(data, "model_input")))
        if targets and isinstance(targets[0], list):  # soft targets: K ids and K weights a position
            return soft(model_input, targets, cast(list[list[float]], weights), cast(dict[str, list[float]], inputs))
        # a custom loss's scalars (one value where N differ) and (N, K) inputs (lists of rows) beside its 1-D ones
        lists = cast(dict[str, list[Any]], inputs)
        shaped = {k: v if v and isinstance(v[0], list) else float(v[0]) for k, v in lists.items()
                  if len(v) != len(model_input) or (v and isinstance(v[0], list))}
        flat = {k: v for k, v in lists.items() if k not in shaped}
        return cls(model_input, list(targets), weights, flat, shaped=shaped)


def shifted(tokens: list[int], weights: list[float], extras: dict[str, list[float]]) -> Datum:
    """Tokens with weights aligned to them as a datum: position i predicts tokens[i + 1], weighted by weights[i + 1]."""
    return Datum(list(tokens[:-1]), list(tokens[1:]), list(weights[1:]), {k: list(v[1:]) for k, v in extras.items()})


def soft(model_input: list[int], targets: list[list[int]], weights: list[list[float]],
         inputs: dict[str, list[float]]) -> Datum:
    """A datum of (N, K) soft targets: every 1-D target IGNORED, weighing 1 where a position has any weight."""
    return Datum(model_input, [IGNORED] * len(model_input), [1.0 if any(row) else 0.0 for row in weights], inputs,
                 [list(r) for r in targets], [list(r) for r in weights])


@dataclass
class Collated:
    input_ids: torch.Tensor  # [B, T] model_input, right-padded
    attention_mask: torch.Tensor
    targets: torch.Tensor  # [B, T]
    weights: torch.Tensor  # [B, T] 1 where a datum has no weights; 0 on padding
    counted: torch.Tensor  # [B, T] 1 where a position counts toward the mean of an RL loss
    extras: dict[str, torch.Tensor]  # NaN where a datum lacks the input (a clip threshold: the config's value)
    lengths: list[int]
    soft_targets: torch.Tensor | None = None  # [B, T, K] ids, IGNORED where a row has none (hard rows, padding)
    soft_weights: torch.Tensor | None = None  # [B, T, K] fp32, 0 where the id is IGNORED
    shaped: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per row: a custom loss's [] and [N, K] inputs


class Renderer:
    """Turns batch items into datums for one tokenizer and context length."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.eos_id = tokenizer.eos_token_id

    def render_batch(self, batch: Sequence[BatchItem], max_batch_size: int, loss_fn: str) -> list[Datum]:
        if not batch:
            raise BadInput("batch must be a non-empty list of items", field="batch")
        if len(batch) > max_batch_size:
            raise BadInput(f"batch has {len(batch)} items; this worker takes at most {max_batch_size}", field="batch")
        datums = [self.render_item(item, f"batch[{i}]", loss_fn) for i, item in enumerate(batch)]
        for i, datum in enumerate(datums):
            if datum.cost > self.max_length:
                raise BadInput(f"batch[{i}] is {datum.cost} tokens; the model's context is {self.max_length}",
                               field=f"batch[{i}]")
        for i, datum in enumerate(datums):
            if datum.length == 0:
                raise BadInput(f"batch[{i}] has no positions to score", field=f"batch[{i}]")
        # A datum whose weights (or advantages) are all 0 is accepted and contributes nothing: a GRPO group with
        # equal rewards has every advantage 0.
        return datums

    def render_item(self, item: BatchItem, where: str, loss_fn: str) -> Datum:
        """One item (the contract parsed and checked its shape) as a datum, its values checked against the model."""
        match item:
            case PackedItem(packed=packed):
                return self._packed_item(packed, f"{where}.{PACKED_KEY}", loss_fn)
            case DatumItem(model_input=model_input, loss_fn_inputs=inputs):
                return self._datum(model_input, inputs, where, f"{where}.loss_fn_inputs", loss_fn)
            case TokensItem():
                return self._tokens_item(item, where, loss_fn)
        if loss_fn in RL_LOSSES or loss_fn == CUSTOM_LOSS_FN:
            raise BadInput(f"loss_fn {loss_fn!r} takes token items only ({{model_input, loss_fn_inputs}} or "
                           "{tokens, logprobs, advantages})", field=where)
        match item:
            case ChatItem(messages=messages):
                return self._messages_item(messages, f"{where}.messages")
            case TextItem(text=text):
                return self._prompt_completion("", text)
            case PromptCompletion(input=str(prompt), output=str(completion)):
                return self._prompt_completion(prompt, completion)
            case PromptCompletion(input=prompt, output=completion):  # either alone is text
                return self._prompt_completion("", prompt or completion or "")
        raise BadInput(f"{where} is not a batch item", field=where)

    def _encode(self, text: str, first: bool) -> list[int]:
        # Only the first segment gets the tokenizer's own specials (BOS where the model uses one).
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    def _prompt_completion(self, prompt: str, completion: str) -> Datum:
        prompt_ids = self._encode(prompt, first=True)
        completion_ids = self._encode(completion, first=not prompt_ids)
        # EOS after the completion teaches the model to stop.
        if self.eos_id is not None and (not completion_ids or completion_ids[-1] != self.eos_id):
            completion_ids.append(self.eos_id)
        tokens = prompt_ids + completion_ids
        weights = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
        return shifted(tokens, weights, {})

    def _messages_item(self, items: list[Message], where: str) -> Datum:
        if not getattr(self.tokenizer, "chat_template", None) or not self.tokenizer.is_fast:
            raise BadInput("this model's tokenizer has no chat template; send tokens or input/output items", field=where)
        messages = [{"role": m.role, "content": m.content} for m in items]
        full = self._template(messages, generation_prompt=False)
        spans = []
        for j, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self._template(messages[:j], generation_prompt=True))
            end = len(self._template(messages[: j + 1], generation_prompt=False))
            if not full.startswith(self._template(messages[: j + 1], generation_prompt=False)) or start > end:
                raise BadInput("the chat template renders this conversation inconsistently; send tokens", field=where)
            # Train through the end-of-turn token, not the newline the template adds after it.
            eos_text = self.tokenizer.eos_token
            cut = full.find(eos_text, start, end) if eos_text else -1
            spans.append((start, cut + len(eos_text) if cut >= 0 else end))
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        tokens = list(encoded["input_ids"])
        weights = [1.0 if any(s <= a < e for s, e in spans) else 0.0 for a, _ in encoded["offset_mapping"]]
        return shifted(tokens, weights, {})

    def _template(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if not messages and not generation_prompt:
            return ""
        # tokenize=False returns the rendered text; the stub's return type covers every mode.
        return cast(str, self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))

    def _tokens_item(self, item: TokensItem, where: str, loss_fn: str) -> Datum:
        """Signal's token item: tokens with weights aligned to them (weights[i] weighs predicting tokens[i])."""
        given = item.to_dict()
        if loss_fn not in RL_LOSSES:
            for key in ("logprobs", "advantages"):
                if key in given:
                    raise BadInput(f"{where}.{key} is not a field of a token item for {loss_fn} (takes "
                                   f"{sorted({'tokens', 'weights'})})", field=f"{where}.{key}")
        tokens = item.tokens
        self._token_ids(tokens, f"{where}.tokens")
        weights = self._floats(given, "weights", where, len(tokens), "tokens", default=1.0)
        extras = {}
        if loss_fn in RL_LOSSES:
            for key in ("logprobs", "advantages"):
                if key not in given:
                    raise BadInput(f"{where}.{key} is required for {loss_fn}", field=f"{where}.{key}")
                extras[key] = self._floats(given, key, where, len(tokens), "tokens", default=0.0)
            if "weights" not in given:
                # Without a mask, the tokens that carry an advantage are the ones trained on.
                weights = [1.0 if a != 0 else 0.0 for a in extras["advantages"]]
        return shifted(tokens, weights, extras)

    def _packed_item(self, packed: dict[str, str | None], where: str, loss_fn: str) -> Datum:
        """A datum whose lists came as base64 (int32 token ids, float32 values, little-endian); checked as a datum,
        its errors naming the packed field."""
        lists: dict[str, list[float]] = {}  # int32 ids or float32 values, as the key says
        for key, value in packed.items():
            if value is None:
                continue
            try:
                raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
            except (binascii.Error, ValueError):
                raw = None
            if raw is None or len(raw) % 4:
                raise BadInput(f"{where}.{key} must be base64 of little-endian 4-byte values", field=f"{where}.{key}")
            lists[key] = np.frombuffer(raw, dtype="<i4" if key in PACKED_TOKENS else "<f4").tolist()
        inputs = {k: v for k, v in lists.items() if k != "model_input"}
        if "target_tokens" not in inputs:
            raise BadInput(f"{where}.target_tokens is required", field=f"{where}.target_tokens")
        return self._datum(lists.get("model_input"), inputs, where, where, loss_fn)

    def _datum(self, model_input: Any, inputs: Mapping[str, object], where: str, at: str, loss_fn: str) -> Datum:
        """Tinker's datum: model_input and loss_fn_inputs (`at`) of the same length N, targets already shifted."""
        if not isinstance(model_input, list) or not model_input:
            raise BadInput(f"{where}.model_input must be a non-empty list of token ids", field=f"{where}.model_input")
        for j, t in enumerate(model_input):
            if isinstance(t, dict) or (not isinstance(t, int) or isinstance(t, bool)):
                kind = t.get("type") if isinstance(t, dict) else None
                what = f"a chunk of type {kind!r}" if kind else repr(t)
                raise BadInput(f"{where}.model_input[{j}] is {what}; only token ids are taken (no image chunks)",
                               field=f"{where}.model_input[{j}]")
        self._token_ids(model_input, f"{where}.model_input")
        targets = inputs["target_tokens"]
        n = len(model_input)
        if isinstance(targets, list) and any(isinstance(t, list) for t in targets):
            return self._soft_datum(model_input, targets, inputs, at, loss_fn)
        if not isinstance(targets, list) or len(targets) != n:
            got = len(targets) if isinstance(targets, list) else type(targets).__name__
            raise BadInput(f"{at}.target_tokens must be a list as long as model_input ({n}), got {got}",
                           field=f"{at}.target_tokens")
        self._token_ids(targets, f"{at}.target_tokens")
        own = sorted(set(inputs) - set(DATUM_INPUTS))  # a custom loss's own inputs: no other loss reads them
        if own and loss_fn != CUSTOM_LOSS_FN:
            raise BadInput(f"{at}.{own[0]} is not an input of {loss_fn} (takes {list(DATUM_INPUTS)})",
                           field=f"{at}.{own[0]}")
        floats = {k: self._floats(inputs, k, at, n, "model_input") for k in DATUM_INPUTS[1:]
                  if inputs.get(k) is not None}
        shaped: dict[str, float | list[list[float]]] = {}
        for k in (k for k in own if inputs[k] is not None):  # checked against the loss's ranks by check_inputs
            value = own_input(inputs[k], n, f"{at}.{k}")
            if isinstance(value, list) and not isinstance(value[0], list):
                floats[k] = value
            else:
                shaped[k] = value
        if loss_fn in RL_LOSSES:
            for key in ("logprobs", "advantages"):
                if key not in floats:
                    raise BadInput(f"{at}.{key} is required for {loss_fn}", field=f"{at}.{key}")
        weights = floats.pop("weights", None)
        return Datum(list(model_input), list(targets), weights, floats, shaped=shaped)

    def _soft_datum(self, model_input: list[int], targets: list[Any], inputs: Mapping[str, object], at: str,
                    loss_fn: str) -> Datum:
        """cross_entropy's (N, K) target_tokens with (N, K) weights (a teacher's top-K); no other input goes with them."""
        n, weights = len(model_input), inputs.get("weights")
        if loss_fn != "cross_entropy":
            raise BadInput(f"{at}.target_tokens: (N, K) soft targets are cross_entropy's; {loss_fn} takes 1-D",
                           field=f"{at}.target_tokens")
        others = sorted(k for k in inputs if k not in ("target_tokens", "weights") and inputs[k] is not None)
        if others:
            raise BadInput(f"{at}.{others[0]} does not go with (N, K) soft targets", field=f"{at}.{others[0]}")
        width = len(targets[0]) if isinstance(targets[0], list) else 0
        if len(targets) != n or not 1 <= width <= MAX_SOFT_TARGETS or \
                any(not isinstance(row, list) or len(row) != width for row in targets):
            raise BadInput(f"{at}.target_tokens must be (N, K) with N = len(model_input) ({n}) and K in "
                           f"1..{MAX_SOFT_TARGETS}, every row of K ids", field=f"{at}.target_tokens")
        if not isinstance(weights, list) or len(weights) != n or \
                any(not isinstance(row, list) or len(row) != width for row in weights):
            raise BadInput(f"{at}.weights must be (N, K) like target_tokens ({n}, {width})", field=f"{at}.weights")
        for row in targets:
            self._token_ids(row, f"{at}.target_tokens")
        for row in weights:
            for v in row:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise BadInput(f"{at}.weights must hold finite numbers, got {v!r}", field=f"{at}.weights")
        return soft(list(model_input), targets, [[float(v) for v in row] for row in weights], {})

    def _token_ids(self, ids: list[Any], where: str) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise BadInput(f"{where} must hold integers, got {t!r}", field=where)
            if not 0 <= t < self.vocab_size:
                raise BadInput(f"{where} has id {t} outside the vocabulary (0..{self.vocab_size - 1})", field=where)

    def _floats(self, item: Mapping[str, object], key: str, where: str, length: int, along: str,
                default: float = 0.0) -> list[float]:
        if key not in item:
            return [default] * length
        values = item[key]
        if isinstance(values, list) and any(isinstance(v, list) for v in values):
            raise BadInput(f"{where}.{key} must be 1-D (one value per position), not 2-D", field=f"{where}.{key}")
        if not isinstance(values, list) or len(values) != length:
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise BadInput(f"{where}.{key} must be a list as long as {along} ({length}), got {got}",
                           field=f"{where}.{key}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadInput(f"{where}.{key} must hold finite numbers, got {v!r}", field=f"{where}.{key}")
        return [float(v) for v in values]


def collate(datums: list[Datum], device: torch.device) -> Collated:
    """Right-pad every datum to the longest; padding weighs 0 and counts for nothing. Built in two host buffers (ids,
    values), each copied to the device once, from pinned memory and without blocking where the device is a GPU."""
    width = max(d.length for d in datums)
    rows = len(datums)
    extra_names = sorted({k for d in datums for k in d.inputs})
    ids = np.zeros((3, rows, width), dtype=np.int64)  # input_ids, attention_mask, targets
    values = np.zeros((2 + len(extra_names), rows, width), dtype=np.float32)  # weights, counted, extras…
    values[2:] = math.nan  # NaN where a datum lacks the input (a clip threshold: the config's value)
    with np.errstate(over="ignore"):  # a finite float64 past fp32's range becomes inf, as torch's cast does
        _fill(datums, extra_names, ids, values)
    ids_d, values_d = host_to_device(torch.from_numpy(ids), device), host_to_device(torch.from_numpy(values), device)
    data = Collated(ids_d[0], ids_d[1], ids_d[2], values_d[0], values_d[1],
                    {k: values_d[2 + j] for j, k in enumerate(extra_names)}, [d.length for d in datums])
    if any(d.soft_targets is not None for d in datums):
        data.soft_targets, data.soft_weights = _soft(datums, width, device)
    if any(d.shaped for d in datums):
        data.shaped = _shaped(datums, device)
    return data


def _shaped(datums: list[Datum], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Each row's scalar and (N, K) inputs as views of one fp32 buffer, copied to the device once."""
    arrays = [(i, k, np.asarray(v, dtype=np.float32)) for i, d in enumerate(datums) for k, v in sorted(d.shaped.items())]
    flat = host_to_device(torch.from_numpy(np.concatenate([a.reshape(-1) for _, _, a in arrays])), device)
    out: list[dict[str, torch.Tensor]] = [{} for _ in datums]
    start = 0
    for i, k, a in arrays:
        out[i][k] = flat[start:start + a.size].view(a.shape)
        start += a.size
    return out


def _soft(datums: list[Datum], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' soft targets as [B, T, K] ids and weights, K the widest row's; IGNORED with weight 0 elsewhere."""
    k = max(len(d.soft_targets[0]) for d in datums if d.soft_targets)
    ids = np.full((len(datums), width, k), IGNORED, dtype=np.int64)
    weights = np.zeros((len(datums), width, k), dtype=np.float32)
    for i, d in enumerate(datums):
        if d.soft_targets is not None and d.soft_weights is not None:
            kd = len(d.soft_targets[0])
            ids[i, :d.length, :kd] = d.soft_targets
            weights[i, :d.length, :kd] = d.soft_weights
    return host_to_device(torch.from_numpy(ids), device), host_to_device(torch.from_numpy(weights), device)


def _fill(datums: list[Datum], extra_names: list[str], ids: np.ndarray, values: np.ndarray) -> None:
    weights, counted = values[0], values[1]
    for i, datum in enumerate(datums):
        n = datum.length
        ids[0, i, :n] = datum.model_input
        ids[1, i, :n] = 1
        ids[2, i, :n] = datum.targets
        for j, k in enumerate(extra_names):
            if k in datum.inputs:
                values[2 + j, i, :n] = datum.inputs[k]
            values[2 + j, i, n:] = 0.0  # padding: finite, weight 0
        if datum.weights is not None:
            weights[i, :n] = datum.weights
            counted[i, :n] = weights[i, :n] != 0
        else:
            weights[i, :n] = 1.0
            if "advantages" in datum.inputs:
                counted[i, :n] = values[2 + extra_names.index("advantages"), i, :n] != 0
            else:
                counted[i, :n] = 1.0


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host buffer on the device: pinned and asynchronous to a GPU (the copy queues behind the work before it)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def rows(data: Collated, span: slice) -> Collated:
    """The rows `span` of a collated batch."""
    return Collated(data.input_ids[span], data.attention_mask[span], data.targets[span], data.weights[span],
                    data.counted[span], {k: v[span] for k, v in data.extras.items()}, data.lengths[span],
                    None if data.soft_targets is None else data.soft_targets[span],
                    None if data.soft_weights is None else data.soft_weights[span], data.shaped[span])
