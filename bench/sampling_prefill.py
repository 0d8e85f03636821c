"""Prefill once per prompt: one prompt x N samples against N copies of the prompt x 1 sample, and the cost of
prompt logprobs.

    .venv/bin/python bench/sampling_prefill.py [--rounds 3] [--quick] [--samples 16] [--prompt-tokens 256]
        [--max-tokens 4] [--model NAME] [--threads N]

Three sides on one in-process Engine and run, each decoding N sequences of `--max-tokens` from the same
`--prompt-tokens`-token prompt (a long prompt and few new tokens, so the prefill is most of the work):

- **once**: `prompt_tokens=[p], num_samples=N`: the prefill pass has one row, its KV cache is repeated N times;
- **per_sample**: `prompt_tokens=[p] * N, num_samples=1`: N prefill rows, what every sample cost before;
- **prompt_logprobs**: `once` plus `prompt_logprobs=True, topk_prompt_logprobs=5` (the chunked projection).

Sides alternate within each round (their order rotates), the first round warms up and is not counted; figures are
medians. Last line: JSON with seconds per side, the speed-up of `once` over `per_sample`, and the overhead of
prompt logprobs.
"""

from __future__ import annotations

import argparse
import random
import time

from benchlib import apply_threads, common_args, emit, log, median, scratch_data_dir, target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="2 timed rounds")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=4)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    from gpu_runtime.engine.engine import Engine

    rounds = 2 if args.quick else args.rounds
    prompt = [random.Random(0).randrange(10_000) for _ in range(args.prompt_tokens)]  # ids every tokenizer here has
    n = args.samples
    sides = {
        "once": {"prompt_tokens": [prompt], "num_samples": n},
        "per_sample": {"prompt_tokens": [prompt] * n, "num_samples": 1},
        "prompt_logprobs": {"prompt_tokens": [prompt], "num_samples": n, "prompt_logprobs": True,
                            "topk_prompt_logprobs": 5},
    }
    with scratch_data_dir(args.data_dir) as data_dir:
        engine = Engine(data_dir, device=args.device)
        engine.create_run("bench-sample", "bench", args.model, {"r": 8}, seed=0)
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for round_number in range(rounds + 1):
            names = list(sides)
            names = names[round_number % len(names):] + names[:round_number % len(names)]
            for name in names:
                started = time.perf_counter()
                engine.sample("bench-sample", max_tokens=args.max_tokens, seed=1, stop=[], **sides[name])
                if round_number:  # round 0 warms up
                    seconds[name].append(time.perf_counter() - started)
            log(f"round {round_number}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in seconds.items() if v))
    once, per_sample, scored = (median(seconds[name]) for name in sides)
    emit({
        "benchmark": "sampling_prefill", "model": args.model, "device": str(engine.device), "samples": n,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rounds": rounds,
        "seconds": {"once": round(once, 4), "per_sample": round(per_sample, 4), "prompt_logprobs": round(scored, 4)},
        "once_speedup_over_per_sample": target(per_sample / once, ">=", 1.0),
        "prompt_logprobs_overhead": round(scored / once, 4),
    })


if __name__ == "__main__":
    main()
