"""One GRPO-style RL step through the SDK (pipelined calls to a live server) next to the same step written by hand
in process with HF `generate` and a PEFT model.

    .venv/bin/python bench/rl_step.py [--steps 3] [--threads 1] [--model DIR]

The step, on both sides: 8 prompts × 4 samples of 32 tokens (temperature 1, EOS off so every row is 32 tokens),
a reward per sample (the share of even token ids: cheap and deterministic), group advantages, an
importance-sampling forward_backward over the 32 sequences with the sampler's logprobs, and an optim_step. The
baseline batches all 32 sequences in one `generate`, computes the same sampler logprobs (log-softmax of the raw
logits), and uses the same LoRA, thread count and AdamW. Steps alternate between the sides; the first of each is a
warm-up. Last line: JSON with the seconds per step of each side and their ratio (baseline / SDK: above 1, the
service is faster). Target >= 1.3 (issue 31, on the CPU with --threads 1).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchlib import BenchServer, apply_threads, common_args, emit, log, scratch_data_dir, target

PROMPTS = [f"Question {i}: name a colour and a number between {i} and {i + 10}.\nAnswer:" for i in range(8)]
GROUP, NEW_TOKENS, R = 4, 32, 16
ADAM = {"learning_rate": 1e-5, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--steps", type=int, default=3)
    return parser.parse_args()


def reward(tokens: list[int]) -> float:
    return sum(1 for t in tokens if t % 2 == 0) / max(len(tokens), 1)


def advantages(rewards: list[float]) -> list[float]:
    """Reward minus its group's mean, group by group (GROUP samples per prompt, in order)."""
    out = []
    for i in range(0, len(rewards), GROUP):
        group = rewards[i:i + GROUP]
        out += [r - sum(group) / len(group) for r in group]
    return out


class ThroughSdk:
    """A real server (uvicorn on loopback, its runtime process, SQLite) driven by the SDK, calls pipelined."""

    def __init__(self, args: argparse.Namespace, data_dir: Path) -> None:
        self.served = BenchServer(args.model, args.device, data_dir)
        self.client = self.served.client
        self.run = self.client.create_run(lora_r=R, lora_alpha=2 * R, learning_rate=ADAM["learning_rate"], seed=0)

    def step(self, seed: int) -> float:
        sampled = self.run.sample(PROMPTS, num_samples=GROUP, max_tokens=NEW_TOKENS, temperature=1.0, stop=[],
                                  seed=seed, store=False)
        rows = [(prompt, answer) for prompt, group in zip(sampled["prompt_tokens"], sampled["sequences"])
                for answer in group]
        rewards = [reward(answer["tokens"]) for _, answer in rows]
        batch = []
        for (prompt, answer), advantage in zip(rows, advantages(rewards)):
            tokens, before = prompt + answer["tokens"], len(prompt) - 1
            batch.append({"model_input": tokens[:-1], "loss_fn_inputs": {
                "target_tokens": tokens[1:], "logprobs": [0.0] * before + list(answer["logprobs"]),
                "advantages": [0.0] * before + [advantage] * len(answer["tokens"])}})
        trained = self.run.forward_backward_async(batch, loss_fn="importance_sampling")
        stepped = self.run.optim_step_async(**ADAM)
        trained.result()
        stepped.result()
        return sum(rewards) / len(rewards)

    def close(self) -> None:
        self.run.delete()
        self.served.close()


