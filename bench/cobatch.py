"""Co-batched training: 8 runs × 1 short example each in one tick, against one run of 8 and 8 runs in turn.

    .venv/bin/python bench/cobatch.py [--rounds 3] [--quick] [--rank 32] [--model NAME] [--threads N]

Three sides on one in-process Engine (one base, loaded once), each doing the same 8 examples of
~20 tokens and their optim_steps:

- **cobatch**: 8 runs of 8 users; the 8 forward_backward calls are submitted together and the
  scheduler puts them in one tick (one forward and backward pass of the base, rows routed to each
  run's LoRA), then the 8 optim_steps in the next tick.
- **ceiling**: the same 8 examples as one forward_backward of one run, then one optim_step.
- **sequential**: the 8 runs one after another, each forward_backward + optim_step alone.

Sides alternate within each round (their order rotates each round), so drift in the machine's
speed hits them alike; the first round warms up and is not counted; figures are medians of rounds.
Last line: JSON with the three throughput ratios and the issue's CPU targets (cobatch ≥ 0.9 of
the ceiling, ≥ 1.15× sequential; on a CUDA GPU the issue asks ≥ 2× sequential).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future
from typing import Any

from benchlib import SHORT_TEXTS, alternate, apply_threads, common_args, emit, log, median, scratch_data_dir, target

RUNS = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="2 timed rounds")
    parser.add_argument("--rank", type=int, default=None, help="LoRA r for every run (default: the contract's, 32)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed rounds, profile one cobatch and one ceiling round: top ops in the JSON")
    return parser.parse_args()


def pump(engine: Any, futures: list[Future]) -> int:
    """Run ticks in this thread until every future is answered; raise the first error. Returns the ticks run."""
    from gpu_runtime.errors import SignalError

    ticks = 0
    while not all(f.done() for f in futures):
        engine.tick()
        ticks += 1
    for future in futures:
        message = future.result()
        if "error" in message:
            raise SignalError.from_dict(message["error"])
    return ticks


def top_ops(side: Any, count: int = 12) -> dict[str, Any]:
    """One round of `side` under torch's profiler: the ops that took the most self time (device time where there
    is a device), to say where a round's time goes beyond the base's pass."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        side()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    log(averages.table(sort_by=key, row_limit=25))
    events = sorted(averages, key=lambda e: getattr(e, key), reverse=True)[:count]
    # Busy well below wall (under the profiler's own overhead): the round waits on the host, launching kernels.
    return {"wall_ms": round(wall * 1000, 1), "busy_ms": round(sum(getattr(e, key) for e in averages) / 1000, 1),
            "ops": [{"op": e.key, "calls": e.count, "self_ms": round(getattr(e, key) / 1000, 3),
                     "self_cpu_ms": round(e.self_cpu_time_total / 1000, 3)} for e in events]}


