"""Host work per pass and per optimizer tick, on a micro model where the compute is negligible (issue 30, item 8).

    .venv/bin/python bench/host_overhead.py [--rounds 30] [--quick] [--threads 1] [--data-dir DIR]

A Llama of hidden 64, 4 layers and a 512-token vocabulary (SmolLM2's tokenizer; token items below 512) trains through an in-process Engine, so a
tick's time is almost all host work: per-run Python, per-layer routing, launches and syncs, which a GPU pays too
(where the same small kernels take microseconds). Four sides, alternating within each round:

- **pass_cobatch**: one tick holding 8 runs' forward_backward of 1 row each (one co-batched pass);
- **pass_one**: one tick holding one run's forward_backward of the same 8 rows;
- **tick_cobatch**: one tick holding 8 runs' optim_steps;
- **tick_one**: one tick holding one run's optim_step.

Each round runs the pass side and then its optim side (so every optim_step has gradients). The data directory lives
under /dev/shm where there is one: the journal's fsync is the disk's cost, not the host's, and would swamp the
figures. Round 0 warms up; figures are medians. Last line: JSON with both ratios and their targets
(8 runs' pass ≤ 1.2× one run's, 8 optim_steps' tick ≤ 1.5× one's).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from benchlib import apply_threads, emit, log, median, target

RUNS = 8
HIDDEN, LAYERS, VOCAB = 64, 4, 512  # a small vocabulary too: the head's compute would be the pass's cost
TOKENS = 20  # per row, as bench/cobatch.py's short texts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="8 timed rounds")
    parser.add_argument("--rank", type=int, default=32, help="LoRA r for every run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--data-dir", default=None, help="where the micro model and runs go (default: /dev/shm or tmp)")
    return parser.parse_args()


def build_micro_model(path: Path) -> str:
    """hidden 64, 4 layers, 512 ids of SmolLM2's tokenizer (its specials among them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.tiny_model import smollm2_tokenizer

    tokenizer = smollm2_tokenizer(path.parent / "smollm2-tokenizer")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def submit(engine: Any, method: str, **params: Any) -> Future:
    future: Future = Future()
    engine.submit_message(method, params, future.set_result)
    return future


def one_tick(engine: Any, futures: list[Future]) -> float:
    """Seconds of the one tick that answers `futures` (they were submitted together, so one tick takes them all)."""
    start = time.perf_counter()
    engine.tick()
    elapsed = time.perf_counter() - start
    for future in futures:
        assert future.done(), "every call of a side fits one tick"
        message = future.result()
        if "error" in message:
            raise RuntimeError(message["error"])
    return elapsed


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    rounds = 8 if args.quick else args.rounds
    from gpu_runtime.contract import ADAM_DEFAULTS
    from gpu_runtime.engine.engine import Engine

    parent = args.data_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    with tempfile.TemporaryDirectory(prefix="signal-host-", dir=parent, ignore_cleanup_errors=True) as tmp:
        model = build_micro_model(Path(tmp) / "micro-llama")
        engine = Engine(Path(tmp) / "data", device="cpu")
        lora = {"r": args.rank, "alpha": 2 * args.rank}
        runs = [f"co-{i}" for i in range(RUNS)]
        for i, run in enumerate(runs):
            engine.create_run(run, f"user-{i}", model, lora, seed=i)
        created = engine.create_run("one", "user-one", model, lora, seed=0)
        rng = random.Random(0)
        examples = [{"tokens": [rng.randrange(3, VOCAB) for _ in range(TOKENS)], "weights": [1.0] * TOKENS}
                    for _ in range(RUNS)]
        adam = dict(ADAM_DEFAULTS)

        def pass_cobatch() -> float:
            return one_tick(engine, [submit(engine, "forward_backward", run_id=run, batch=[example])
                                     for run, example in zip(runs, examples)])

        def tick_cobatch() -> float:
            return one_tick(engine, [submit(engine, "optim_step", run_id=run, adam=adam) for run in runs])

        def pass_one() -> float:
            return one_tick(engine, [submit(engine, "forward_backward", run_id="one", batch=examples)])

        def tick_one() -> float:
            return one_tick(engine, [submit(engine, "optim_step", run_id="one", adam=adam)])

        seconds: dict[str, list[float]] = {"pass_cobatch": [], "tick_cobatch": [], "pass_one": [], "tick_one": []}
        pairs = [(("pass_cobatch", pass_cobatch), ("tick_cobatch", tick_cobatch)),
                 (("pass_one", pass_one), ("tick_one", tick_one))]
        for round_number in range(rounds + 1):
            for (pass_name, pass_side), (tick_name, tick_side) in pairs[round_number % 2:] + pairs[:round_number % 2]:
                measured = pass_side(), tick_side()
                if round_number:  # round 0 warms up
                    seconds[pass_name].append(measured[0])
                    seconds[tick_name].append(measured[1])
        engine.shutdown()

    med = {name: median(values) for name, values in seconds.items()}
    pass_ratio = med["pass_cobatch"] / med["pass_one"]
    tick_ratio = med["tick_cobatch"] / med["tick_one"]
    for name, value in med.items():
        log(f"{name:<13} {value * 1000:8.2f} ms (median of {rounds})")
    log(f"8 runs' pass / one run's: {pass_ratio:.3f}   8 optim_steps' tick / one's: {tick_ratio:.3f}")
    targets = {"pass_8_runs_vs_one": target(pass_ratio, "<=", 1.2),
               "tick_8_steps_vs_one": target(tick_ratio, "<=", 1.5)}
    emit({"bench": "host_overhead", "model": f"llama hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}", "device": "cpu",
          "threads": args.threads, "runs": RUNS, "lora": created["lora"], "rounds": rounds,
          "median_ms": {name: round(s * 1000, 3) for name, s in med.items()},
          "pass_8_runs_vs_one": round(pass_ratio, 4), "tick_8_steps_vs_one": round(tick_ratio, 4),
          "targets": targets, "all_pass": all(t["pass"] for t in targets.values())})


if __name__ == "__main__":
    main()
