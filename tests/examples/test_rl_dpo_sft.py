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
from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer, free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(server: LiveServer, name: str, *args: str, key: str | None = None) -> str:
    """Its output, once it has said which run it trained, at which page URL, under the name it gave that run. `key`:
    the user it runs as (a fresh one if None)."""
    key = key or server.new_user()
    # PYTHONPATH: this checkout's SDK, whichever checkout the test venv's editable install points at.
    env = {**os.environ, "SIGNAL_API_KEY": key, "SIGNAL_BASE_URL": server.url, "PYTHONPATH": str(EXAMPLES.parent)}
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    page = re.search(rf"run (\S+): {re.escape(server.url)}/runs/(\S+)", result.stdout)
    assert page is not None and page.group(1) == page.group(2), result.stdout
    named = server.graphql("query($id: ID!) { run(id: $id) { name } }", {"id": page.group(1)}, key=key)
    assert named["data"]["run"]["name"] == name.removesuffix(".py").replace("_", " ") + " example", named
    return result.stdout


@pytest.mark.parametrize(("name", "defaults"), [
    ("rl_arithmetic.py", ["--steps STEPS", "(default: 30)", "(default: 0.0001)", "(default: rl arithmetic example)"]),
    ("dpo.py", ["(default: 10)", "(default: 0.1)", "(default: 0.0005)", "(default: dpo example)"]),
    ("sft_chat.py", ["(default: 20)", "(default: 0.0003)", "(default: sft chat example)"]),
])
def test_examples_show_their_defaults_in_help(name: str, defaults: list[str]) -> None:
    shown = subprocess.run([sys.executable, str(EXAMPLES / name), "--help"], capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert [d for d in defaults if d not in text] == [], text


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
    assert "mean reward, first step:" in out and "last step:" in out and "5 steps" not in out


def test_dpo_short_run_moves_the_margin(live_server: LiveServer) -> None:
    key = live_server.new_user()
    out = run_example(live_server, "dpo.py", "--steps", "2", "--base-model", "tiny-llama", "--learning-rate", "5e-2",
                      key=key)
    steps = [(float(loss), float(margin)) for loss, margin in
             re.findall(r"step \d+: DPO loss ([\d.]+), mean margin \(chosen minus rejected, vs reference\) (-?[\d.]+)",
                        out)]
    assert len(steps) == 2
    # Step 1 runs before any update: the policy is the base, so the margin is 0 and the loss is log 2.
    assert steps[0][1] == pytest.approx(0.0, abs=1e-4) and steps[0][0] == pytest.approx(0.6931, abs=1e-3)
    assert steps[1][1] > steps[0][1]  # one DPO step pushed chosen answers up relative to rejected ones
    # The printed DPO loss and margin are the run's own metrics too, one per step, which its page draws.
    run = SignalClient(api_key=key, base_url=live_server.url).list_runs()[0]
    for column, name in enumerate(("dpo_loss", "dpo_margin")):
        rows = run.metrics(name=f"user:{name}")
        assert [row["step"] for row in rows] == [1, 2]
        assert [row["value"] for row in rows] == pytest.approx([loss_margin[column] for loss_margin in steps], abs=1e-4)


def test_sft_chat_short_run_trains_on_assistant_turns(live_server: LiveServer) -> None:
    out = run_example(live_server, "sft_chat.py", "--steps", "2", "--base-model", "tiny-llama")
    found = re.search(r"assistant tokens trained on: \[([\d, ]+)\]", out)
    assert found is not None, out
    trained = [int(n) for n in found.group(1).split(",")]
    assert len(trained) == 3 and all(n > 0 for n in trained)
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "sample: " in out
