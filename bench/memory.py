"""Memory: many resident runs against one, and 200 runs held within the resident budget.

    .venv/bin/python bench/memory.py [--rounds 1] [--quick] [--part a|b|both] [--group 8] [--threads N]

(a) **64 runs of LoRA r=8 on q_proj, v_proj, all resident, each trained one step** (forward_backward
    + optim_step), against one such run. Each side runs in a fresh Python process (an in-process
    Engine on the default model); the figure is the process's peak resident set size (VmHWM in
    /proc/self/status: the base model, torch, activations and every run's LoRA, gradients and AdamW
    state), 64 runs / 1 run. The runs train one after another by default (`--group 1`), so every
    pass has one row on both sides and the figure measures what resident runs cost, not a wider
    batch's activations; `--group 8` co-batches 8 runs per pass instead (its activations for 8
    rows then count against the 64-run side only). Sides alternate (1, 64, 64, 1, …) over
    `--rounds`. Target (issue 6): ≤ 1.5×.
(b) **200 runs of r=32 (the default LoRA) under the default RuntimeOptions**, each trained one step
    in co-batched groups of `--group-b`: after every tick the pool's resident bytes (LoRA + AdamW +
    gradients, as `runtime_state` reports them) must stay within `resident_bytes`, and the resident
    run count within `resident_runs`; least recently used runs are evicted (snapshotted) past it.
    Reports the most resident bytes seen, how many trained runs the budget holds (the issue asks
    ≥ 16 of r=32 on the default model), the evictions, and the process's peak RSS.

Last line: JSON with both figures and their pass/fail.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import Future
from typing import Any

from benchlib import SHORT_TEXTS, apply_threads, common_args, emit, log, median, proc_status, scratch_data_dir, target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--part", choices=["a", "b", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=1, help="(a): pairs of sides (1-run, 64-run), alternated")
    parser.add_argument("--quick", action="store_true", help="(a) only, one round")
    parser.add_argument("--runs-a", type=int, default=64)
    parser.add_argument("--group", type=int, default=1, help="(a): runs co-batched per pass (1: one after another)")
    parser.add_argument("--runs-b", type=int, default=200)
    parser.add_argument("--group-b", type=int, default=25, help="(b): runs created and trained together per group")
    parser.add_argument("--child", choices=["a", "b"], help=argparse.SUPPRESS)
    parser.add_argument("--child-runs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--child-data-dir", help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- in a fresh process ----------------------------------------------------------------------


def submit(engine: Any, method: str, **params: Any) -> Future:
    future: Future = Future()
    engine.submit_message(method, params, future.set_result)
    return future


def pump(engine: Any, futures: list[Future], after_tick: Any = None) -> None:
    from gpu_runtime.errors import SignalError

    while not all(f.done() for f in futures):
        engine.tick()
        if after_tick is not None:
            after_tick()
    for future in futures:
        if "error" in future.result():
            raise SignalError.from_dict(future.result()["error"])


def train_groups(engine: Any, run_ids: list[str], group: int, batch_of: Any, after_tick: Any = None) -> None:
    """One step for every run: forward_backward of a group's runs together (one tick), then their optim_steps."""
    for start in range(0, len(run_ids), group):
        runs = run_ids[start:start + group]
        futures = [submit(engine, "forward_backward", run_id=run, batch=batch_of(start + i)) for i, run in enumerate(runs)]
        futures += [submit(engine, "optim_step", run_id=run, adam={"learning_rate": 1e-4}) for run in runs]
        pump(engine, futures, after_tick)


