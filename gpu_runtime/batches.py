"""Training items → token ids and per-token weights, validated, then collated into tensors.

Convention (as Tinker's datums): every item becomes `tokens` with `weights` aligned to them;
weights[i] weighs the loss of predicting tokens[i] from tokens[:i]. Nothing predicts the first
token, so weights[0] is ignored. The model reads tokens[:-1] and is scored on tokens[1:].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase

from gpu_runtime.contract.settings import TEXT_KEYS, TOKEN_KEYS
from gpu_runtime.errors import BadInput

ROLES = {"system", "user", "assistant", "tool"}


@dataclass
class Example:
    tokens: list[int]
    weights: list[float]
    extras: dict[str, list[float]] = field(default_factory=dict)  # per-token logprobs, advantages

    @property
    def num_targets(self) -> int:
        return sum(1 for w in self.weights[1:] if w != 0)


@dataclass
class Collated:
    input_ids: torch.Tensor  # [B, T] tokens[:-1], right-padded
    attention_mask: torch.Tensor
    targets: torch.Tensor  # [B, T] tokens[1:]
    weights: torch.Tensor  # [B, T] weights[1:], 0 on padding
    extras: dict[str, torch.Tensor]


class Renderer:
    """Turns batch items into Examples for one tokenizer and context length."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_length = max_length
        self.eos_id = tokenizer.eos_token_id

    def render_batch(self, batch: Any, max_batch_size: int, loss_fn: str) -> list[Example]:
        if not isinstance(batch, list) or not batch:
            raise BadInput("batch must be a non-empty list of items", field="batch")
        if len(batch) > max_batch_size:
            raise BadInput(f"batch has {len(batch)} items; this worker takes at most {max_batch_size}", field="batch")
        examples = [self.render_item(item, f"batch[{i}]", loss_fn) for i, item in enumerate(batch)]
        for i, example in enumerate(examples):
            if len(example.tokens) > self.max_length:
                raise BadInput(
                    f"batch[{i}] is {len(example.tokens)} tokens; the model's context is {self.max_length}", field=f"batch[{i}]"
                )
            if example.num_targets == 0:
                raise BadInput(f"batch[{i}] has no target tokens (every weight is 0)", field=f"batch[{i}]")
        return examples

    def render_item(self, item: Any, where: str, loss_fn: str) -> Example:
        if not isinstance(item, dict) or not item:
            raise BadInput(f"{where} must be a non-empty object", field=where)
        keys = set(item)
        if "tokens" in keys:
            return self._tokens_item(item, where, loss_fn)
        if loss_fn != "cross_entropy":
            raise BadInput(f"loss_fn {loss_fn!r} takes token items only ({{tokens, logprobs, advantages}})", field=where)
        if keys not in TEXT_KEYS:
            unknown = sorted(keys - {"text", "input", "output", "messages"})
            key = unknown[0] if unknown else sorted(keys)[0]
            raise BadInput(
                f"{where} has keys {sorted(keys)}; an item is one of {{text}}, {{input, output}}, {{messages}}, "
                "{tokens, weights}",
                field=f"{where}.{key}",
            )
        for key in keys - {"messages"}:
            if not isinstance(item[key], str):
                raise BadInput(f"{where}.{key} must be a string", field=f"{where}.{key}")
        if keys == {"messages"}:
            return self._messages_item(item["messages"], f"{where}.messages")
        if keys == {"input", "output"}:
            if not item["output"]:
                raise BadInput(f"{where}.output is empty", field=f"{where}.output")
            return self._prompt_completion(item["input"], item["output"])
        (key,) = keys
        if not item[key]:
            raise BadInput(f"{where}.{key} is empty", field=f"{where}.{key}")
        return self._prompt_completion("", item[key])

    def _encode(self, text: str, first: bool) -> list[int]:
        # Only the first segment gets the tokenizer's own specials (BOS where the model uses one).
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    def _prompt_completion(self, prompt: str, completion: str) -> Example:
        prompt_ids = self._encode(prompt, first=True)
        completion_ids = self._encode(completion, first=not prompt_ids)
        # EOS after the completion teaches the model to stop.
        if self.eos_id is not None and (not completion_ids or completion_ids[-1] != self.eos_id):
            completion_ids.append(self.eos_id)
        tokens = prompt_ids + completion_ids
        weights = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
        return Example(tokens, weights)

    def _messages_item(self, messages: Any, where: str) -> Example:
        if not isinstance(messages, list) or not messages:
            raise BadInput(f"{where} must be a non-empty list of {{role, content}}", field=where)
        for j, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) != {"role", "content"}:
                raise BadInput(f"{where}[{j}] must be exactly {{role, content}}", field=f"{where}[{j}]")
            if message["role"] not in ROLES:
                raise BadInput(f"{where}[{j}].role must be one of {sorted(ROLES)}", field=f"{where}[{j}].role")
            if not isinstance(message["content"], str):
                raise BadInput(f"{where}[{j}].content must be a string", field=f"{where}[{j}].content")
        if not any(m["role"] == "assistant" for m in messages):
            raise BadInput(f"{where} has no assistant turn to train on", field=where)
        if not getattr(self.tokenizer, "chat_template", None) or not self.tokenizer.is_fast:
            raise BadInput("this model's tokenizer has no chat template; send tokens or input/output items", field=where)
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
        return Example(tokens, weights)

    def _template(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if not messages and not generation_prompt:
            return ""
        # tokenize=False returns the rendered text; the stub's return type covers every mode.
        return cast(str, self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))

    def _tokens_item(self, item: dict[str, Any], where: str, loss_fn: str) -> Example:
        allowed = {"tokens", "weights"} if loss_fn == "cross_entropy" else TOKEN_KEYS
        for key in item:
            if key not in allowed:
                raise BadInput(f"{where}.{key} is not a field of a token item for {loss_fn} (takes {sorted(allowed)})", field=f"{where}.{key}")
        tokens = item["tokens"]
        if not isinstance(tokens, list) or len(tokens) < 2:
            raise BadInput(f"{where}.tokens must be a list of at least 2 token ids", field=f"{where}.tokens")
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int):
                raise BadInput(f"{where}.tokens must hold integers, got {t!r}", field=f"{where}.tokens")
            if not 0 <= t < self.vocab_size:
                raise BadInput(f"{where}.tokens has id {t} outside the vocabulary (0..{self.vocab_size - 1})", field=f"{where}.tokens")
        weights = self._floats(item, "weights", where, len(tokens), default=1.0)
        if loss_fn == "cross_entropy" and any(w < 0 for w in weights):
            raise BadInput(f"{where}.weights must be >= 0 for cross_entropy", field=f"{where}.weights")
        extras = {}
        if loss_fn == "importance_sampling":
            for key in ("logprobs", "advantages"):
                if key not in item:
                    raise BadInput(f"{where}.{key} is required for importance_sampling", field=f"{where}.{key}")
                extras[key] = self._floats(item, key, where, len(tokens), default=0.0)
            if "weights" not in item:
                # Without a mask, the tokens that carry an advantage are the ones trained on.
                weights = [1.0 if a != 0 else 0.0 for a in extras["advantages"]]
        return Example(list(tokens), weights, extras)

    def _floats(self, item: dict[str, Any], key: str, where: str, length: int, default: float) -> list[float]:
        if key not in item:
            return [default] * length
        values = item[key]
        if not isinstance(values, list) or len(values) != length:
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise BadInput(f"{where}.{key} must be a list as long as tokens ({length}), got {got}", field=f"{where}.{key}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadInput(f"{where}.{key} must hold finite numbers, got {v!r}", field=f"{where}.{key}")
        return [float(v) for v in values]


def collate(examples: list[Example], device: torch.device) -> Collated:
    """Right-pad tokens[:-1] / tokens[1:] to the longest item; padding has weight 0."""
    width = max(len(e.tokens) for e in examples) - 1
    rows = len(examples)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    weights = torch.zeros(rows, width, dtype=torch.float32)
    extra_names = sorted({k for e in examples for k in e.extras})
    extras = {k: torch.zeros(rows, width, dtype=torch.float32) for k in extra_names}
    for i, example in enumerate(examples):
        n = len(example.tokens) - 1
        input_ids[i, :n] = torch.tensor(example.tokens[:-1])
        attention_mask[i, :n] = 1
        targets[i, :n] = torch.tensor(example.tokens[1:])
        weights[i, :n] = torch.tensor(example.weights[1:])
        for k in extra_names:
            extras[k][i, :n] = torch.tensor(example.extras[k][1:])
    return Collated(
        input_ids.to(device),
        attention_mask.to(device),
        targets.to(device),
        weights.to(device),
        {k: v.to(device) for k, v in extras.items()},
    )
