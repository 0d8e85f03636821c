"""Rendering items to datums: Signal's items in Tinker's token-level form, and every bad item named by its field."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from gpu_runtime.compute.batches import Datum, Renderer, collate
from gpu_runtime.contract import batch_from_dicts
from gpu_runtime.engine.journal_records import FbRecord
from gpu_runtime.errors import BadInput
from rewardsignal import pack_datum


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: str) -> Renderer:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    return Renderer(tokenizer, vocab_size=len(tokenizer), max_length=256)


def render_json(renderer: Renderer, batch: Any, max_batch_size: int, loss_fn: str) -> list[Datum]:
    """A batch as the wire carries it: parsed into items by the contract, then rendered against the model."""
    return renderer.render_batch(batch_from_dicts(batch), max_batch_size, loss_fn)


def render(renderer: Renderer, item: dict[str, Any]) -> tuple[list[int], list[float]]:
    """The item as Signal's tokens + weights (weights[0] weighs nothing), from its datum."""
    (datum,) = render_json(renderer, [item], max_batch_size=8, loss_fn="cross_entropy")
    assert datum.weights is not None and datum.model_input[1:] == datum.targets[:-1]  # Signal's items: next token
    return datum.model_input + datum.targets[-1:], [0.0] + datum.weights


def test_token_items_keep_tokens_and_weights_as_given(renderer: Renderer) -> None:
    tokens, weights = render(renderer, {"tokens": [5, 6, 7], "weights": [0, 1, 0.5]})
    assert tokens == [5, 6, 7]
    assert weights == [0.0, 1.0, 0.5]