def child_a(args: argparse.Namespace) -> dict[str, Any]:
    from gpu_runtime.engine.engine import Engine

    engine = Engine(args.child_data_dir, device=args.device)
    rss_start = proc_status()["VmRSS"]
    engine.residency.base(args.model)
    rss_base = proc_status()["VmRSS"]  # the weights may still be mapped, not paged in, until the first pass
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    run_ids = [f"run-{i}" for i in range(args.child_runs)]
    for i, run in enumerate(run_ids):
        engine.create_run(run, f"user-{i}", args.model, lora, seed=i)
    train_groups(engine, run_ids, args.group, lambda i: [{"text": SHORT_TEXTS[i % len(SHORT_TEXTS)]}])
    state = engine.runtime_state()
    status = proc_status()
    return {"runs": args.child_runs, "rss_start": rss_start, "rss_after_base": rss_base, "rss_end": status["VmRSS"],
            "peak_rss": status["VmHWM"], "pool_resident_bytes": state["resident_bytes"],
            "resident_runs": len(state["resident_runs"]), "evictions": state["evictions"],
            "steps": [r["step"] for r in state["resident_runs"]]}


def child_b(args: argparse.Namespace) -> dict[str, Any]:
    from gpu_runtime.engine.engine import Engine

    engine = Engine(args.child_data_dir, device=args.device)  # the default RuntimeOptions
    budget = engine.options
    seen = {"max_bytes": 0, "max_runs": 0, "ticks": 0, "over_budget_ticks": 0}

    def after_tick() -> None:
        resident, runs = engine.residency.resident_bytes(), len(engine.residency.runs)
        seen["max_bytes"] = max(seen["max_bytes"], resident)
        seen["max_runs"] = max(seen["max_runs"], runs)
        seen["ticks"] += 1
        seen["over_budget_ticks"] += resident > budget.resident_bytes or runs > budget.resident_runs

    batch = [{"tokens": [1000, 2000, 3000, 4000], "weights": [1.0] * 4}]
    started, first_bytes = time.monotonic(), None
    for start in range(0, args.child_runs, args.group_b):
        run_ids = [f"run-{i}" for i in range(start, min(start + args.group_b, args.child_runs))]
        futures = [submit(engine, "create_run", run_id=run, user_id=f"user-{run}", base_model=args.model, lora=None,
                          seed=i) for i, run in enumerate(run_ids)]
        pump(engine, futures, after_tick)
        train_groups(engine, run_ids, len(run_ids), lambda i: batch, after_tick)
        state = engine.runtime_state()
        if first_bytes is None and state["resident_runs"]:
            first_bytes = state["resident_runs"][0]["bytes"]
        seen["max_bytes_reported"] = max(seen.get("max_bytes_reported", 0), state["resident_bytes"])
        print(f"  {start + len(run_ids)} runs trained: {len(state['resident_runs'])} resident "
              f"({state['resident_bytes'] / 2**20:.0f} MiB), {state['evictions']} evicted, "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    state = engine.runtime_state()
    steps = {r["run_id"]: r["step"] for r in state["resident_runs"]}
    return {"runs": args.child_runs, "budget_bytes": budget.resident_bytes, "budget_runs": budget.resident_runs,
            "max_resident_bytes_after_ticks": seen["max_bytes"], "max_resident_bytes_reported": seen["max_bytes_reported"],
            "max_resident_runs": seen["max_runs"], "ticks": seen["ticks"], "over_budget_ticks": seen["over_budget_ticks"],
            "evictions": state["evictions"], "evicted_runs": len(state["evicted_runs"]),
            "resident_runs_at_end": len(state["resident_runs"]), "bytes_per_trained_run": first_bytes,
            "all_resident_trained": all(s == 1 for s in steps.values()), "snapshots": state["snapshots"],
            "peak_rss": proc_status()["VmHWM"]}


# ---- the parent: sides in fresh processes, alternated ------------------------------------------


def run_child(args: argparse.Namespace, part: str, runs: int, data_dir: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", part, "--child-runs", str(runs), "--child-data-dir", data_dir,
               "--model", args.model, "--device", args.device, "--threads", str(args.threads),
               "--group", str(args.group), "--group-b", str(args.group_b)]
    done = subprocess.run(command, stdout=subprocess.PIPE, check=True)
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    args = parse_args()
    if args.child:
        apply_threads(args.threads)
        result = child_a(args) if args.child == "a" else child_b(args)
        print(json.dumps(result))
        return
    parts = "a" if args.quick else args.part
    rounds = 1 if args.quick else args.rounds
    out: dict[str, Any] = {"bench": "memory", "model": args.model, "targets": {}}
    with scratch_data_dir(args.data_dir) as data_dir:
        if parts in ("a", "both"):
            results: dict[int, list[dict[str, Any]]] = {1: [], args.runs_a: []}
            for round_number in range(rounds):
                order = [1, args.runs_a] if round_number % 2 == 0 else [args.runs_a, 1]
                for runs in order:
                    log(f"(a) round {round_number + 1}/{rounds}: {runs} run(s) of r=8 on q_proj, v_proj in a fresh process")
                    child_dir = data_dir / f"a-{round_number}-{runs}"
                    child_dir.mkdir()
                    (child_dir / "models").symlink_to((data_dir / "models").resolve())
                    result = run_child(args, "a", runs, str(child_dir))
                    results[runs].append(result)
                    log(f"    peak RSS {mib(result['peak_rss'])}, at the end {mib(result['rss_end'])}, "
                        f"pool {mib(result['pool_resident_bytes'])}, {result['resident_runs']} resident, "
                        f"{result['evictions']} evicted")
            peak_one = median([r["peak_rss"] for r in results[1]])
            peak_many = median([r["peak_rss"] for r in results[args.runs_a]])
            pool_one = median([r["pool_resident_bytes"] for r in results[1]])
            pool_many = median([r["pool_resident_bytes"] for r in results[args.runs_a]])
            ratio = peak_many / peak_one
            all_resident = all(r["resident_runs"] == args.runs_a and r["evictions"] == 0 for r in results[args.runs_a])
            per_run = (peak_many - peak_one) / (args.runs_a - 1)
            print(f"(a) peak RSS: 1 run {mib(peak_one)}, {args.runs_a} runs {mib(peak_many)}: {ratio:.3f}× (target ≤ 1.5×); "
                  f"{per_run / 2**20:.2f} MiB more per extra run, of which the pool accounts "
                  f"{(pool_many - pool_one) / (args.runs_a - 1) / 2**20:.2f} MiB (LoRA + AdamW)")
            out["a"] = {
                "measure": "peak RSS (VmHWM) of a fresh process: base model + torch + activations + runs",
                "runs": args.runs_a, "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
                "cobatch_group": args.group, "rounds": rounds,
                "peak_rss_one": peak_one, "peak_rss_many": peak_many, "ratio": round(ratio, 4),
                "pool_resident_bytes_one": pool_one, "pool_resident_bytes_many": pool_many,
                "rss_per_extra_run": round(per_run), "all_resident": all_resident, "children": results,
            }
            out["targets"]["a_peak_rss_ratio"] = target(ratio, "<=", 1.5)
            out["targets"]["a_all_resident"] = target(float(all_resident), ">=", 1.0)
        if parts in ("b", "both"):
            log(f"(b) {args.runs_b} runs of r=32 under the default RuntimeOptions, trained in groups of {args.group_b}")
            child_dir = data_dir / "b"
            child_dir.mkdir()
            (child_dir / "models").symlink_to((data_dir / "models").resolve())
            result = run_child(args, "b", args.runs_b, str(child_dir))
            within = result["over_budget_ticks"] == 0
            print(f"(b) {args.runs_b} runs: most resident {mib(result['max_resident_bytes_after_ticks'])} of a "
                  f"{mib(result['budget_bytes'])} budget; it holds {result['resident_runs_at_end']} trained runs "
                  f"({mib(result['bytes_per_trained_run'] or 0)} each); {result['evictions']} evictions; "
                  f"peak RSS {mib(result['peak_rss'])}")
            out["b"] = result
            out["targets"]["b_within_budget"] = target(result["max_resident_bytes_after_ticks"] / result["budget_bytes"],
                                                       "<=", 1.0, "most resident bytes after any tick / resident_bytes")
            out["targets"]["b_default_budget_holds_16_runs"] = target(result["resident_runs_at_end"], ">=", 16,
                                                                      "trained r=32 runs resident at the end")
            out["targets"]["b_no_tick_over_budget"] = target(float(within), ">=", 1.0)
    out["all_pass"] = all(t["pass"] for t in out["targets"].values())
    emit(out)


if __name__ == "__main__":
    main()
