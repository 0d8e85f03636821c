"""Fixtures shared by every test directory. Heavy imports stay inside fixtures: app tests never pay for torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from gpu_runtime.engine import Engine
    from tests.helpers.live_server import LiveServer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama with SmolLM2's tokenizer, built once per session; returns its path."""
    from tests.helpers.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-model")
    return build_tiny_model(root / "tiny-llama", tokenizer_cache=root / "smollm2-tokenizer")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """An Engine on a fresh data directory, on CPU."""
    from gpu_runtime.engine import Engine

    yield Engine(tmp_path / "data", device="cpu")


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real Signal server (uvicorn on loopback, a real worker, SQLite) with the tiny model, per test module."""
    from tests.helpers.live_server import LiveServer, settings_for

    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-data"), tiny_model_dir))
    yield server
    server.stop()


@pytest.fixture
def key(live_server: LiveServer) -> str:
    """The API key of a fresh user on the live server."""
    return live_server.new_user()
