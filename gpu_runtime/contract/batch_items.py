"""A batch's items as types: text, a prompt/completion pair, a chat, tokens with weights, Tinker's datum, a packed
datum. `BatchItem` is their union; the runtime's renderer (gpu_runtime/compute/batches.py) matches on it.

JSON becomes an item in one place, `item_from_dict` (which key set is which item); GraphQL's typed input builds
items directly. `check(where)` holds the checks that need no model (strings, non-empty, a chat's roles), naming the
field (`batch[3].messages[0].role`); checks of values against the model (token ids in the vocabulary, lists as long
as the tokens, finite numbers, base64) stay in the renderer, so the server never walks a batch's token lists.
`to_dict` writes an item back as it came: the batch's hash and a call's body hash read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gpu_runtime.contract.checks import check_text
from gpu_runtime.contract.custom_loss import INPUT_NAME, MAX_INPUTS
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.training_settings import DATUM_INPUTS, DATUM_KEYS, PACKED_KEY, PACKED_TOKENS, TEXT_KEYS, TOKEN_KEYS
from gpu_runtime.errors import BadInput

ROLES = frozenset({"system", "user", "assistant", "tool"})
PACKED_FIELDS = ("model_input", *DATUM_INPUTS)


def _string(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise BadInput(f"{where} must be a string", field=where)
    check_text(value, where)


def _nonempty(value: str, where: str) -> None:
    if not value:
        raise BadInput(f"{where} is empty", field=where)


@dataclass(frozen=True)
class TextItem:
    """Loss on every token."""

    text: str

    def check(self, where: str) -> None:
        _string(self.text, f"{where}.text")
        _nonempty(self.text, f"{where}.text")

    def to_dict(self) -> JSONObject:
        return {"text": self.text}


@dataclass(frozen=True)
class PromptCompletion:
    """A prompt and its completion, loss on the completion; either alone is text (loss on every token)."""

    input: str | None = None
    output: str | None = None

    def check(self, where: str) -> None:
        for key, value in self._given():
            _string(value, f"{where}.{key}")
        if self.input is not None and self.output is not None:
            _nonempty(self.output, f"{where}.output")
        else:
            for key, value in self._given():
                _nonempty(value, f"{where}.{key}")

    def _given(self) -> list[tuple[str, str]]:
        return [(k, v) for k, v in (("input", self.input), ("output", self.output)) if v is not None]

    def to_dict(self) -> JSONObject:
        return dict(self._given())


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatItem:
    """A conversation; loss on the assistant turns."""

    messages: list[Message]

    def check(self, where: str) -> None:
        at = f"{where}.messages"
        if not self.messages:
            raise BadInput(f"{at} must be a non-empty list of {{role, content}}", field=at)
        for j, message in enumerate(self.messages):
            if not isinstance(message.role, str) or message.role not in ROLES:
                raise BadInput(f"{at}[{j}].role must be one of {sorted(ROLES)}", field=f"{at}[{j}].role")
            check_text(message.role, f"{at}[{j}].role")
            _string(message.content, f"{at}[{j}].content")
        if not any(m.role == "assistant" for m in self.messages):
            raise BadInput(f"{at} has no assistant turn to train on", field=at)

    def to_dict(self) -> JSONObject:
        return {"messages": [{"role": m.role, "content": m.content} for m in self.messages]}


@dataclass(frozen=True)
class TokensItem:
    """Token ids with per-token lists aligned to them (weights[i] weighs predicting tokens[i]); the RL losses take
    the sampler's logprobs and the advantages."""

    KEYS: ClassVar[tuple[str, ...]] = ("tokens", "weights", "logprobs", "advantages")
    tokens: list[int]
    weights: list[float] | None = None
    logprobs: list[float] | None = None
    advantages: list[float] | None = None

    def check(self, where: str) -> None:
        if not isinstance(self.tokens, list) or len(self.tokens) < 2:
            raise BadInput(f"{where}.tokens must be a list of at least 2 token ids", field=f"{where}.tokens")

    def to_dict(self) -> JSONObject:
        return {k: v for k in self.KEYS if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class DatumItem:
    """Tinker's datum: model_input (N ids) and per-position loss inputs of length N, targets already shifted."""

    model_input: list[int]
    loss_fn_inputs: dict[str, list[Any]]  # DATUM_INPUTS by name: target_tokens (ids), the rest numbers

    def check(self, where: str) -> None:
        if not isinstance(self.model_input, list) or not self.model_input:
            raise BadInput(f"{where}.model_input must be a non-empty list of token ids", field=f"{where}.model_input")

    def to_dict(self) -> JSONObject:
        return {"model_input": self.model_input, "loss_fn_inputs": self.loss_fn_inputs}


@dataclass(frozen=True)
class PackedItem:
    """A datum whose lists are base64 (little-endian int32 token ids, float32 values): one string per list."""

    packed: dict[str, str | None]  # PACKED_FIELDS by name

    def check(self, where: str) -> None:
        """The base64 is the renderer's to read (it runs once, in the runtime)."""

    def to_dict(self) -> JSONObject:
        return {PACKED_KEY: self.packed}


BatchItem = TextItem | PromptCompletion | ChatItem | TokensItem | DatumItem | PackedItem
BATCH_ITEMS = (TextItem, PromptCompletion, ChatItem, TokensItem, DatumItem, PackedItem)


def item_from_dict(item: Any, where: str) -> BatchItem:
    """The item a JSON object is, by its keys; checked (`check`). Wrong keys name the first one that is wrong."""
    if not isinstance(item, dict) or not item:
        raise BadInput(f"{where} must be a non-empty object", field=where)
    parsed = _parsed(item, where)
    parsed.check(where)
    return parsed


def _parsed(item: dict[str, Any], where: str) -> BatchItem:
    keys = set(item)
    if keys == {PACKED_KEY}:
        return _packed(item[PACKED_KEY], f"{where}.{PACKED_KEY}")
    if keys & DATUM_KEYS:
        for key in item:
            if key not in DATUM_KEYS:
                raise BadInput(f"{where}.{key} is not a field of a datum (takes model_input, loss_fn_inputs)",
                               field=f"{where}.{key}")
        return DatumItem(item.get("model_input"), _loss_inputs(item.get("loss_fn_inputs"), f"{where}.loss_fn_inputs"))  # type: ignore[arg-type]  # check() names a model_input that is not a list
    if "tokens" in keys:
        for key in item:
            if key not in TOKEN_KEYS:
                raise BadInput(f"{where}.{key} is not a field of a token item (takes {sorted(TOKEN_KEYS)})",
                               field=f"{where}.{key}")
        return TokensItem(**item)
    if keys not in TEXT_KEYS:
        unknown = sorted(keys - {"text", "input", "output", "messages"})
        key = unknown[0] if unknown else sorted(keys)[0]
        raise BadInput(
            f"{where} has keys {sorted(keys)}; an item is one of {{text}}, {{input, output}}, {{messages}}, "
            "{tokens, weights}, {model_input, loss_fn_inputs}",
            field=f"{where}.{key}",
        )
    if keys == {"messages"}:
        return ChatItem(_messages(item["messages"], f"{where}.messages"))
    if keys == {"text"}:
        return TextItem(item["text"])
    return PromptCompletion(item.get("input"), item.get("output"))


def _messages(messages: Any, where: str) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise BadInput(f"{where} must be a non-empty list of {{role, content}}", field=where)
    parsed = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise BadInput(f"{where}[{j}] must be exactly {{role, content}}", field=f"{where}[{j}]")
        parsed.append(Message(message["role"], message["content"]))
    return parsed


def _loss_inputs(inputs: Any, where: str) -> dict[str, list[Any]]:
    if not isinstance(inputs, dict):
        raise BadInput(f"{where} must be an object with target_tokens", field=where)
    # Other names are a custom loss's own inputs (the renderer refuses them for every other loss), bounded as its
    unknown = sorted(k for k in set(inputs) - set(DATUM_INPUTS)
                     if not (isinstance(k, str) and INPUT_NAME.fullmatch(k)))
    if unknown or len(set(inputs) - set(DATUM_INPUTS)) > MAX_INPUTS:
        name = unknown[0] if unknown else sorted(set(inputs) - set(DATUM_INPUTS))[-1]
        raise BadInput(f"{where}.{name} is not a loss input (takes {list(DATUM_INPUTS)}, and a custom loss's own "
                       f"inputs: at most {MAX_INPUTS} lowercase names)", field=f"{where}.{name}")
    if "target_tokens" not in inputs:
        raise BadInput(f"{where}.target_tokens is required", field=f"{where}.target_tokens")
    return inputs


def _packed(packed: Any, where: str) -> PackedItem:
    if not isinstance(packed, dict):
        raise BadInput(f"{where} must be an object of base64 lists", field=where)
    for key in packed:
        if key not in PACKED_FIELDS:
            raise BadInput(f"{where}.{key} is not a field of a packed datum", field=f"{where}.{key}")
    return PackedItem(packed)


def batch_from_dicts(batch: Any) -> list[BatchItem]:
    """A batch as JSON carries it (the SDK's, Tinker's and the runtime's wire), as items; each error names its item."""
    if not isinstance(batch, list) or not batch:
        raise BadInput("batch must be a non-empty list of examples", field="batch")
    return [item_from_dict(item, f"batch[{i}]") for i, item in enumerate(batch)]


def batch_to_dicts(batch: Sequence[BatchItem]) -> list[JSONObject]:
    return [item.to_dict() for item in batch]


def known_tokens(item: BatchItem) -> int:
    """The tokens of a token item (tokens, model_input, packed), counted without a tokenizer; text counts 0."""
    match item:
        case TokensItem(tokens=ids) | DatumItem(model_input=ids):
            return len(ids) if isinstance(ids, list) else 0
        case PackedItem(packed=packed) if isinstance(packed.get(PACKED_TOKENS[0]), str):
            return len(str(packed[PACKED_TOKENS[0]]).rstrip("=")) * 3 // 4 // 4  # base64 of int32s
    return 0