class ByHand:
    """The same step in process: HF generate on a PEFT model, the IS loss by hand, the runtime's AdamW."""

    def __init__(self, args: argparse.Namespace, data_dir: Path) -> None:
        import torch
        from peft import LoraConfig, get_peft_model

        from gpu_runtime.compute.devices import resolve_device
        from gpu_runtime.compute.lora.wrap import linear_module_names
        from gpu_runtime.compute.models import ModelRegistry
        from gpu_runtime.compute.optimizer import new_adamw
        from gpu_runtime.contract import default_target_modules

        self.torch = torch
        self.device, dtype = resolve_device(args.device)
        base = ModelRegistry(str(data_dir), self.device, dtype).get(args.model)
        self.tokenizer = base.tokenizer
        targets = default_target_modules(linear_module_names(base.model))
        self.model = get_peft_model(base.model, LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0,
                                                           target_modules=targets, task_type="CAUSAL_LM"))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = new_adamw(self.params)
        for group in self.optimizer.param_groups:
            group.update(lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"])
        prompts = [list(self.tokenizer(p)["input_ids"]) for p in PROMPTS for _ in range(GROUP)]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        self.attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        self.width = width

    def step(self, seed: int) -> float:
        torch = self.torch
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=self.input_ids, attention_mask=self.attention, do_sample=True,
                                      temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, output_logits=True, return_dict_in_generate=True,
                                      pad_token_id=self.input_ids[0, 0].item())
        completion = out.sequences[:, self.width:]
        logits = torch.stack(out.logits, dim=1).float()  # raw logits: the unmodified model's logprobs
        sampler = torch.log_softmax(logits, -1).gather(-1, completion[..., None]).squeeze(-1)
        rewards = [reward(row.tolist()) for row in completion]
        adv = torch.tensor(advantages(rewards), device=self.device)[:, None].expand_as(sampler)
        sequences = out.sequences
        mask = torch.cat([self.attention, torch.ones_like(completion)], 1)
        logits = self.model(input_ids=sequences[:, :-1], attention_mask=mask[:, :-1]).logits.float()
        logprobs = torch.log_softmax(logits[:, self.width - 1:], -1).gather(-1, completion[..., None]).squeeze(-1)
        counted = (adv != 0).float()
        loss = -(torch.exp(logprobs - sampler) * adv * counted).sum() / counted.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, ADAM["grad_clip_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return sum(rewards) / len(rewards)

    def close(self) -> None:
        pass


def main() -> None:
    args = parse_args()
    os.environ.update(apply_threads(args.threads))  # the server's runtime process inherits the same thread count
    seconds: dict[str, list[float]] = {"sdk": [], "baseline": []}
    with scratch_data_dir(args.data_dir) as data_dir:
        log(f"starting a server and loading {args.model} on both sides")
        sdk, baseline = ThroughSdk(args, data_dir), ByHand(args, data_dir)
        try:
            for step in range(args.steps + 1):
                sides: list[tuple[str, Any]] = [("sdk", sdk), ("baseline", baseline)]
                for name, side in sides if step % 2 == 0 else reversed(sides):
                    start = time.perf_counter()
                    mean_reward = side.step(seed=step)
                    elapsed = time.perf_counter() - start
                    if step > 0:
                        seconds[name].append(elapsed)
                    log(f"step {step}{' (warm-up)' if step == 0 else ''}: {name:<8} {elapsed:6.2f} s, "
                        f"mean reward {mean_reward:.3f}")
        finally:
            sdk.close()
            baseline.close()
    per_step = {name: sum(values) / len(values) for name, values in seconds.items()}
    ratio = per_step["baseline"] / per_step["sdk"]
    print(f"\nseconds per RL step: SDK {per_step['sdk']:.2f}, by hand {per_step['baseline']:.2f}; ratio {ratio:.3f}")
    device = str(baseline.device)
    check = target(ratio, ">=", 1.3, "issue 31's target")
    emit({"bench": "rl_step", "model": args.model, "device": device, "steps": args.steps, "prompts": len(PROMPTS),
          "samples": GROUP, "new_tokens": NEW_TOKENS, "lora_r": R,
          "seconds_per_step": {k: round(v, 3) for k, v in per_step.items()},
          "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
          "ratio_baseline_over_sdk": round(ratio, 3),
          "targets": {"sdk_vs_by_hand": check}, "all_pass": check["pass"]})


if __name__ == "__main__":
    main()
