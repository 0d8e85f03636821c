"""What the API costs: the same training steps through SDK → GraphQL → worker and through the engine in process.

    .venv/bin/python bench/api_overhead.py --steps 5 --batch-size 8 --seq-len 128 [--model DIR] [--device cpu]

Both sides run the same model, LoRA config, token batch and AdamW, one after the other in this
process's machine; the first step of each is a warm-up and is not timed. The API side includes
everything a user's call pays: HTTP, auth, GraphQL, the run lock, the worker pipe, and the
metric rows written to SQLite. Last line: a JSON summary with both tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="catalogue name or a local model directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default="data", help="model cache to reuse (default ./data)")
    return parser.parse_args()


def token_batch(batch_size: int, seq_len: int) -> list[dict]:
    rng = random.Random(0)
    # Ids below 10k exist in every tokenizer we ship or test with.
    return [{"tokens": [rng.randrange(10_000) for _ in range(seq_len)], "weights": [1.0] * seq_len}
            for _ in range(batch_size)]


def in_process(args: argparse.Namespace, batch: list[dict], data_dir: Path) -> tuple[float, int]:
    from gpu_runtime.engine import Engine

    engine = Engine(data_dir, device=args.device)
    engine.create_run("bench-engine", "bench", args.model, LORA, seed=0)
    elapsed, tokens = 0.0, 0
    for step in range(args.steps + 1):
        start = time.perf_counter()
        result = engine.forward_backward("bench-engine", batch)
        engine.optim_step("bench-engine", ADAM)
        if step:  # step 0 warms up
            elapsed += time.perf_counter() - start
            tokens += result["num_tokens"]
    engine.delete_run("bench-engine")
    del engine
    gc.collect()
    return elapsed, tokens


def through_api(args: argparse.Namespace, batch: list[dict], data_dir: Path) -> tuple[float, int]:
    import uvicorn
    import yaml

    from app.db import Database
    from app.server import create_app
    from app.services.keys import KeyService
    from app.services.users import UserService
    from app.settings import Settings
    from rewardsignal import SignalClient

    catalog = data_dir / "bench-models.yaml"
    catalog.write_text(yaml.safe_dump({"models": [{"name": "bench-model", "path": args.model,
                                                    "parameters": 135_000_000}]}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = Settings(_env_file=None, data_dir=data_dir, port=port, device=args.device, models_file=catalog,
                        default_model="bench-model", bootstrap_admin=False)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    import asyncio

    async def make_key() -> str:
        db = Database(settings.resolved_database_url)
        user, _ = await UserService(db).get_or_create("bench@localhost")
        secret, _ = await KeyService(db).create(user, "bench")
        await db.dispose()
        return secret

    client = SignalClient(api_key=asyncio.run(make_key()), base_url=f"http://127.0.0.1:{port}")
    run = client.create_run(lora_r=LORA["r"], lora_alpha=LORA["alpha"], learning_rate=ADAM["learning_rate"])
    elapsed, tokens = 0.0, 0
    try:
        for step in range(args.steps + 1):
            start = time.perf_counter()
            result = run.forward_backward(batch=batch)
            run.optim_step(**{k: v for k, v in ADAM.items()})
            if step:
                elapsed += time.perf_counter() - start
                tokens += result.num_tokens
        run.delete()
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=60)
    return elapsed, tokens


def main() -> None:
    args = parse_args()
    batch = token_batch(args.batch_size, args.seq_len)
    cache = Path(args.data_dir).resolve() / "models"
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        (data_dir / "models").symlink_to(cache)  # de-quantize the default model once, reuse it after
        api_s, api_tokens = through_api(args, batch, data_dir)
        engine_s, engine_tokens = in_process(args, batch, data_dir)
    api_tps, engine_tps = api_tokens / api_s, engine_tokens / engine_s
    print(f"{'path':<28}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'SDK → GraphQL → worker':<28}{api_tokens:>10}{api_s:>10.2f}{api_tps:>12.1f}")
    print(f"{'engine in process':<28}{engine_tokens:>10}{engine_s:>10.2f}{engine_tps:>12.1f}")
    print(json.dumps({"api_tokens_per_s": round(api_tps, 2), "engine_tokens_per_s": round(engine_tps, 2),
                      "ratio": round(api_tps / engine_tps, 4), "steps": args.steps, "batch_size": args.batch_size,
                      "seq_len": args.seq_len, "model": args.model}))


if __name__ == "__main__":
    main()
