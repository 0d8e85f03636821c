"""Group-relative RL's step for the examples (rl_arithmetic.py, agent_rl.py): every answer gets its group's advantage
(its reward minus the group's mean) and becomes a token-level datum on the exact sampled tokens and the sampler's
logprobs; the step trains on them with `importance_sampling`. A group whose answers all scored alike has advantages of
zero and contributes nothing (accepted, not refused)."""

from __future__ import annotations

from collections.abc import Sequence

from rewardsignal import Run


def advantages(scores: Sequence[float]) -> list[float]:
    """Each score minus its group's mean."""
    mean = sum(scores) / len(scores)
    return [score - mean for score in scores]


def datum(prompt: list[int], tokens: list[int], logprobs: Sequence[float], advantage: float) -> dict:
    """One answer as a token-level datum: position i predicts tokens[i + 1]; only the answer's positions carry the
    sampler's logprob and the advantage."""
    whole, before = prompt + tokens, len(prompt) - 1  # before: positions that predict prompt tokens
    return {"model_input": whole[:-1], "loss_fn_inputs": {
        "target_tokens": whole[1:], "logprobs": [0.0] * before + list(logprobs),
        "advantages": [0.0] * before + [advantage] * len(tokens)}}


class Step:
    """One step's groups in (`add`), their datums and figures kept, then trained (`train`)."""

    def __init__(self) -> None:
        self.batch: list[dict] = []
        self.rewards: list[float] = []
        self.moving = 0  # groups whose scores differed: something to learn from

    def add(self, prompt: list[int], answers: Sequence[tuple[list[int], Sequence[float]]],
            scores: Sequence[float]) -> None:
        """A group: the prompt's ids, each answer's (token ids, sampler logprobs), each answer's score."""
        shares = advantages(scores)
        self.moving += any(share != 0 for share in shares)
        self.rewards += scores
        self.batch += [datum(prompt, tokens, logprobs, share) for (tokens, logprobs), share in zip(answers, shares)]

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    def train(self, run: Run) -> None:
        # Pipelined: the optim_step is sent before the forward_backward's answer is back, and applies after it.
        trained = run.forward_backward_async(self.batch, loss_fn="importance_sampling")
        stepped = run.optim_step_async()
        trained.result(), stepped.result()
