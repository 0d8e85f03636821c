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


class WorkerSide:
    """The engine in its worker process, through WorkerClient: what the server drives."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.client = WorkerClient(args.data_dir, device=args.device)
        self.client.start()
        self.client.call("create_run", run_id=self.run_id, user_id="bench", base_model=args.model,
                         lora={**LORA, "target_modules": None}, seed=0)
        self.device = self.client.call("ping")["device"]

    def step(self, batch: list[dict]) -> None:
        self.client.call("forward_backward", run_id=self.run_id, batch=batch)
        self.client.call("optim_step", run_id=self.run_id, adam=ADAM)

    def close(self) -> None:
        self.client.call("delete_run", run_id=self.run_id)
        self.client.close()


class PeftSide:
    """A plain in-process PEFT + AdamW loop on the same model, batch and settings: the baseline."""

    def __init__(self, args: argparse.Namespace, batch: list[dict]) -> None:
        import torch
        from peft import LoraConfig, get_peft_model

        from gpu_runtime.devices import resolve_device
        from gpu_runtime.lora import default_target_modules, linear_module_names
        from gpu_runtime.models import ModelRegistry

        self.torch = torch
        self.device, dtype = resolve_device(args.device)
        model = ModelRegistry(args.data_dir, self.device, dtype).get(args.model).model
        targets = default_target_modules(linear_module_names(model))
        config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                            target_modules=targets, task_type="CAUSAL_LM")
        self.model = get_peft_model(model, config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]),
                                           eps=ADAM["eps"])
        self.input_ids = torch.tensor([item["tokens"] for item in batch], device=self.device)

    def step(self, batch: list[dict]) -> None:
        loss = self.model(input_ids=self.input_ids, labels=self.input_ids).loss
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.params, ADAM["grad_clip_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def close(self) -> None:
        pass


def main() -> None:
    args = parse_args()
    batch = fixed_batch(args.batch_size, args.seq_len, vocab=49152 if "SmolLM2" in args.model else 1000)
    tokens = args.steps * args.batch_size * args.seq_len
    worker, baseline = WorkerSide(args), PeftSide(args, batch)
    seconds = {"worker": 0.0, "baseline": 0.0}
    try:
        # Steps alternate between the two sides, so drift in the machine's speed hits both alike.
        for step in range(args.steps + 1):
            for name, side in (("worker", worker), ("baseline", baseline)):
                start = time.perf_counter()
                side.step(batch)
                if step > 0:  # step 0 warms up
                    seconds[name] += time.perf_counter() - start
    finally:
        worker.close()
        baseline.close()
    worker_tps, baseline_tps = tokens / seconds["worker"], tokens / seconds["baseline"]
    print(f"\nmodel {args.model}  device {worker.device}  {args.steps} timed steps × {args.batch_size} × {args.seq_len} tokens")
    print(f"{'path':<28}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'worker (WorkerClient)':<28}{seconds['worker']:>10.2f}{worker_tps:>12.1f}")
    print(f"{'plain PEFT loop':<28}{seconds['baseline']:>10.2f}{baseline_tps:>12.1f}")
    print(f"ratio worker/baseline: {worker_tps / baseline_tps:.3f}")
    print(json.dumps({"worker_tokens_per_s": round(worker_tps, 1), "baseline_tokens_per_s": round(baseline_tps, 1),
                      "ratio": round(worker_tps / baseline_tps, 3)}))


if __name__ == "__main__":
    main()
