"""createRun's rules are the engine contract's: the same defaults and bounds, errors named in GraphQL's case."""

from __future__ import annotations

import pytest

from app.errors import BadInput
from app.schema.inputs import CreateRunInput
from app.services.runs import RunSpec, graphql_field
from gpu_runtime.contract import ADAM_DEFAULTS, LORA_DEFAULTS


def test_defaults_are_the_contracts() -> None:
    lora, adam = RunSpec().lora(), RunSpec().adam()
    assert (lora["r"], lora["alpha"], lora["dropout"]) == (LORA_DEFAULTS["r"], LORA_DEFAULTS["alpha"], 0.0)
    assert adam == ADAM_DEFAULTS
    assert CreateRunInput().to_spec().adam() == ADAM_DEFAULTS
    assert CreateRunInput().to_spec().lora() == lora


@pytest.mark.parametrize(("spec", "field"), [
    ({"lora_r": 0}, "loraR"),
    ({"lora_r": 513}, "loraR"),
    ({"lora_alpha": 0.0}, "loraAlpha"),
    ({"lora_dropout": 1.0}, "loraDropout"),
    ({"lora_target_modules": []}, "loraTargetModules"),
    ({"lora_target_modules": ["q_proj"], "train_unembed": True}, "loraTargetModules"),
    ({"train_attn": False}, "trainAttn"),
    ({"learning_rate": 0.0}, "learningRate"),
    ({"learning_rate": 1.5}, "learningRate"),  # (0, 1]: the engine holds the same bound
    ({"weight_decay": -0.1}, "weightDecay"),
    ({"grad_clip_norm": -1.0}, "gradClipNorm"),
    ({"seed": -1}, "seed"),
])
def test_out_of_bounds_settings_name_their_field(spec: dict, field: str) -> None:
    with pytest.raises(BadInput) as refused:
        RunSpec(**spec).validate()
    assert refused.value.field == field


@pytest.mark.parametrize("spec", [{"learning_rate": 1.0}, {"lora_r": 512, "lora_dropout": 0.5},
                                  {"grad_clip_norm": 0.0}])
def test_settings_at_the_bounds_are_accepted(spec: dict) -> None:
    RunSpec(**spec).validate()


@pytest.mark.parametrize(("contract", "graphql"), [
    ("max_tokens", "maxTokens"),
    ("lora.target_modules", "loraTargetModules"),
    ("lora.r", "loraR"),
    ("lora.train_unembed", "trainUnembed"),
    ("batch[2].output", "batch[2].output"),
    ("batch[0].messages[1].content", "batch[0].messages[1].content"),
    ("adam.learning_rate", "adam.learningRate"),
    ("prompts[3]", "prompts[3]"),
    (None, None),
])
def test_engine_fields_are_renamed_as_the_schema_names_them(contract: str | None, graphql: str | None) -> None:
    assert graphql_field(contract) == graphql
