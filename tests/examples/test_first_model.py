"""The product README's example, run end to end on the real default model (SmolLM2-135M)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.settings import Settings
from tests.helpers.live_server import LiveServer, free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "first_model.py"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("default-model")
    server = LiveServer.start(Settings(_env_file=None, data_dir=data_dir, port=free_port(), device="cpu",
                                       bootstrap_admin=False))
    yield server
    server.stop()


@pytest.mark.slow
def test_first_model_example_trains_and_saves(default_server: LiveServer) -> None:
    key = default_server.new_user()
    env = {**os.environ, "SIGNAL_API_KEY": key, "SIGNAL_BASE_URL": default_server.url}
    result = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"Step \d+: Loss = ([\d.]+)", result.stdout)]
    assert len(losses) == 10
    assert losses[-1] < losses[0] * 0.9, losses
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in result.stdout
    assert result.stdout.count("Sample: ") == 2
    saved = re.search(r"Saved to: (\S+)", result.stdout)
    assert saved and (Path(saved.group(1)) / "adapter_config.json").is_file()
