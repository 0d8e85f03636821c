"""Fixtures shared by every test directory. Heavy imports stay inside fixtures: app tests never pay for torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from gpu_runtime.engine import Engine


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama with SmolLM2's tokenizer, built once per session; returns its path."""
    from tests.helpers.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-model")
    return build_tiny_model(root / "tiny-llama", tokenizer_cache=root / "smollm2-tokenizer")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator["Engine"]:
    """An Engine on a fresh data directory, on CPU."""
    from gpu_runtime.engine import Engine

    yield Engine(tmp_path / "data", device="cpu")
