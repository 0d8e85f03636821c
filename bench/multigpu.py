"""Multi-GPU pools: 2 ranks (the base sharded by FSDP) against 1, on the tiny model and the default model.

    .venv/bin/python bench/multigpu.py [--rounds 5] [--quick] [--threads N] [--device auto] [--skip-default]

Two in-process engines per model, alive together: one plain, one with `local_ranks=2` (rank 0 in
this process, rank 1 a follower process; CUDA GPUs 0 and 1 where there are two, else CPU processes
over gloo). Each round, each side does the same forward_backward of 8 short examples on one run and
its optim_step; the sides alternate (their order swaps each round), the first round warms up, and
figures are medians. Each rank gets its own device's worth of compute: on CPU, torch threads are set
to half the cores (--threads), so the single side has half the machine and the 2 ranks all of it.

Reported per model: the throughput ratio (examples/s of 2 ranks over 1), and the bytes each rank
holds: its shard of the base, and the run's LoRA and AdamW state (replicated). Last line: JSON.
On CPU the ratio says what gloo and a shared memory bus cost; FSDP's aim is memory (each rank holds
half the base), so the target is on bytes; the throughput of CUDA ranks was not measured here.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchlib import REPO_ROOT, SHORT_TEXTS, apply_threads, emit, log, median, scratch_data_dir, target


def parse_args() -> argparse.Namespace:
    from gpu_runtime.client.model_files import DEFAULT_BASE_MODEL

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_BASE_MODEL, help="the default model's name or a directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default=str(REPO_ROOT / "data"), help="whose models/ cache is reused")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (0: half the CPUs)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="2 timed rounds")
    parser.add_argument("--skip-default", action="store_true", help="the tiny model only")
    return parser.parse_args()


def compare(label: str, model: str, data_dir: Path, device: str, rounds: int) -> dict[str, Any]:
    from gpu_runtime.compute.ranks import describe_rank
    from gpu_runtime.contract import ADAM_DEFAULTS
    from gpu_runtime.engine.engine import Engine

    batch = [{"text": text} for text in SHORT_TEXTS]
    # One data directory (its models/ cache shared), a run of each side's own in it.
    engines = {"1_rank": Engine(data_dir, device=device), "2_ranks": Engine(data_dir, device=device, local_ranks=2)}
    try:
        for name, engine in engines.items():
            engine.create_run(f"{label}-{name}", "user", model, {"r": 16}, seed=0)
            log(f"{model}: {name} ready on {engine.device}")
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        names = list(engines)
        for round_number in range(rounds + 1):
            for name in names if round_number % 2 else names[::-1]:
                engine = engines[name]
                start = time.perf_counter()
                engine.forward_backward(f"{label}-{name}", batch)
                engine.optim_step(f"{label}-{name}", dict(ADAM_DEFAULTS))
                elapsed = time.perf_counter() - start
                if round_number:
                    seconds[name].append(elapsed)
                log(f"{model}: round {round_number}{' (warm-up)' if not round_number else ''}: {name} {elapsed:.3f} s")
        two = engines["2_ranks"]
        assert two.ranks is not None
        ranks = two.ranks.report(two.residency)
        one = describe_rank(0, engines["1_rank"].residency)
    finally:
        for engine in engines.values():
            engine.shutdown()
    med = {name: median(values) for name, values in seconds.items()}
    per_rank = [{"base_bytes": sum(r["base_bytes"].values()), "lora_bytes": r["lora_bytes"],
                 "optimizer_bytes": r["optimizer_bytes"]} for r in ranks]
    single = {"base_bytes": sum(one["base_bytes"].values()), "lora_bytes": one["lora_bytes"],
              "optimizer_bytes": one["optimizer_bytes"]}
    return {
        "model": model, "examples": len(batch), "rounds": rounds,
        "median_seconds": {name: round(s, 4) for name, s in med.items()},
        "examples_per_second": {name: round(len(batch) / s, 3) for name, s in med.items()},
        "throughput_ratio_2_vs_1": round(med["1_rank"] / med["2_ranks"], 4),
        "bytes_per_rank": {"1_rank": [single], "2_ranks": per_rank},
        "base_share_per_rank": [round(r["base_bytes"] / single["base_bytes"], 4) for r in per_rank],
    }


def main() -> None:
    args = parse_args()
    threads = args.threads or max(1, (os.cpu_count() or 2) // 2)
    os.environ.update(apply_threads(threads))  # followers inherit it
    rounds = 2 if args.quick else args.rounds
    from tests.helpers.tiny_model import build_tiny_model

    results = {}
    with scratch_data_dir(args.data_dir) as data_dir:
        tiny = build_tiny_model(data_dir / "tiny-llama", tokenizer_cache=data_dir / "smollm2-tokenizer")
        results["tiny"] = compare("tiny", tiny, data_dir, args.device, rounds)
        if not args.skip_default:
            results["default"] = compare("default", args.model, data_dir, args.device, rounds)
    for label, result in results.items():
        print(f"{label:<8} {result['model']}: 1 rank {result['median_seconds']['1_rank']:.3f} s, "
              f"2 ranks {result['median_seconds']['2_ranks']:.3f} s per step of {result['examples']} examples; "
              f"ratio {result['throughput_ratio_2_vs_1']:.3f}; base share per rank {result['base_share_per_rank']}")
    targets = {f"{label}_half_the_base_per_rank": target(max(r["base_share_per_rank"]), "<=", 0.51)
               for label, r in results.items()}
    emit({"bench": "multigpu", "threads_per_process": threads, "results": results,
          "throughput_ratio_2_vs_1": {label: r["throughput_ratio_2_vs_1"] for label, r in results.items()},
          "targets": targets, "all_pass": all(t["pass"] for t in targets.values()),
          "note": "the CUDA multi-GPU path was not run here: CPU ranks over gloo only"})


if __name__ == "__main__":
    main()