def submit(engine: Any, method: str, **params: Any) -> Future:
    future: Future = Future()
    engine.submit_message(method, params, future.set_result)
    return future


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    from gpu_runtime.contract import ADAM_DEFAULTS
    from gpu_runtime.engine.engine import Engine

    lora = {} if args.rank is None else {"r": args.rank}
    examples = [{"text": text} for text in SHORT_TEXTS[:RUNS]]
    with scratch_data_dir(args.data_dir) as data_dir:
        engine = Engine(data_dir, device=args.device)
        log(f"loading {args.model} and creating {2 * RUNS + 1} runs on {engine.device}")
        created = engine.create_run("ceiling", "user-ceiling", args.model, lora, seed=0)
        cobatch_runs, sequential_runs = [f"co-{i}" for i in range(RUNS)], [f"seq-{i}" for i in range(RUNS)]
        for i in range(RUNS):
            engine.create_run(cobatch_runs[i], f"user-{i}", args.model, lora, seed=i)
            engine.create_run(sequential_runs[i], f"user-{i}", args.model, lora, seed=i)
        tokenizer = engine.residency.bases[args.model].base.tokenizer
        lengths = [len(tokenizer(e["text"])["input_ids"]) for e in examples]
        adam = dict(ADAM_DEFAULTS)

        def cobatch() -> dict[str, int]:
            passes = engine.totals.base_passes
            futures = [submit(engine, "forward_backward", run_id=run, batch=[example])
                       for run, example in zip(cobatch_runs, examples)]
            futures += [submit(engine, "optim_step", run_id=run, adam=adam) for run in cobatch_runs]
            ticks = pump(engine, futures)
            return {"ticks": ticks, "base_passes": engine.totals.base_passes - passes}

        def ceiling() -> dict[str, int]:
            passes = engine.totals.base_passes
            ticks = pump(engine, [submit(engine, "forward_backward", run_id="ceiling", batch=examples),
                                  submit(engine, "optim_step", run_id="ceiling", adam=adam)])
            return {"ticks": ticks, "base_passes": engine.totals.base_passes - passes}

        def sequential() -> dict[str, int]:
            passes, ticks = engine.totals.base_passes, 0
            for run, example in zip(sequential_runs, examples):
                ticks += pump(engine, [submit(engine, "forward_backward", run_id=run, batch=[example])])
                ticks += pump(engine, [submit(engine, "optim_step", run_id=run, adam=adam)])
            return {"ticks": ticks, "base_passes": engine.totals.base_passes - passes}

        sides = {"cobatch": cobatch, "ceiling": ceiling, "sequential": sequential}
        timing = alternate(sides, rounds, describe=lambda s: f"{s['base_passes']} base passes in {s['ticks']} ticks")
        seconds, shape = timing.seconds, timing.last
        profile = {name: top_ops(sides[name]) for name in ("cobatch", "ceiling")} if args.profile else None
        state = engine.runtime_state()
        engine.shutdown()

    med = {name: median(values) for name, values in seconds.items()}
    throughput = {name: RUNS / med[name] for name in med}  # examples (each with its run's optim_step) per second
    vs_ceiling = throughput["cobatch"] / throughput["ceiling"]
    vs_sequential = throughput["cobatch"] / throughput["sequential"]
    ceiling_vs_sequential = throughput["ceiling"] / throughput["sequential"]
    cuda = str(engine.device).startswith("cuda")
    print(f"\n{args.model} on {engine.device}, {RUNS} examples of {min(lengths)}-{max(lengths)} tokens, "
          f"LoRA r={created['lora']['r']} on {created['target_modules']}, {rounds} timed rounds (medians)")
    print(f"{'side':<12}{'median s':>10}{'examples/s':>12}{'base passes':>13}")
    for name in sides:
        print(f"{name:<12}{med[name]:>10.3f}{throughput[name]:>12.2f}{shape[name]['base_passes']:>13}")
    print(f"cobatch / ceiling {vs_ceiling:.3f}   cobatch / sequential {vs_sequential:.3f}   "
          f"ceiling / sequential {ceiling_vs_sequential:.3f}")
    targets = {
        "cobatch_vs_ceiling": target(vs_ceiling, ">=", 0.9),
        "cobatch_vs_sequential": target(vs_sequential, ">=", 2.0 if cuda else 1.15,
                                        "CUDA target" if cuda else "CPU target (the issue asks >= 2 on a CUDA GPU)"),
        "cobatched_in_one_pass": target(shape["cobatch"]["base_passes"], "<=", 1),
    }
    emit({
        "bench": "cobatch", "model": args.model, "device": str(engine.device), "runs": RUNS,
        "example_tokens": lengths, "lora": created["lora"], "rounds": rounds,
        "seconds": {name: [round(s, 4) for s in values] for name, values in seconds.items()},
        "median_seconds": {name: round(s, 4) for name, s in med.items()},
        "examples_per_second": {name: round(t, 3) for name, t in throughput.items()},
        "base_passes_per_round": {name: s["base_passes"] for name, s in shape.items()},
        "cobatch_vs_ceiling": round(vs_ceiling, 4), "cobatch_vs_sequential": round(vs_sequential, 4),
        "ceiling_vs_sequential": round(ceiling_vs_sequential, 4),
        "evictions": state["evictions"], "targets": targets, **({"profile": profile} if profile else {}),
        "all_pass": all(t["pass"] for t in targets.values()),
    })

if __name__ == "__main__":
    main()
