"""Rendering items to tokens + weights: the convention, and every bad item named by its field."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from gpu_runtime.batches import Renderer, collate
from gpu_runtime.errors import BadInput


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: str) -> Renderer:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return Renderer(tokenizer, vocab_size=len(tokenizer), max_length=256)


def render(renderer: Renderer, item: dict[str, Any]) -> tuple[list[int], list[float]]:
    (example,) = renderer.render_batch([item], max_batch_size=8, loss_fn="cross_entropy")
    return example.tokens, example.weights


def test_token_items_keep_tokens_and_weights_as_given(renderer: Renderer) -> None:
    tokens, weights = render(renderer, {"tokens": [5, 6, 7], "weights": [0, 1, 0.5]})
    assert tokens == [5, 6, 7]
    assert weights == [0.0, 1.0, 0.5]


def test_collate_shifts_targets_so_weights_i_scores_token_i(renderer: Renderer) -> None:
    examples = renderer.render_batch(
        [{"tokens": [5, 6, 7], "weights": [9, 1, 0.5]}, {"tokens": [8, 9], "weights": [0, 2]}], 8, "cross_entropy"
    )
    data = collate(examples, torch.device("cpu"))
    assert data.input_ids.tolist() == [[5, 6], [8, 0]]
    assert data.targets.tolist() == [[6, 7], [9, 0]]
    # weights[0] is dropped (nothing predicts the first token); padding weighs 0.
    assert data.weights.tolist() == [[1.0, 0.5], [2.0, 0.0]]
    assert data.attention_mask.tolist() == [[1, 1], [1, 0]]


def test_input_output_weighs_only_the_output_and_appends_eos(renderer: Renderer) -> None:
    tok = renderer.tokenizer
    tokens, weights = render(renderer, {"input": "Q: 2+2?", "output": " 4"})
    prompt = tok("Q: 2+2?")["input_ids"]
    assert tokens[: len(prompt)] == prompt
    assert tokens[-1] == tok.eos_token_id
    assert weights == [0.0] * len(prompt) + [1.0] * (len(tokens) - len(prompt))


def test_text_weighs_every_token_and_ends_with_eos(renderer: Renderer) -> None:
    tokens, weights = render(renderer, {"text": "hello world"})
    assert tokens == renderer.tokenizer("hello world")["input_ids"] + [renderer.tokenizer.eos_token_id]
    assert weights == [1.0] * len(tokens)


@pytest.mark.parametrize("key", ["input", "output"])
def test_input_or_output_alone_is_text(renderer: Renderer, key: str) -> None:
    assert render(renderer, {key: "hello world"}) == render(renderer, {"text": "hello world"})


def test_messages_weigh_assistant_turns_through_end_of_turn(renderer: Renderer) -> None:
    tok = renderer.tokenizer
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"},
    ]
    tokens, weights = render(renderer, {"messages": messages})
    assert tokens == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    trained = tok.decode([t for t, w in zip(tokens, weights) if w])
    assert trained == "Hello!<|im_end|>Ciao<|im_end|>"


BAD_ITEMS: list[tuple[Any, str]] = [
    ({}, "batch[0]"),
    ("text", "batch[0]"),
    ({"text": "a", "extra": 1}, "batch[0].extra"),
    ({"prompt": "a"}, "batch[0].prompt"),
    ({"text": 3}, "batch[0].text"),
    ({"text": ""}, "batch[0].text"),
    ({"input": "a", "output": ""}, "batch[0].output"),
    ({"input": "a", "output": 5}, "batch[0].output"),
    ({"messages": []}, "batch[0].messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "batch[0].messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "batch[0].messages[0].role"),
    ({"messages": [{"role": "user", "content": 1}]}, "batch[0].messages[0].content"),
    ({"messages": [{"role": "user"}]}, "batch[0].messages[0]"),
    ({"tokens": [1]}, "batch[0].tokens"),
    ({"tokens": "1 2"}, "batch[0].tokens"),
    ({"tokens": [1, 2.5]}, "batch[0].tokens"),
    ({"tokens": [1, 10**6]}, "batch[0].tokens"),
    ({"tokens": [1, -1]}, "batch[0].tokens"),
    ({"tokens": [1, 2], "weights": [1]}, "batch[0].weights"),
    ({"tokens": [1, 2], "weights": [0, "x"]}, "batch[0].weights"),
    ({"tokens": [1, 2], "weights": [0, -1]}, "batch[0].weights"),
    ({"tokens": [1, 2], "weights": [1, 0]}, "batch[0]"),  # zero target tokens: weights[0] is ignored
    ({"tokens": [1, 2], "weights": [0, 1], "logprobs": [0, 0]}, "batch[0].logprobs"),
    ({"tokens": [1] * 300}, "batch[0]"),  # longer than the context (256)
]


@pytest.mark.parametrize(("item", "field"), BAD_ITEMS, ids=[f for _, f in BAD_ITEMS])
def test_bad_items_name_their_field(renderer: Renderer, item: Any, field: str) -> None:
    with pytest.raises(BadInput) as caught:
        renderer.render_batch([item], max_batch_size=8, loss_fn="cross_entropy")
    assert caught.value.field == field


def test_bad_item_index_is_its_position(renderer: Renderer) -> None:
    with pytest.raises(BadInput) as caught:
        renderer.render_batch([{"text": "ok"}, {"text": "ok"}, {"output": ""}], 8, "cross_entropy")
    assert caught.value.field == "batch[2].output"


@pytest.mark.parametrize("batch", [[], None, {"text": "a"}])
def test_batch_must_be_a_non_empty_list(renderer: Renderer, batch: Any) -> None:
    with pytest.raises(BadInput) as caught:
        renderer.render_batch(batch, 8, "cross_entropy")
    assert caught.value.field == "batch"


def test_batch_larger_than_max_batch_size(renderer: Renderer) -> None:
    with pytest.raises(BadInput) as caught:
        renderer.render_batch([{"text": "a"}] * 3, max_batch_size=2, loss_fn="cross_entropy")
    assert caught.value.field == "batch"
    assert "at most 2" in caught.value.message
