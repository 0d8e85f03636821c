"""Fairness: user B's short forward_backward alone, and while user A samples 16 prompts × 128 tokens.

    .venv/bin/python bench/fairness.py [--rounds 2] [--quick] [--calls 3] [--max-tokens 128] [--threads N]

Both users share one runtime process, driven through `WorkerClient` (the pipelined client the
server uses), on the default model. Each round has three phases, in an order that flips every
round so drift in the machine's speed hits them alike:

- **B alone**: B's forward_backward of one short example (~20 tokens), `--calls` times in turn;
- **A alone**: A's sample of 16 prompts × `--max-tokens` tokens (a fixed seed, so every round's
  sample is the same work);
- **together**: A's same sample in flight, and B's forward_backward calls back to back while it
  decodes. B's latencies count while the sample is still running.

Figures are medians over rounds. Target (issue 6): B's latency while A samples ≤ 3× alone (58×
before the scheduler). The sampler's slowdown (sample time with B's calls / without) is reported.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchlib import SHORT_TEXTS, apply_threads, common_args, emit, log, median, scratch_data_dir, target

PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
    "List some facts about the Moon.", "Describe your favourite meal.", "What makes a good teacher?",
    "Tell me about the history of tea.", "How do bees make honey?", "Write a poem about autumn rain.",
    "Why is the sky blue?", "Give advice to a new programmer.", "Describe a busy market in the morning.",
    "What is the water cycle?", "Write a letter to a friend far away.", "How does a compass work?",
    "Summarise the plot of a famous fairy tale.", "What should I pack for a hiking trip?",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (after a short warm-up)")
    parser.add_argument("--quick", action="store_true", help="1 round, 64-token samples")
    parser.add_argument("--calls", type=int, default=3, help="B's calls alone per round")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    env = apply_threads(args.threads)
    rounds, max_tokens = (1, min(args.max_tokens, 64)) if args.quick else (args.rounds, args.max_tokens)
    prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]
    from gpu_runtime.worker_client import WorkerClient

    b_batch = [{"text": SHORT_TEXTS[0]}]
    with scratch_data_dir(args.data_dir) as data_dir:
        client = WorkerClient(str(data_dir), device=args.device, env=env)
        client.start()
        try:
            log(f"runtime pid {client.pid}: loading {args.model}, creating runs a (user A) and b (user B)")
            client.call("create_run", run_id="a", user_id="user-a", base_model=args.model, lora=None, seed=0)
            created = client.call("create_run", run_id="b", user_id="user-b", base_model=args.model, lora=None, seed=1)
            device = client.call("ping")["device"]

            def sample() -> Any:
                return client.submit("sample", run_id="a", prompts=prompts, max_tokens=max_tokens,
                                     temperature=1.0, seed=1234)

            def b_call() -> float:
                start = time.perf_counter()
                client.call("forward_backward", run_id="b", batch=b_batch)
                return time.perf_counter() - start

            log("warm-up")
            b_call()
            client.call("sample", run_id="a", prompts=prompts[:2], max_tokens=4, seed=0)

            alone: list[float] = []
            together: list[float] = []
            sample_alone: list[float] = []
            sample_together: list[float] = []
            generated = 0

            def phase_b_alone() -> None:
                for _ in range(args.calls):
                    alone.append(b_call())
                log(f"B alone: {', '.join(f'{s:.2f}' for s in alone[-args.calls:])} s")

            def phase_a_alone() -> None:
                nonlocal generated
                start = time.perf_counter()
                result = sample().result()
                sample_alone.append(time.perf_counter() - start)
                generated = sum(len(s["tokens"]) for seqs in result["sequences"] for s in seqs)
                log(f"A alone: {sample_alone[-1]:.2f} s for {generated} tokens")

            def phase_together() -> None:
                start = time.perf_counter()
                future = sample()
                while not client.call("runtime_state")["decode_groups"] and not future.done():
                    time.sleep(0.01)  # the sample has started decoding; B's calls now meet it
                overlapped = []
                while not future.done():
                    latency = b_call()
                    if not future.done():  # answered while A was still decoding
                        overlapped.append(latency)
                future.result()
                sample_together.append(time.perf_counter() - start)
                together.extend(overlapped)
                log(f"together: A {sample_together[-1]:.2f} s; B while A decoded: "
                    f"{', '.join(f'{s:.2f}' for s in overlapped) or 'none'} s")

            phases = [phase_b_alone, phase_a_alone, phase_together]
            for round_number in range(rounds):
                log(f"round {round_number + 1}/{rounds}")
                for phase in phases if round_number % 2 == 0 else reversed(phases):
                    phase()
        finally:
            client.close()

    b_alone, b_together = median(alone), median(together)
    ratio = b_together / b_alone
    slowdown = median(sample_together) / median(sample_alone)
    print(f"\n{args.model} on {device}; A samples {len(prompts)} prompts × {max_tokens} tokens; {rounds} rounds")
    print(f"B forward_backward alone           {b_alone:8.3f} s (median of {len(alone)})")
    print(f"B forward_backward while A samples {b_together:8.3f} s (median of {len(together)}, max {max(together, default=0):.3f})")
    print(f"ratio {ratio:.2f}× (target ≤ 3×)   sampler slowdown {slowdown:.2f}× "
          f"({median(sample_alone):.2f} s alone, {median(sample_together):.2f} s with B's calls)")
    emit({
        "bench": "fairness", "model": args.model, "device": device, "transport": "WorkerClient → worker process",
        "prompts": len(prompts), "max_tokens": max_tokens, "tokens_generated_per_sample": generated, "rounds": rounds,
        "lora": created["lora"],
        "b_latency_alone_s": [round(s, 4) for s in alone], "b_latency_while_sampling_s": [round(s, 4) for s in together],
        "b_median_alone_s": round(b_alone, 4), "b_median_while_sampling_s": round(b_together, 4),
        "b_max_while_sampling_s": round(max(together, default=float("nan")), 4),
        "latency_ratio": round(ratio, 3),
        "sample_seconds_alone": [round(s, 3) for s in sample_alone],
        "sample_seconds_with_b": [round(s, 3) for s in sample_together],
        "sampler_slowdown": round(slowdown, 3),
        "targets": {"b_latency_ratio": target(ratio, "<=", 3.0, "issue 6: 58x before the scheduler")},
        "all_pass": ratio <= 3.0,
    })


if __name__ == "__main__":
    main()
