"""Decoding through the runtime's engine against transformers' `generate` with the same PEFT adapter, in tokens/s.

    .venv/bin/python bench/sampling.py [--rounds 2] [--quick] [--rows 64] [--tokens 128] [--model NAME] [--threads 1]

Three sides, each generating `--rows` sequences of `--tokens` tokens (temperature 1, fixed seeds, EOS off so every
row has its full length) from the same 64 prompts:

- **generate**: transformers' `generate` on a PEFT model of the base (LoRA r=8 on the runs' default targets, B drawn
  at random so its delta is computed, not skipped), every row in one batch.
- **one**: the runtime (an in-process Engine, one base loaded once): one sample call of every prompt on one run's
  adapter, decoded by compute/decode's DecodeEngine.
- **eight**: the same prompts split over 8 runs (8 users, a call each), co-decoded with one adapter per row.

Sides alternate within each round (their order rotates); the first round warms up and is not counted; figures are
medians. Last line: JSON with tokens per second and the ratios; the issue's CPU targets are one ≥ 2× generate and
eight ≥ 0.8× one.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future
from typing import Any

from benchlib import SHORT_TEXTS, apply_threads, common_args, emit, log, median, scratch_data_dir, target

RUNS, R = 8, 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="1 timed round of 16 rows x 32 tokens")
    parser.add_argument("--rows", type=int, default=64, help="sequences per side")
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per sequence")
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


def peft_model(engine: Any, model: str) -> Any:
    """The base under PEFT with the runs' LoRA shape, its B random (a zero B would still be computed, but say so)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from gpu_runtime.compute.lora.wrap import linear_module_names
    from gpu_runtime.compute.models import ModelRegistry
    from gpu_runtime.contract import default_target_modules

    base = ModelRegistry(str(engine.data_dir), engine.device, engine.dtype).get(model)
    targets = default_target_modules(linear_module_names(base.model))
    torch.manual_seed(0)
    peft = get_peft_model(base.model, LoraConfig(r=R, lora_alpha=2 * R, lora_dropout=0.0, target_modules=targets,
                                                 init_lora_weights=False, task_type="CAUSAL_LM"))
    return peft.eval(), base.tokenizer


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    rounds, rows, tokens = (1, 16, 32) if args.quick else (args.rounds, args.rows, args.tokens)
    import torch

    from gpu_runtime.engine.engine import Engine

    with scratch_data_dir(args.data_dir) as data_dir:
        engine = Engine(data_dir, device=args.device)
        log(f"loading {args.model}, creating {RUNS} runs (r={R}, one step each) on {engine.device}")
        runs = [f"run-{i}" for i in range(RUNS)]
        for i, run in enumerate(runs):
            engine.create_run(run, f"user-{i}", args.model, {"r": R, "alpha": 2 * R}, seed=i)
            engine.forward_backward(run, [{"text": SHORT_TEXTS[i]}])
            engine.optim_step(run, {"learning_rate": 1e-3})
        peft, tokenizer = peft_model(engine, args.model)
        texts = [SHORT_TEXTS[i % len(SHORT_TEXTS)][: 24 + i % 40] for i in range(rows)]
        prompt_ids = [list(tokenizer(t)["input_ids"]) for t in texts]
        settings: dict[str, Any] = {"max_tokens": tokens, "temperature": 1.0, "stop": []}

        def one() -> int:
            return generated(pump(engine, [submit(engine, "sample", run_id=runs[0], prompt_tokens=prompt_ids, seed=0,
                                                  **settings)]))

        def eight() -> int:
            share = -(-rows // RUNS)
            futures = [submit(engine, "sample", run_id=run, prompt_tokens=prompt_ids[i * share:(i + 1) * share],
                              seed=0, **settings) for i, run in enumerate(runs) if prompt_ids[i * share:(i + 1) * share]]
            return generated(pump(engine, futures))

        width = max(len(p) for p in prompt_ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=engine.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=engine.device)

        def generate() -> int:
            torch.manual_seed(0)
            with torch.no_grad():
                out = peft.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                    top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=pad)
            return int(out[:, width:].numel())

        sides = {"generate": generate, "one": one, "eight": eight}
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        counts: dict[str, list[int]] = {name: [] for name in sides}
        names = list(sides)
        for round_number in range(rounds + 1):
            order = names[round_number % 3:] + names[:round_number % 3]
            for name in order:
                start = time.perf_counter()
                made = sides[name]()
                elapsed = time.perf_counter() - start
                if round_number:
                    seconds[name].append(elapsed)
                    counts[name].append(made)
                log(f"round {round_number}{' (warm-up)' if not round_number else ''}: {name:<9} {elapsed:7.2f} s  "
                    f"{made} tokens")
        device = str(engine.device)
        engine.shutdown()

    throughput = {name: median([t / s for t, s in zip(counts[name], seconds[name])]) for name in sides}
    one_vs_generate = throughput["one"] / throughput["generate"]
    eight_vs_one = throughput["eight"] / throughput["one"]
    print(f"\n{args.model} on {device}: {rows} sequences x {tokens} tokens, {rounds} timed rounds (medians)")
    for name in sides:
        print(f"{name:<10}{throughput[name]:>10.1f} tokens/s")
    print(f"one / generate {one_vs_generate:.3f}   eight / one {eight_vs_one:.3f}")
    targets = {"one_vs_generate": target(one_vs_generate, ">=", 2.0, "CPU target"),
               "eight_vs_one": target(eight_vs_one, ">=", 0.8, "CPU target")}
    emit({
        "bench": "sampling", "model": args.model, "device": device, "rows": rows, "max_tokens": tokens,
        "adapters_eight": RUNS, "lora_r": R, "rounds": rounds, "quick": args.quick,
        "seconds": {name: [round(s, 3) for s in values] for name, values in seconds.items()},
        "tokens_per_second": {name: round(t, 2) for name, t in throughput.items()},
        "one_vs_generate": round(one_vs_generate, 4), "eight_vs_one": round(eight_vs_one, 4),
        "targets": targets, "all_pass": all(t["pass"] for t in targets.values()),
    })


if __name__ == "__main__":
    main()
