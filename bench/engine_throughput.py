"""Training throughput through the worker (WorkerClient → engine) next to a plain in-process PEFT loop.

    .venv/bin/python bench/engine_throughput.py --steps 5 --batch-size 8 --seq-len 128 [--model DIR] [--device cpu]

Same model, LoRA config, batch and AdamW on both sides; the first step of each is a warm-up and
is not timed. The worker's steps include what the service always does: validation, the pipe,
and persisting the adapter + optimizer state after every optim_step. Last line: a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_runtime.worker_client import WorkerClient  # noqa: E402

LORA = {"r": 8, "alpha": 16, "dropout": 0.0}
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default="data", help="where the model cache lives (default ./data)")
    return parser.parse_args()


def fixed_batch(batch_size: int, seq_len: int, vocab: int) -> list[dict[str, list[int] | list[float]]]:
    rng = random.Random(0)
    return [{"tokens": [rng.randrange(vocab) for _ in range(seq_len)], "weights": [1.0] * seq_len} for _ in range(batch_size)]


def through_worker(args: argparse.Namespace, batch: list[dict]) -> tuple[float, str]:
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    with WorkerClient(args.data_dir, device=args.device) as client:
        client.call("create_run", run_id=run_id, user_id="bench", base_model=args.model, lora={**LORA, "target_modules": None}, seed=0)
        times = []
        for step in range(args.steps + 1):
            start = time.perf_counter()
            client.call("forward_backward", run_id=run_id, batch=batch)
            client.call("optim_step", run_id=run_id, adam=ADAM)
            if step > 0:  # step 0 warms up
                times.append(time.perf_counter() - start)
        device = client.call("ping")["device"]
        client.call("delete_run", run_id=run_id)
    return sum(times), device


def plain_peft(args: argparse.Namespace, batch: list[dict]) -> float:
    import torch
    from peft import LoraConfig, get_peft_model

    from gpu_runtime.devices import resolve_device
    from gpu_runtime.lora import default_target_modules, linear_module_names
    from gpu_runtime.models import ModelRegistry

    device, dtype = resolve_device(args.device)
    model = ModelRegistry(args.data_dir, device, dtype).get(args.model).model
    targets = default_target_modules(linear_module_names(model))
    config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], target_modules=targets, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"])
    input_ids = torch.tensor([item["tokens"] for item in batch], device=device)
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        loss = peft_model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ADAM["grad_clip_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - start)
    return sum(times)


def main() -> None:
    args = parse_args()
    batch = fixed_batch(args.batch_size, args.seq_len, vocab=49152 if "SmolLM2" in args.model else 1000)
    tokens = args.steps * args.batch_size * args.seq_len
    worker_s, device = through_worker(args, batch)
    baseline_s = plain_peft(args, batch)
    worker_tps, baseline_tps = tokens / worker_s, tokens / baseline_s
    print(f"\nmodel {args.model}  device {device}  {args.steps} timed steps × {args.batch_size} × {args.seq_len} tokens")
    print(f"{'path':<28}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'worker (WorkerClient)':<28}{worker_s:>10.2f}{worker_tps:>12.1f}")
    print(f"{'plain PEFT loop':<28}{baseline_s:>10.2f}{baseline_tps:>12.1f}")
    print(f"ratio worker/baseline: {worker_tps / baseline_tps:.3f}")
    print(json.dumps({"worker_tokens_per_s": round(worker_tps, 1), "baseline_tokens_per_s": round(baseline_tps, 1), "ratio": round(worker_tps / baseline_tps, 3)}))


if __name__ == "__main__":
    main()
