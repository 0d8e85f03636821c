"""An agent-style RL loop (ART's pattern) on a live server with the tiny model: each step snapshots the run, draws a
group of rollouts from the snapshot through /v1/chat/completions with the official `openai` package (token ids and
logprobs returned), scores them, and trains on them with importance sampling through Signal's own SDK."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer

pytestmark = pytest.mark.timeout(600)

STEPS = 3
GROUP = 4
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something"}]


Rollout = tuple[str, list[int], list[float]]


def rollouts(client: openai.OpenAI, model: str, seed: int) -> tuple[list[int], list[Rollout]]:
    """A group of sampled chat completions: the prompt's ids and each choice's text, ids and logprobs."""
    answer = client.chat.completions.create(model=model, messages=MESSAGES, n=GROUP, max_tokens=8, temperature=1.0,
                                            seed=seed, logprobs=True, extra_body={"return_token_ids": True})
    group: list[Rollout] = []
    for choice in answer.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        ids = (choice.model_extra or {})["token_ids"]
        group.append((choice.message.content or "", ids, [entry.logprob for entry in choice.logprobs.content]))
    return (answer.model_extra or {})["prompt_token_ids"], group


def datum(prompt: list[int], ids: list[int], logprobs: list[float], advantage: float) -> dict[str, Any]:
    """The importance-sampling datum of one rollout: only the completion's positions carry weight and advantage."""
    tokens, pad = prompt + ids, [0.0] * (len(prompt) - 1)
    return {"model_input": tokens[:-1], "loss_fn_inputs": {
        "target_tokens": tokens[1:], "weights": pad + [1.0] * len(ids), "logprobs": pad + logprobs,
        "advantages": pad + [advantage] * len(ids)}}


def completion_logprobs(forward: dict[str, Any], prompt: list[int]) -> list[list[float]]:
    """Each datum's teacher-forced logprobs at the completion's positions."""
    return [list(output["logprobs"])[len(prompt) - 1:] for output in forward["outputs"]]


def test_an_agent_loop_trains_on_v1_rollouts_of_its_snapshots(live_server: LiveServer) -> None:
    key = live_server.new_user()
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4)
    client = openai.OpenAI(api_key=key, base_url=f"{live_server.url}/v1", max_retries=0, timeout=300)
    first: tuple[str, list[int], list[dict[str, Any]], list[list[float]]] | None = None
    for step in range(STEPS):
        snapshot = run.save_weights_for_sampler()
        assert snapshot["step"] == step
        prompt, group = rollouts(client, f"{run.id}@{snapshot['name']}", seed=step)
        assert all(len(ids) == len(lps) > 0 and all(math.isfinite(lp) for lp in lps) for _, ids, lps in group)
        rewards = [float(len(text)) for text, _, _ in group]  # longer answers score higher
        assert len(set(rewards)) > 1
        mean = sum(rewards) / len(rewards)
        batch = [datum(prompt, ids, lps, reward - mean) for (_, ids, lps), reward in zip(group, rewards, strict=True)]
        forced = completion_logprobs(run.forward(batch, loss_fn="importance_sampling", snapshot=snapshot["name"]),
                                     prompt)
        for (_, _, returned), teacher in zip(group, forced, strict=True):
            assert max(abs(a - b) for a, b in zip(returned, teacher, strict=True)) < 1e-4
        if first is None:
            first = (snapshot["name"], prompt, batch, forced)
        trained = run.forward_backward(batch, loss_fn="importance_sampling")
        assert math.isfinite(trained["loss"])
        assert run.optim_step(learning_rate=5e-2)["step"] == step + 1
    assert run.refresh().step == STEPS
    assert first is not None
    name, prompt, batch, before = first
    latest = run.save_weights_for_sampler()
    after = completion_logprobs(run.forward(batch, loss_fn="importance_sampling", snapshot=latest["name"]), prompt)
    assert latest["step"] == STEPS
    assert max(abs(a - b) for old, new in zip(before, after, strict=True) for a, b in zip(old, new, strict=True)) > 1e-3
    again = completion_logprobs(run.forward(batch, loss_fn="importance_sampling", snapshot=name), prompt)
    # the first snapshot kept its weights while the run trained on
    assert max(abs(a - b) for old, new in zip(before, again, strict=True) for a, b in zip(old, new, strict=True)) < 1e-6
