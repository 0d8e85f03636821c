"""Typed results stay Mappings: each call's answer has its own class, and every way of reading a dict works on it
(the README's `r["loss"]`, `get`, `keys`, `items`, `in`, equality with a dict, `dict(r)`, `json.dumps`, `r.loss`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from graphql import FieldNode, OperationDefinitionNode, parse
from rewardsignal import SignalClient
from rewardsignal.operations import document, names
from rewardsignal.results import (
    TYPED,
    CheckpointResult,
    ForwardBackwardResult,
    ForwardResult,
    OptimStepResult,
    Result,
    SampleResult,
    SamplerSnapshotResult,
    TokenizerResult,
    snake,
)
from tests.helpers.live_server import LiveServer

KEYS: dict[str, set[str]] = {
    "forward_backward": {"loss", "num_tokens", "num_examples", "step", "reduction"},
    "optim_step": {"step", "grad_norm", "learning_rate"},
    "sample": {"outputs", "prompt_tokens", "step", "prompt_logprobs", "topk_prompt_logprobs", "sequences",
               "prompt_cache_hit_tokens"},
    "save_state": {"id", "step", "mode", "name", "path", "checkpoint_path", "size_bytes", "hub_url", "created_at",
                   "download_url", "with_optimizer", "pending_excluded"},
    "forward": {"loss", "loss_sum", "num_tokens", "num_examples", "step", "outputs"},
    "tokenizer": {"name", "vocab_size", "eos_token_ids", "bos_token_id", "pad_token_id", "chat_template"},
    "save_weights_for_sampler": {"run_id", "name", "step", "named", "expires_in_seconds"},
}
TYPES: dict[str, type[Result]] = {"forward_backward": ForwardBackwardResult, "optim_step": OptimStepResult,
                                  "sample": SampleResult, "save_state": CheckpointResult, "forward": ForwardResult,
                                  "tokenizer": TokenizerResult, "save_weights_for_sampler": SamplerSnapshotResult}


@pytest.fixture(scope="module")
def answers(live_server: LiveServer) -> dict[str, Any]:
    run = SignalClient(api_key=live_server.new_user(), base_url=live_server.url).create_run(lora_r=4)
    return {"forward_backward": run.forward_backward(batch=[{"text": "results are mappings"}]),
            "optim_step": run.optim_step(), "sample": run.sample(prompts=["A"], max_tokens=3, seed=1),
            "save_state": run.save_state(), "forward": run.forward(batch=[{"text": "results are mappings"}]),
            "tokenizer": run.tokenizer(), "save_weights_for_sampler": run.save_weights_for_sampler()}


BEHAVIOURS: dict[str, Callable[[Any, set[str]], bool]] = {
    "is a Mapping": lambda r, keys: isinstance(r, Mapping),
    "keys": lambda r, keys: set(r.keys()) == keys,
    "iter and len": lambda r, keys: set(r) == keys and len(r) == len(keys),
    "getitem equals attribute": lambda r, keys: all(r[k] is getattr(r, k) for k in keys),
    "get, with a default": lambda r, keys: all(r.get(k) is r[k] for k in keys) and r.get("absent", 7) == 7,
    "in": lambda r, keys: all(k in r for k in keys) and "absent" not in r,
    "items and values": lambda r, keys: dict(r.items()) == {k: r[k] for k in keys} and list(r.values()) == [r[k] for k in r],
    "equals a dict, both ways": lambda r, keys: r == {k: r[k] for k in keys} and {k: r[k] for k in keys} == r,
    "dict(r) is a plain dict of it": lambda r, keys: type(dict(r)) is dict and dict(r) == r,
    "json.dumps": lambda r, keys: json.loads(json.dumps(r)).keys() == keys,
    "repr names the class": lambda r, keys: repr(r).startswith(type(r).__name__ + "("),
}


@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
@pytest.mark.parametrize("call", list(KEYS))
def test_a_result_is_a_typed_mapping(answers: dict[str, Any], call: str, behaviour: str) -> None:
    result = answers[call]
    assert isinstance(result, TYPES[call])
    assert BEHAVIOURS[behaviour](result, KEYS[call])


@pytest.mark.parametrize(("call", "field", "kind"), [("forward_backward", "num_tokens", int),
                                                     ("forward_backward", "num_examples", int),
                                                     ("forward_backward", "step", int), ("forward_backward", "loss", float),
                                                     ("optim_step", "step", int), ("save_state", "size_bytes", int)])
def test_counts_are_ints_and_keys_snake_case(answers: dict[str, Any], call: str, field: str, kind: type) -> None:
    assert type(answers[call][field]) is kind


def test_a_missing_field_is_an_attribute_error(answers: dict[str, Any]) -> None:
    with pytest.raises(AttributeError, match="outputs"):
        answers["forward_backward"].outputs  # not selected: absent, not None  # noqa: B018
    assert answers["sample"].sequences[0][0].stop_reason in ("stop", "length")  # nested objects: plain Results


def _selected(operation: str) -> tuple[str, set[str]]:
    """The operation's top-level field and the snake_case names it selects."""
    [definition] = [d for d in parse(document(operation)).definitions if isinstance(d, OperationDefinitionNode)]
    [field] = definition.selection_set.selections
    assert isinstance(field, FieldNode)
    selections = field.selection_set.selections if field.selection_set is not None else ()  # a scalar answer
    return field.name.value, {snake(f.name.value) for f in selections if isinstance(f, FieldNode)}


def _annotated(cls: type[Result]) -> set[str]:
    return {name for klass in cls.__mro__ if klass not in (Result, dict, object)
            for name in vars(klass).get("__annotations__", {})}


# The classes no TYPED entry names: save_state's answer becomes an Artifact (a CheckpointResult) through its wrap.
WRAPPED: dict[str, type[Result]] = {"SaveState": CheckpointResult}
TYPED_OPERATIONS = sorted([name for name in names() if _selected(name)[0] in TYPED]
                          + list(WRAPPED))


@pytest.mark.parametrize("operation", TYPED_OPERATIONS)
def test_each_typed_result_annotates_what_its_document_selects(operation: str) -> None:
    field, selected = _selected(operation)
    cls = WRAPPED.get(operation) or TYPED[field]
    assert _annotated(cls) == selected, f"{cls.__name__} against {operation}.graphql: the type checker would be told wrong"
