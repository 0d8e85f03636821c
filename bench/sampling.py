"""Sampling from snapshots: 32 concurrent sample requests × 4 samples from 8 runs' snapshots, in tokens per second.

    .venv/bin/python bench/sampling.py [--rounds 3] [--quick] [--tokens 16] [--model NAME] [--threads 1]

Three sides on one in-process Engine (one base, loaded once); each generates the same 128 sequences of
`--tokens` tokens (temperature 1, fixed seeds, so EOS is rare and lengths match across sides):

- **concurrent**: 8 runs of 8 users, each trained one step and frozen with save_weights_for_sampler; 32 sample
  requests (4 per snapshot, 4 samples each) submitted together. Snapshot samples are off their runs' queues, so the
  next tick puts every one into one decode group, each row routed to its snapshot's LoRA.
- **sequential**: the same 32 requests one after another, each answered before the next is sent.
- **ceiling** (report only): one snapshot, one request of all 32 prompts × 4 samples: 128 rows of one adapter.

Sides alternate within each round (their order rotates), the first round warms up and is not counted; figures
are medians. Last line: JSON with tokens per second and the ratios; the issue's CPU target is concurrent ≥ 2×
sequential.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future
from typing import Any

from benchlib import SHORT_TEXTS, apply_threads, common_args, emit, log, median, scratch_data_dir, target

RUNS, REQUESTS, SAMPLES = 8, 32, 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="1 timed round")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per sequence")
    return parser.parse_args()


def submit(engine: Any, method: str, **params: Any) -> Future:
    future: Future = Future()
    engine.submit_message(method, params, future.set_result)
    return future


def pump(engine: Any, futures: list[Future]) -> list[dict[str, Any]]:
    """Ticks in this thread until every future is answered; the results (the first error raised)."""
    from gpu_runtime.errors import SignalError

    while not all(f.done() for f in futures):
        engine.tick()
    results = []
    for future in futures:
        message = future.result()
        if "error" in message:
            raise SignalError.from_dict(message["error"])
        results.append(message["result"])
    return results


def generated(results: list[dict[str, Any]]) -> int:
    return sum(len(seq["tokens"]) for result in results for per_prompt in result["sequences"] for seq in per_prompt)


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    rounds = 1 if args.quick else args.rounds
    from gpu_runtime.engine.engine import Engine

    prompts = [SHORT_TEXTS[i % len(SHORT_TEXTS)][: 24 + i] for i in range(REQUESTS)]  # 32 distinct prompts
    with scratch_data_dir(args.data_dir) as data_dir:
        engine = Engine(data_dir, device=args.device)
        log(f"loading {args.model}, creating {RUNS} runs, one step each, and their snapshots on {engine.device}")
        runs = [f"run-{i}" for i in range(RUNS)]
        for i, run in enumerate(runs):
            engine.create_run(run, f"user-{i}", args.model, {"r": 8}, seed=i)
            engine.forward_backward(run, [{"text": SHORT_TEXTS[i]}])
            engine.optim_step(run, {"learning_rate": 1e-3})
            engine.save_weights_for_sampler(run, "bench")
        settings = {"max_tokens": args.tokens, "temperature": 1.0, "num_samples": SAMPLES}

        def request(i: int) -> Future:
            return submit(engine, "sample", run_id=runs[i % RUNS], snapshot="bench", prompts=[prompts[i]],
                          seed=i, **settings)

        def concurrent() -> dict[str, Any]:
            groups_before = engine.totals.decode_passes
            results = pump(engine, [request(i) for i in range(REQUESTS)])
            return {"tokens": generated(results), "decode_passes": engine.totals.decode_passes - groups_before}

        def sequential() -> dict[str, Any]:
            passes, results = engine.totals.decode_passes, []
            for i in range(REQUESTS):
                results += pump(engine, [request(i)])
            return {"tokens": generated(results), "decode_passes": engine.totals.decode_passes - passes}

        def ceiling() -> dict[str, Any]:
            passes = engine.totals.decode_passes
            results = pump(engine, [submit(engine, "sample", run_id=runs[0], snapshot="bench", prompts=prompts, seed=0,
                                           **settings)])
            return {"tokens": generated(results), "decode_passes": engine.totals.decode_passes - passes}

        sides = {"concurrent": concurrent, "sequential": sequential, "ceiling": ceiling}
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        tokens: dict[str, list[int]] = {name: [] for name in sides}
        shape: dict[str, dict[str, Any]] = {}
        names = list(sides)
        for round_number in range(rounds + 1):
            order = names[round_number % 3:] + names[:round_number % 3]
            for name in order:
                start = time.perf_counter()
                shape[name] = sides[name]()
                elapsed = time.perf_counter() - start
                if round_number:
                    seconds[name].append(elapsed)
                    tokens[name].append(shape[name]["tokens"])
                log(f"round {round_number}{' (warm-up)' if not round_number else ''}: {name:<10} {elapsed:7.2f} s  "
                    f"{shape[name]['tokens']} tokens, {shape[name]['decode_passes']} decode passes")
        engine.shutdown()

    throughput = {name: median([t / s for t, s in zip(tokens[name], seconds[name])]) for name in sides}
    vs_sequential = throughput["concurrent"] / throughput["sequential"]
    vs_ceiling = throughput["concurrent"] / throughput["ceiling"]
    print(f"\n{args.model} on {engine.device}: {REQUESTS} requests × {SAMPLES} samples × {args.tokens} tokens from "
          f"{RUNS} runs' snapshots, {rounds} timed rounds (medians)")
    print(f"{'side':<12}{'tokens/s':>10}{'decode passes':>15}")
    for name in sides:
        print(f"{name:<12}{throughput[name]:>10.1f}{shape[name]['decode_passes']:>15}")
    print(f"concurrent / sequential {vs_sequential:.3f}   concurrent / ceiling {vs_ceiling:.3f}")
    targets = {"concurrent_vs_sequential": target(vs_sequential, ">=", 2.0, "CPU target")}
    emit({
        "bench": "sampling", "model": args.model, "device": str(engine.device), "runs": RUNS, "requests": REQUESTS,
        "samples": SAMPLES, "max_tokens": args.tokens, "rounds": rounds,
        "seconds": {name: [round(s, 4) for s in values] for name, values in seconds.items()},
        "tokens_per_second": {name: round(t, 2) for name, t in throughput.items()},
        "decode_passes_per_round": {name: s["decode_passes"] for name, s in shape.items()},
        "concurrent_vs_sequential": round(vs_sequential, 4),
        "concurrent_vs_ceiling": round(vs_ceiling, 4), "ceiling_note": "report only",
        "targets": targets, "all_pass": all(t["pass"] for t in targets.values()),
    })


if __name__ == "__main__":
    main()
