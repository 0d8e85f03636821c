"""Loading base models: the offline default's safetensors cache, and clear errors for what is not here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_runtime.client.model_files import CACHE_MARKER, DEFAULT_BASE_MODEL, builtin_gguf_path, safe_name
from gpu_runtime.compute.models import ModelRegistry
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import ModelUnavailable


def test_hub_id_not_in_the_local_cache_is_model_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    engine = Engine(tmp_path / "data", device="cpu")
    with pytest.raises(ModelUnavailable) as caught:
        engine.create_run("r1", "u1", "signal-tests/no-such-model")
    message = caught.value.message
    assert "not available offline" in message
    assert "SIGNAL_ALLOW_DOWNLOADS=1" in message and "HF_TOKEN" in message and "Modal" in message
    assert caught.value.field == "base_model"


def test_a_directory_that_is_no_model_is_model_unavailable(tmp_path: Path) -> None:
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ModelUnavailable) as caught:
        ModelRegistry(tmp_path, torch.device("cpu"), torch.float32).get(str(tmp_path / "not-a-model"))
    assert "could not load base model" in caught.value.message


def test_the_default_model_ships_as_gguf() -> None:
    path = builtin_gguf_path(DEFAULT_BASE_MODEL)
    assert path is not None and path.name.endswith(".gguf")


@pytest.mark.slow
def test_default_model_loads_from_its_cache_and_trains(smollm2_data_dir: tuple[Path, str]) -> None:
    data_dir, first_source = smollm2_data_dir
    assert first_source in ("gguf", "cache")
    cache = data_dir / "models" / safe_name(DEFAULT_BASE_MODEL)
    assert (cache / "model.safetensors").is_file() and (cache / "tokenizer.json").is_file()
    assert (cache / CACHE_MARKER).is_file()

    engine = Engine(data_dir, device="cpu")
    info = engine.create_run("smol", "u1", DEFAULT_BASE_MODEL, {"r": 8, "alpha": 16})
    assert engine.ping()["models"][0]["source"] == "cache"
    assert engine.ping()["models"][0]["revision"].startswith("sha256:")
    assert info["total_params"] > 134_000_000

    batch = [{"messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris, of course."}]}]
    losses = []
    for _ in range(3):
        losses.append(engine.forward_backward("smol", batch)["loss"])
        engine.optim_step("smol", {"learning_rate": 1e-3})
    assert losses[2] < losses[0]

    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    seq = engine.sample("smol", [prompt], max_tokens=24, temperature=0)["sequences"][0][0]
    assert "Paris" in seq["text"]
    assert seq["stop_reason"] == "stop" and seq["tokens"][-1] == engine.residency.bases[DEFAULT_BASE_MODEL].base.tokenizer.eos_token_id
    assert "<|im_end|>" not in seq["text"]
