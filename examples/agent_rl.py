"""Agent RL through /v1: a model learns to call a calculator tool right, rollouts drawn with the official `openai`
client (tools, tool calls parsed by the base's chat template family), trained on the exact tokens it sampled.

Each step asks a few multiplication questions, draws a group of rollouts per question from the run's current weights
with `tools=[calculate]` and `return_token_ids`, scores each rollout's tool call, and trains with
`importance_sampling` on the rollout's exact ids and the sampler's logprobs (examples/group_advantage.py, shared with
rl_arithmetic.py): `prompt_token_ids` is the whole
rendered conversation the model saw (the tool definitions and, with a forced `tool_choice`, the call's opening
included), `token_ids` what it wrote, so there is no re-tokenization drift. The base needs a chat template that takes
tools (Qwen 2.5/3, Llama 3.1+, GPT-OSS...).

Reward: 1 for a call to `calculate` whose expression evaluates to the answer; 0.5 for a call with valid JSON
arguments; otherwise the share of the arguments' characters an arithmetic expression could use, times 0.25 (a
shaped signal a model that cannot yet write JSON can climb).

    SIGNAL_API_KEY=sk-... .venv/bin/python examples/agent_rl.py --base-model Qwen/Qwen2.5-0.5B-Instruct
    SIGNAL_API_KEY=sk-... .venv/bin/python examples/agent_rl.py --steps 2 --tool-choice calculate  # the tests' run
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import random
from typing import Any

import openai
from group_advantage import Step
from openai.types.chat import ChatCompletionToolParam

from rewardsignal import SignalClient

CALCULATE: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression such as '12 * 7'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
QUESTION = "What is {a} times {b}? Use the calculator."
ALPHABET = set("0123456789+-*/() .\"{}:expression")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float | None:
    """+, -, *, / on numbers, nothing else (never eval)."""
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(expression)
    try:
        return walk(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def reward(message: Any, answer: int) -> float:
    calls = [call for call in message.tool_calls or [] if call.type == "function"]
    if not calls or calls[0].function.name != "calculate":
        return 0.0
    arguments = calls[0].function.arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return 0.25 * sum(c in ALPHABET for c in arguments) / max(len(arguments), 1)
    expression = parsed.get("expression") if isinstance(parsed, dict) else None
    return 1.0 if isinstance(expression, str) and evaluate(expression) == answer else 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--questions", type=int, default=4, help="questions per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per question")
    parser.add_argument("--tool-choice", default="auto", help="auto, required, or a function name to force it")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="AdamW's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed and the questions'")
    parser.add_argument("--base-model", default=os.environ.get("SIGNAL_EXAMPLE_MODEL"),
                        help="a catalogue model whose chat template takes tools (default: $SIGNAL_EXAMPLE_MODEL)")
    parser.add_argument("--name", default="agent rl example", help="the run's name on the dashboard")
    args = parser.parse_args()

    client = SignalClient()  # reads SIGNAL_API_KEY and SIGNAL_BASE_URL
    run = client.create_run(base_model=args.base_model, name=args.name, lora_r=16, seed=args.seed,
                            learning_rate=args.learning_rate)
    print(f"run {run.id}: {client.base_url}/runs/{run.id}", flush=True)
    v1 = openai.OpenAI(api_key=client.api_key, base_url=f"{client.base_url}/v1")
    choice: Any = args.tool_choice if args.tool_choice in ("auto", "required", "none") else \
        {"type": "function", "function": {"name": args.tool_choice}}
    rng = random.Random(args.seed)
    for step in range(args.steps):
        batch, calls = Step(), 0
        for _ in range(args.questions):
            a, b = rng.randint(2, 19), rng.randint(2, 19)
            answer = v1.chat.completions.create(
                model=run.id, messages=[{"role": "user", "content": QUESTION.format(a=a, b=b)}], tools=[CALCULATE],
                tool_choice=choice, n=args.group, max_tokens=24, temperature=1.0, seed=args.seed * 1000 + step,
                logprobs=True, store=False, extra_body={"return_token_ids": True})
            calls += sum(bool(c.message.tool_calls) for c in answer.choices)
            rollouts = [((c.model_extra or {})["token_ids"],
                         [entry.logprob for entry in (c.logprobs.content if c.logprobs and c.logprobs.content
                                                      else [])]) for c in answer.choices]
            batch.add((answer.model_extra or {})["prompt_token_ids"], rollouts,
                      [reward(c.message, a * b) for c in answer.choices])
        batch.train(run)
        print(f"step {step + 1}: mean reward {batch.mean_reward:.3f}, tool calls {calls}/{len(batch.rewards)}, "
              f"groups with non-zero advantages {batch.moving}, trained on {len(batch.batch)} rollouts", flush=True)


if __name__ == "__main__":
    main()
