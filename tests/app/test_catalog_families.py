"""The catalogue's families and mixture-of-experts entries (issue 32): a family the runtime cannot serve is refused when
the catalogue loads, naming what is missing; a MoE model's fit counts every expert's LoRA, and its activations by
active parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from app.catalog import Catalog
from gpu_runtime.client.allocation import ExpertShape, LoraTargets, estimate_bytes, lora_parameters

QWEN3_30B_A3B = ExpertShape(experts=128, active_experts=8, hidden=2048, intermediate=768, layers=48,
                            active_parameters=3_300_000_000)
GPT_OSS_20B = ExpertShape(experts=32, active_experts=4, hidden=2880, intermediate=2880, layers=24,
                          active_parameters=3_610_000_000)


def load(tmp_path: Path, entry: dict[str, Any]) -> Catalog:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": [entry]}))
    return Catalog.from_file(path)


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "m", "family": "mamba", "parameters": 1_000_000}, "family 'mamba' has no tested support"),
    ({"name": "m", "family": "qwen3_moe", "parameters": 30_500_000_000}, "needs `active_parameters` and `experts"),
    ({"name": "m", "family": "gpt_oss", "parameters": 20_900_000_000, "active_parameters": 30_000_000_000},
     "active_parameters must be a positive integer at most parameters"),
    ({"name": "m", "family": "gpt_oss", "parameters": 20_900_000_000, "active_parameters": 3_610_000_000,
      "experts": {"experts": 32, "hidden": 2880}}, "experts must give positive integers"),
], ids=["unknown-family", "moe-without-shape", "active-above-total", "partial-shape"])
def test_a_family_the_runtime_cannot_serve_is_refused_at_load(tmp_path: Path, entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load(tmp_path, entry)


def test_the_shipped_catalogue_loads_with_its_moe_entries() -> None:
    catalog = Catalog.from_file(Path("config/models.yaml"))
    moe = catalog.get("Qwen/Qwen3-30B-A3B")
    assert moe.experts == QWEN3_30B_A3B and moe.active_parameters == 3_300_000_000
    assert catalog.get("openai/gpt-oss-20b").experts == GPT_OSS_20B
    assert catalog.get("HuggingFaceTB/SmolLM2-135M-Instruct").experts is None  # the seed's rows stay as they were


@pytest.mark.parametrize(("shape", "params"), [(QWEN3_30B_A3B, 1_258_291_200), (GPT_OSS_20B, 353_894_400)],
                         ids=["qwen3-30b-a3b", "gpt-oss-20b"])
def test_expert_lora_is_r_times_in_plus_out_per_expert_per_target(shape: ExpertShape, params: int) -> None:
    assert shape.lora_parameters(32) == params  # docs/LORA.md quotes these: 5.03 GB and 1.42 GB in fp32
    mlp = LoraTargets(mlp=True, experts=shape)
    attention = LoraTargets(experts=shape)
    assert lora_parameters(30_000_000_000, 32, targets=mlp) - lora_parameters(30_000_000_000, 32, targets=attention) == params


def test_activations_go_by_active_parameters() -> None:
    dense = estimate_bytes(30_500_000_000)
    moe = estimate_bytes(30_500_000_000, targets=LoraTargets(experts=QWEN3_30B_A3B))
    assert moe < dense  # the same resident weights, a tenth of the activations
