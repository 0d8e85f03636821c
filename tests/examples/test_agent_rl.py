"""examples/agent_rl.py's short version as a user runs it (a subprocess with the SDK and the openai client) against a
live server, on the tiny model under a Hermes tool template (tests/conftest.py's tool_server): the calculator call
forced by name, so every rollout is a call whose random arguments earn different shaped rewards."""

from __future__ import annotations

import re

import pytest

from tests.examples.test_rl_dpo_sft import run_example
from tests.helpers.live_server import LiveServer

pytestmark = pytest.mark.timeout(900)
LINE = (r"step (\d+): mean reward ([\d.]+), tool calls (\d+)/(\d+), groups with non-zero advantages (\d+), "
        r"trained on (\d+) rollouts")


def test_agent_rl_short_run_trains_every_step_on_tool_calls(tool_server: LiveServer) -> None:
    out = run_example(tool_server, "agent_rl.py", "--steps", "2", "--tool-choice", "calculate",
                      "--base-model", "tiny-hermes", "--questions", "2", "--group", "3")
    steps = [tuple(map(float, found)) for found in re.findall(LINE, out)]
    assert [int(s[0]) for s in steps] == [1, 2], out
    assert all(0.0 <= s[1] <= 1.0 for s in steps)
    assert all(s[2] == s[3] == s[5] == 6 for s in steps), out  # forced: every rollout a call, every one trained on
    assert sum(s[4] for s in steps) > 0, out  # some group's rewards differed: a gradient to follow
