"""Issue 15's examples, each in its short version, as a user runs them: a subprocess with the SDK against a live
server. DPO and chat SFT run on the tiny model; the RL example needs a model that can sometimes add two digits, so
it runs on the default model (SmolLM2-135M)."""

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

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(server: LiveServer, name: str, *args: str) -> str:
    env = {**os.environ, "SIGNAL_API_KEY": server.new_user(), "SIGNAL_BASE_URL": server.url}
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(Settings(_env_file=None, data_dir=tmp_path_factory.mktemp("rl-default"), port=free_port(),
                                       device="cpu", bootstrap_admin=False))
    yield server
    server.stop()


@pytest.mark.slow
def test_rl_arithmetic_short_run_has_groups_to_learn_from(default_server: LiveServer) -> None:
    out = run_example(default_server, "rl_arithmetic.py", "--steps", "2")
    steps = re.findall(r"step (\d+): mean reward ([\d.]+), groups with non-zero advantages (\d+)", out)
    assert [int(s) for s, _, _ in steps] == [1, 2]
    assert all(0.0 <= float(r) <= 1.0 for _, r, _ in steps)
    assert sum(int(g) for _, _, g in steps) > 0, out  # some group's answers differed: a gradient to follow
    assert "mean reward, first 5 steps:" in out


def test_dpo_short_run_moves_the_margin(live_server: LiveServer) -> None:
    out = run_example(live_server, "dpo.py", "--steps", "2", "--base-model", "tiny-llama", "--learning-rate", "5e-2")
    steps = [(float(loss), float(margin)) for loss, margin in
             re.findall(r"step \d+: DPO loss ([\d.]+), mean margin \(chosen minus rejected, vs reference\) (-?[\d.]+)",
                        out)]
    assert len(steps) == 2
    # Step 1 runs before any update: the policy is the base, so the margin is 0 and the loss is log 2.
    assert steps[0][1] == pytest.approx(0.0, abs=1e-4) and steps[0][0] == pytest.approx(0.6931, abs=1e-3)
    assert steps[1][1] > steps[0][1]  # one DPO step pushed chosen answers up relative to rejected ones


def test_sft_chat_short_run_trains_on_assistant_turns(live_server: LiveServer) -> None:
    out = run_example(live_server, "sft_chat.py", "--steps", "2", "--base-model", "tiny-llama")
    found = re.search(r"assistant tokens trained on: \[([\d, ]+)\]", out)
    assert found is not None, out
    trained = [int(n) for n in found.group(1).split(",")]
    assert len(trained) == 3 and all(n > 0 for n in trained)
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "sample: " in out
