"""Co-batched expert LoRA: 4 runs with LoRA on every expert of a tiny mixture-of-experts model in one tick, against
the same 4 one after another and against one run of the same rows.

    .venv/bin/python bench/moe_cobatch.py [--rounds 5] [--quick] [--rank 16] [--threads 1]

A tiny random Qwen3-MoE (transformers' own classes, 4 experts, 2 routed per token, SmolLM2's tokenizer; issue 32) is
written to a scratch directory and loaded once by an in-process Engine. Three sides, each the same 4 examples of ~20
tokens and their optim_steps, with `train_mlp` (every expert's gate_up and down, and attention):

- **cobatch**: 4 runs; the 4 forward_backward calls in one tick (one pass of the base; each expert's rows sorted into
  (expert, run) segments, the deltas by compute/lora/ops.py's grouped_expert_lora), then the 4 optim_steps.
- **sequential**: the 4 runs one after another, each forward_backward + optim_step alone.
- **ceiling**: the 4 examples as one forward_backward of one run (reported, no target).

Sides rotate within each round; the first round warms up; figures are medians. Last line: JSON, with the issue's
target (cobatch ≥ 1.5× sequential on CPU) and the ratio to the ceiling.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import REPO_ROOT, SHORT_TEXTS, alternate, apply_threads, common_args, emit, median, scratch_data_dir, target
from cobatch import pump, submit

RUNS = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="2 timed rounds")
    parser.add_argument("--rank", type=int, default=16, help="LoRA r for every run")
    return parser.parse_args()


def tiny_moe(directory: Path) -> str:
    """A tiny random Qwen3-MoE with SmolLM2's tokenizer, the tests' own builder (tests/helpers/tiny_families.py)."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.helpers.tiny_families import build_family

    return build_family("qwen3_moe", directory / "tiny-qwen3-moe", directory / "smollm2-tokenizer")


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    from gpu_runtime.contract import ADAM_DEFAULTS
    from gpu_runtime.engine.engine import Engine

    lora: dict[str, Any] = {"r": args.rank, "train_mlp": True}
    examples = [{"text": text} for text in SHORT_TEXTS[:RUNS]]
    adam = dict(ADAM_DEFAULTS)
    with scratch_data_dir(args.data_dir) as data_dir, tempfile.TemporaryDirectory(prefix="signal-moe-") as scratch:
        model = tiny_moe(Path(scratch))
        engine = Engine(data_dir, device=args.device)
        created = engine.create_run("ceiling", "user-ceiling", model, lora, seed=0)
        cobatch_runs, sequential_runs = [f"co-{i}" for i in range(RUNS)], [f"seq-{i}" for i in range(RUNS)]
        for i in range(RUNS):
            engine.create_run(cobatch_runs[i], f"user-{i}", model, lora, seed=i)
            engine.create_run(sequential_runs[i], f"user-{i}", model, lora, seed=i)
        tokenizer = engine.residency.bases[model].base.tokenizer
        lengths = [len(tokenizer(e["text"])["input_ids"]) for e in examples]

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

        sides = {"cobatch": cobatch, "sequential": sequential, "ceiling": ceiling}
        timing = alternate(sides, rounds)
        seconds, shape = timing.seconds, timing.last
        engine.shutdown()

    med = {name: median(values) for name, values in seconds.items()}
    throughput = {name: RUNS / med[name] for name in med}
    vs_sequential = throughput["cobatch"] / throughput["sequential"]
    vs_ceiling = throughput["cobatch"] / throughput["ceiling"]
    print(f"\ntiny Qwen3-MoE on {engine.device}, {RUNS} runs x 1 example of {min(lengths)}-{max(lengths)} tokens, "
          f"LoRA r={created['lora']['r']} on {created['target_modules']}, {rounds} timed rounds (medians)")
    for name in sides:
        print(f"{name:<12}{med[name]:>10.3f} s {throughput[name]:>8.2f} examples/s")
    print(f"cobatch / sequential {vs_sequential:.3f}   cobatch / ceiling {vs_ceiling:.3f}")
    emit({
        "bench": "moe_cobatch", "model": "tiny-qwen3-moe (4 experts, top-2)", "device": str(engine.device),
        "runs": RUNS, "example_tokens": lengths, "lora": created["lora"], "rounds": rounds,
        "median_seconds": {name: round(s, 4) for name, s in med.items()},
        "examples_per_second": {name: round(t, 3) for name, t in throughput.items()},
        "base_passes_per_round": {name: s["base_passes"] for name, s in shape.items()},
        "cobatch_vs_sequential": round(vs_sequential, 4), "cobatch_vs_ceiling": round(vs_ceiling, 4),
        "targets": {"cobatch_vs_sequential": target(vs_sequential, ">=", 1.5),
                    "cobatched_in_one_pass": target(shape["cobatch"]["base_passes"], "<=", 1)},
    })


if __name__ == "__main__":
    main()
