"""GRPO-style RL on a verifiable toy task: sums of two small numbers, rewarded 1 for an exact answer, else 0.

Each step samples a group of answers per prompt from the run's current weights, gives every answer its group's
advantage (reward minus the group's mean), and trains with `importance_sampling` on the exact sampled tokens and
the sampler's logprobs: datums at token level, one per answer (examples/group_advantage.py, shared with
agent_rl.py). A group whose answers all scored alike has advantages of zero and contributes nothing (accepted, not
refused).

    SIGNAL_API_KEY=sk-... .venv/bin/python examples/rl_arithmetic.py            # 30 steps on the default model
    SIGNAL_API_KEY=sk-... .venv/bin/python examples/rl_arithmetic.py --steps 2  # the short version the tests run

It prints each step's mean reward and, at the end, the mean of the first and last five steps
(fewer in a shorter run, never overlapping); it claims nothing about learning.
"""

from __future__ import annotations

import argparse
import os
import random
import re

from group_advantage import Step

from rewardsignal import SignalClient

PROMPT = "Question: What is {a} + {b}? Answer with the number only.\nAnswer:"


def reward(text: str, answer: int) -> float:
    """1 when the first number in the answer is exactly right."""
    found = re.search(r"-?\d+", text)
    return 1.0 if found is not None and int(found.group()) == answer else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--prompts", type=int, default=8, help="questions per step")
    parser.add_argument("--group", type=int, default=4, help="answers sampled per question")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed and the questions'")
    parser.add_argument("--base-model", default=os.environ.get("SIGNAL_EXAMPLE_MODEL"),
                        help="a catalogue name (default: $SIGNAL_EXAMPLE_MODEL if set, else the server's default model)%(default).0s")
    parser.add_argument("--name", default="rl arithmetic example", help="the run's name on the dashboard")
    args = parser.parse_args()

    client = SignalClient()  # reads SIGNAL_API_KEY and SIGNAL_BASE_URL
    run = client.create_run(base_model=args.base_model, name=args.name, lora_r=16, seed=args.seed, learning_rate=args.learning_rate)
    print(f"run {run.id}: {client.base_url}/runs/{run.id}", flush=True)
    rng = random.Random(args.seed)
    rewards_per_step = []
    for step in range(args.steps):
        pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(args.prompts)]
        sampled = run.sample([PROMPT.format(a=a, b=b) for a, b in pairs], num_samples=args.group, max_tokens=6,
                             temperature=1.0, seed=args.seed * 1000 + step, store=False)
        batch = Step()
        for (a, b), prompt_tokens, group in zip(pairs, sampled["prompt_tokens"], sampled["sequences"]):
            batch.add(prompt_tokens, [(answer["tokens"], answer["logprobs"]) for answer in group],
                      [reward(answer["text"], a + b) for answer in group])
        batch.train(run)
        rewards_per_step.append(batch.mean_reward)
        print(f"step {step + 1}: mean reward {rewards_per_step[-1]:.3f}, groups with non-zero advantages "
              f"{batch.moving}", flush=True)
    print(f"reward curve: {[round(r, 3) for r in rewards_per_step]}")
    edge = min(5, len(rewards_per_step) // 2)  # the first and last steps averaged never overlap: --steps 2 has one each
    if edge:
        first, last = rewards_per_step[:edge], rewards_per_step[-edge:]
        steps = "step" if edge == 1 else f"{edge} steps"
        print(f"mean reward, first {steps}: {sum(first) / edge:.3f}; last {steps}: {sum(last) / edge:.3f}")


if __name__ == "__main__":
    main()
