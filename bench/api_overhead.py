"""What the API costs: the same training steps through SDK → GraphQL → worker and through the engine in process.

    .venv/bin/python bench/api_overhead.py --steps 5 --batch-size 8 --seq-len 128 --threads 1 [--model DIR] [--device cpu]

Both sides run the same model, LoRA config, token batch and AdamW, one after the other in this
process's machine; the first step of each is a warm-up and is not timed. The API side includes
everything a user's call pays: HTTP, auth, GraphQL, the run's ticket, the worker pipe, and the
metric rows written to SQLite. Last line: a JSON summary with both tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}
LORA: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name or a local model directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default="data", help="model cache to reuse (default ./data)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads, here and in the server's runtime process (0: torch's default)")
    return parser.parse_args()


def token_batch(batch_size: int, seq_len: int) -> list[dict]:
    rng = random.Random(0)
    # Ids below 10k exist in every tokenizer we ship or test with.
    return [{"tokens": [rng.randrange(10_000) for _ in range(seq_len)], "weights": [1.0] * seq_len}
            for _ in range(batch_size)]


class InProcess:
    """The engine called directly: the baseline."""

    def __init__(self, args: argparse.Namespace, data_dir: Path) -> None:
        from gpu_runtime.engine.engine import Engine

        self.engine = Engine(data_dir, device=args.device)
        self.engine.create_run("bench-engine", "bench", args.model, LORA, seed=0)

    def step(self, batch: list[dict]) -> int:
        result = self.engine.forward_backward("bench-engine", batch)
        self.engine.optim_step("bench-engine", ADAM)
        return result["num_tokens"]

    def close(self) -> None:
        self.engine.delete_run("bench-engine")


class ThroughApi:
    """A real server (uvicorn on loopback, its own worker process, SQLite) driven by the SDK."""

    def __init__(self, args: argparse.Namespace, data_dir: Path) -> None:
        from benchlib import BenchServer

        self.served = BenchServer(args.model, args.device, data_dir)
        self.client = self.served.client
        self.run = self.client.create_run(lora_r=LORA["r"], lora_alpha=LORA["alpha"],
                                          learning_rate=ADAM["learning_rate"])

    def step(self, batch: list[dict]) -> int:
        result = self.run.forward_backward(batch=batch)
        self.run.optim_step(**ADAM)
        return result.num_tokens

    def close(self) -> None:
        self.run.delete()
        self.served.close()


def main() -> None:
    args = parse_args()
    from benchlib import apply_threads

    os.environ.update(apply_threads(args.threads))  # the server's runtime process inherits the same thread count
    batch = token_batch(args.batch_size, args.seq_len)
    cache = Path(args.data_dir).resolve() / "models"
    elapsed = {"api": 0.0, "engine": 0.0}
    tokens = {"api": 0, "engine": 0}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        (data_dir / "models").symlink_to(cache)  # de-quantize the default model once, reuse it after
        sides: dict[str, ThroughApi | InProcess] = {"api": ThroughApi(args, data_dir), "engine": InProcess(args, data_dir)}
        try:
            # Steps alternate between the two sides, so drift in the machine's speed hits both alike.
            for step in range(args.steps + 1):
                for name, side in sides.items():
                    start = time.perf_counter()
                    count = side.step(batch)
                    if step:  # step 0 warms up
                        elapsed[name] += time.perf_counter() - start
                        tokens[name] += count
        finally:
            for side in sides.values():
                side.close()
    api_tps, engine_tps = tokens["api"] / elapsed["api"], tokens["engine"] / elapsed["engine"]
    print(f"{'path':<28}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'SDK → GraphQL → worker':<28}{tokens['api']:>10}{elapsed['api']:>10.2f}{api_tps:>12.1f}")
    print(f"{'engine in process':<28}{tokens['engine']:>10}{elapsed['engine']:>10.2f}{engine_tps:>12.1f}")
    print(json.dumps({"api_tokens_per_s": round(api_tps, 2), "engine_tokens_per_s": round(engine_tps, 2),
                      "ratio": round(api_tps / engine_tps, 4), "steps": args.steps, "batch_size": args.batch_size,
                      "seq_len": args.seq_len, "threads": args.threads, "model": args.model,
                      "target": {"ratio": ">= 0.97", "pass": api_tps / engine_tps >= 0.97}}))


if __name__ == "__main__":
    main()
