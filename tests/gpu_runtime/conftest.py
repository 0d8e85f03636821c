from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.engine.engine import Engine


@pytest.fixture
def tiny_run(engine: Engine, tiny_model_dir: str) -> str:
    engine.create_run("run-a", "user-1", tiny_model_dir, {"r": 4, "alpha": 8}, seed=1)
    return "run-a"


@pytest.fixture(scope="session")
def smollm2_data_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A data dir whose models/ cache holds SmolLM2, built once per session (the ~20 s de-quantization)."""
    import torch

    from gpu_runtime.client.model_files import DEFAULT_BASE_MODEL
    from gpu_runtime.compute.models import ModelRegistry

    data_dir = tmp_path_factory.mktemp("smollm2-data")
    first = ModelRegistry(data_dir, torch.device("cpu"), torch.float32).get(DEFAULT_BASE_MODEL)
    return data_dir, first.source