def test_collate_shifts_targets_so_weights_i_scores_token_i(renderer: Renderer) -> None:
    examples = render_json(renderer,
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
    assert weights == [0.0] + [1.0] * (len(tokens) - 1)  # nothing predicts the first token


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
    ({"tokens": [1, 2], "weights": [0, 1], "logprobs": [0, 0]}, "batch[0].logprobs"),
    ({"tokens": [1] * 300}, "batch[0]"),  # longer than the context (256)
    # Tinker's datums
    ({"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [[2, 3], [3]], "weights": [[1, 0], [1]]}},
     "batch[0].loss_fn_inputs.target_tokens"),  # ragged soft targets (docs/LOSSES.md)
    ({"model_input": [1, {"type": "image", "data": "AA==", "format": "png"}], "loss_fn_inputs": {"target_tokens": [2, 3]}},
     "batch[0].model_input[1]"),
    ({"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2]}}, "batch[0].loss_fn_inputs.target_tokens"),
    ({"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1]}},
     "batch[0].loss_fn_inputs.weights"),
    ({"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 10**6]}}, "batch[0].loss_fn_inputs.target_tokens"),
    ({"model_input": [1, 10**6], "loss_fn_inputs": {"target_tokens": [2, 3]}}, "batch[0].model_input"),
    ({"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "mask": [1, 1]}}, "batch[0].loss_fn_inputs.mask"),
    ({"model_input": [1, 2], "loss_fn_inputs": {}}, "batch[0].loss_fn_inputs.target_tokens"),
    ({"model_input": [], "loss_fn_inputs": {"target_tokens": []}}, "batch[0].model_input"),
    ({"model_input": [1, 2], "target_tokens": [2, 3]}, "batch[0].target_tokens"),
]


@pytest.mark.parametrize(("item", "field"), BAD_ITEMS, ids=[f for _, f in BAD_ITEMS])
def test_bad_items_name_their_field(renderer: Renderer, item: Any, field: str) -> None:
    with pytest.raises(BadInput) as caught:
        render_json(renderer, [item], max_batch_size=8, loss_fn="cross_entropy")
    assert caught.value.field == field


def test_bad_item_index_is_its_position(renderer: Renderer) -> None:
    with pytest.raises(BadInput) as caught:
        render_json(renderer, [{"text": "ok"}, {"text": "ok"}, {"output": ""}], 8, "cross_entropy")
    assert caught.value.field == "batch[2].output"


@pytest.mark.parametrize("batch", [[], None, {"text": "a"}])
def test_batch_must_be_a_non_empty_list(renderer: Renderer, batch: Any) -> None:
    with pytest.raises(BadInput) as caught:
        render_json(renderer, batch, 8, "cross_entropy")
    assert caught.value.field == "batch"


def test_batch_larger_than_max_batch_size(renderer: Renderer) -> None:
    with pytest.raises(BadInput) as caught:
        render_json(renderer, [{"text": "a"}] * 3, max_batch_size=2, loss_fn="cross_entropy")
    assert caught.value.field == "batch"
    assert "at most 2" in caught.value.message


@pytest.mark.parametrize("item", [
    {"tokens": [1, 2, 3], "weights": [0, 0, 0]},  # every weight 0
    {"tokens": [1, 2], "weights": [1, 0]},  # weights[0] weighs nothing, so no target counts
    {"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [0, 0], "weights": [0.0, 0.0]}},
], ids=["all-zero", "first-only", "datum"])
def test_a_datum_that_weighs_nothing_is_accepted_and_counts_no_target(renderer: Renderer, item: dict[str, Any]) -> None:
    # Refused before issue 15 (a GRPO group with equal rewards has every advantage 0): now it contributes nothing.
    (datum,) = render_json(renderer, [item], 8, "cross_entropy")
    assert datum.num_targets == 0


def test_a_datum_keeps_its_targets_as_given_unshifted(renderer: Renderer) -> None:
    # rl_loop's shape: the prompt's targets are 0, not the next input token.
    item: dict[str, Any] = {"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [0, 0, 9], "weights": [0, -0.5, 2.5],
                                                         "clip_low_threshold": [0.5, 0.5, 0.5]}}
    (datum,) = render_json(renderer, [item], 8, "cross_entropy")
    assert (datum.model_input, datum.targets, datum.weights) == ([5, 6, 7], [0, 0, 9], [0.0, -0.5, 2.5])
    assert datum.to_dict() == item | {"loss_fn_inputs": {**item["loss_fn_inputs"], "weights": [0.0, -0.5, 2.5]}}
    data = collate([datum], torch.device("cpu"))
    assert data.input_ids.tolist() == [[5, 6, 7]] and data.targets.tolist() == [[0, 0, 9]]


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
@pytest.mark.parametrize("missing", ["advantages", "logprobs"])
def test_rl_losses_need_advantages_and_logprobs(renderer: Renderer, loss_fn: str, missing: str) -> None:
    inputs = {"target_tokens": [2, 3], "advantages": [0.0, 1.0], "logprobs": [-1.0, -2.0]}
    del inputs[missing]
    with pytest.raises(BadInput) as caught:
        render_json(renderer, [{"model_input": [1, 2], "loss_fn_inputs": inputs}], 8, loss_fn)
    assert caught.value.field == f"batch[0].loss_fn_inputs.{missing}"


def test_an_old_journal_example_renders_shifted() -> None:
    (datum,) = FbRecord.from_dict({"type": "forward_backward", "loss_fn": "cross_entropy", "call": 0, "result": {}, "examples": [
        {"tokens": [5, 6, 7], "weights": [9.0, 1.0, 0.5], "extras": {"advantages": [1, 2, 3]}}]}).datums
    assert (datum.model_input, datum.targets, datum.weights) == ([5, 6], [6, 7], [1.0, 0.5])
    assert datum.inputs == {"advantages": [2, 3]}


PACKABLE = {"model_input": [5, 6, 7], "loss_fn_inputs": {"target_tokens": [0, 8, 9], "weights": [0.0, -0.5, 2.25],
                                                          "advantages": [0.0, 1.5, -1.0], "logprobs": [0.0, -2.5, -0.125]}}


def test_a_packed_datum_renders_as_the_datum_itself(renderer: Renderer) -> None:
    packed = pack_datum(PACKABLE)
    assert set(packed["packed"]) == {"model_input", "target_tokens", "weights", "advantages", "logprobs"}
    assert all(isinstance(v, str) for v in packed["packed"].values())
    (got,) = render_json(renderer, [packed], 8, "importance_sampling")
    (expected,) = render_json(renderer, [PACKABLE], 8, "importance_sampling")
    assert got == expected  # these floats are exact in float32


@pytest.mark.parametrize(("packed", "field"), [
    ({"model_input": "!!", "target_tokens": "AAAAAA=="}, "batch[0].packed.model_input"),
    ({"model_input": "AAAA", "target_tokens": "AAAAAA=="}, "batch[0].packed.model_input"),  # 3 bytes
    ({"model_input": "AQAAAA==", "target_tokens": "AQAAAAIAAAA="}, "batch[0].packed.target_tokens"),  # 1 vs 2
    ({"model_input": "AQAAAA==", "target_tokens": "AAAAAA==", "mask": "AAAAAA=="}, "batch[0].packed.mask"),
    ({"model_input": "////fw==", "target_tokens": "AAAAAA=="}, "batch[0].packed.model_input"),  # 2**31 - 1
], ids=["base64", "width", "lengths", "unknown", "vocabulary"])
def test_bad_packed_datums_name_their_field(renderer: Renderer, packed: dict[str, str], field: str) -> None:
    with pytest.raises(BadInput) as caught:
        render_json(renderer, [{"packed": packed}], 8, "cross_entropy")
    assert caught.value.field == field
