from __future__ import annotations

from typing import Any

import pytest

from gpu_runtime.contract import RuntimeOptions, adam_settings, lora_settings
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput

LLAMA_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}


def test_defaults_target_the_attention_projections() -> None:
    settings = lora_settings(None, LLAMA_LINEARS)
    assert settings == {"r": 32, "alpha": 64.0, "dropout": 0.0, "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"]}


def test_explicit_targets_are_kept() -> None:
    assert lora_settings({"target_modules": ["up_proj", "q_proj"]}, LLAMA_LINEARS)["target_modules"] == ["q_proj", "up_proj"]


@pytest.mark.parametrize(
    ("lora", "field"),
    [
        ({"r": 0}, "lora.r"),
        ({"r": 513}, "lora.r"),
        ({"r": 2.5}, "lora.r"),
        ({"r": True}, "lora.r"),
        ({"alpha": 0}, "lora.alpha"),
        ({"alpha": "big"}, "lora.alpha"),
        ({"r": 4, "alpha": 1e308}, "lora.alpha"),  # issue 19: every loss of such a run was nan
        ({"r": 4, "alpha": 64.5}, "lora.alpha"),  # past 16 * r
        ({"dropout": 1.0}, "lora.dropout"),
        ({"dropout": -0.1}, "lora.dropout"),
        ({"target_modules": ["attn"]}, "lora.target_modules"),
        ({"target_modules": []}, "lora.target_modules"),
        ({"target_modules": [3]}, "lora.target_modules"),
        ({"rank": 8}, "lora.rank"),
        ([8], "lora"),
    ],
)
def test_bad_lora_settings_name_their_field(lora: Any, field: str) -> None:
    with pytest.raises(BadInput) as caught:
        lora_settings(lora, LLAMA_LINEARS)
    assert caught.value.field == field


def test_create_run_validates_lora_against_the_real_model(engine: Engine, tiny_model_dir: str) -> None:
    with pytest.raises(BadInput) as caught:
        engine.create_run("r1", "u1", tiny_model_dir, {"target_modules": ["c_attn"]})
    assert caught.value.field == "lora.target_modules"
    assert "q_proj" in caught.value.message  # says what the model does have
    info = engine.create_run("r1", "u1", tiny_model_dir, {"r": 2, "target_modules": ["gate_proj", "up_proj", "down_proj"]})
    assert info["target_modules"] == ["down_proj", "gate_proj", "up_proj"]


def test_alpha_defaults_to_twice_the_rank() -> None:
    assert lora_settings({"r": 4}, LLAMA_LINEARS)["alpha"] == 8.0


@pytest.mark.parametrize(("value", "ok"), [(1e-4, True), (1.0, True), (0.0, False), (1.5, False), (float("nan"), False)])
def test_one_learning_rate_bound(value: float, ok: bool) -> None:
    if ok:
        assert adam_settings({"learning_rate": value})["learning_rate"] == value
    else:
        with pytest.raises(BadInput) as caught:
            adam_settings({"learning_rate": value})
        assert caught.value.field == "adam.learning_rate"


@pytest.mark.parametrize(("options", "field"), [({"tick_tokens": 0}, "tick_tokens"), ({"resident_runs": 2.5}, "resident_runs"),
                                                ({"nonsense": 1}, "nonsense")])
def test_runtime_options_are_checked(options: dict[str, Any], field: str) -> None:
    with pytest.raises(BadInput) as caught:
        RuntimeOptions.from_dict(options)
    assert caught.value.field == field
