"""Training throughput through the worker (RuntimeClient → runtime) next to a plain in-process PEFT loop.

    .venv/bin/python bench/engine_throughput.py [--steps 5] [--batch-size 8] [--seq-len 128] [--quick] [--model DIR] [--threads N]

Same model, LoRA config (r=8 on the attention projections), token batch and AdamW on both sides;
the first step of each is a warm-up and is not timed. The worker's steps include what the service
always does: validation, the pipe, the scheduler's tick, the multi-LoRA layer, and journaling
each call with an fsync before its answer; a step's forward_backward and optim_step are sent together
(pipelined, as the SDK sends them). Steps alternate between the sides. Last line: JSON with both
tokens/s, their ratio, the runtime's ticks per training step, and the issue-6 target (≥ 0.95 of the
plain PEFT loop).
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from typing import Any

from benchlib import apply_threads, common_args, emit, log, scratch_data_dir, target

LORA: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.0}
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="3 steps of 8 × 64 tokens")
    return parser.parse_args()


def fixed_batch(batch_size: int, seq_len: int) -> list[dict[str, list[int] | list[float]]]:
    rng = random.Random(0)
    # Ids below 10k exist in every tokenizer we ship or test with.
    return [{"tokens": [rng.randrange(10_000) for _ in range(seq_len)], "weights": [1.0] * seq_len} for _ in range(batch_size)]


class WorkerSide:
    """The runtime in its worker process, through RuntimeClient: what the server drives."""

    def __init__(self, args: argparse.Namespace, data_dir: str, env: dict[str, str]) -> None:
        from gpu_runtime.client.runtime_client import RuntimeClient

        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.client = RuntimeClient(data_dir, device=args.device, env=env)
        self.client.start()
        self.created = self.client.call("create_run", run_id=self.run_id, user_id="bench", base_model=args.model,
                                        lora={**LORA, "target_modules": None}, seed=0)
        self.device = self.client.call("ping")["device"]

    def step(self, batch: list[dict]) -> None:
        # Pipelined, as the SDK and Tinker's cookbook send them: the optim_step goes before the pass is answered.
        trained = self.client.submit("forward_backward", run_id=self.run_id, batch=batch)
        stepped = self.client.submit("optim_step", run_id=self.run_id, adam=ADAM)
        trained.result()
        stepped.result()

    def ticks(self) -> int:
        """The runtime's ticks so far, the one answering this call excluded (it is counted once it ends)."""
        return int(self.client.call("runtime_state")["ticks"]["count"])

    def close(self) -> None:
        self.client.call("delete_run", run_id=self.run_id)
        self.client.close()


class PeftSide:
    """A plain in-process PEFT + AdamW loop on the same model, batch and settings: the baseline."""

    def __init__(self, args: argparse.Namespace, data_dir: str, batch: list[dict]) -> None:
        import torch
        from peft import LoraConfig, get_peft_model

        from gpu_runtime.compute.devices import resolve_device
        from gpu_runtime.compute.lora.wrap import linear_module_names
        from gpu_runtime.compute.models import ModelRegistry
        from gpu_runtime.compute.optimizer import new_adamw
        from gpu_runtime.contract import default_target_modules

        self.torch = torch
        self.device, dtype = resolve_device(args.device)
        model = ModelRegistry(data_dir, self.device, dtype).get(args.model).model
        self.targets = default_target_modules(linear_module_names(model))
        config = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                            target_modules=self.targets, task_type="CAUSAL_LM")
        self.model = get_peft_model(model, config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = new_adamw(self.params)  # the runtime's own AdamW: the ratio measures the engine, not the optimizer
        for group in self.optimizer.param_groups:
            group.update(lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                         weight_decay=ADAM["weight_decay"])
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
    env = apply_threads(args.threads)
    steps, batch_size, seq_len = (3, args.batch_size, 64) if args.quick else (args.steps, args.batch_size, args.seq_len)
    batch = fixed_batch(batch_size, seq_len)
    tokens = steps * batch_size * seq_len
    seconds = {"worker": 0.0, "baseline": 0.0}
    with scratch_data_dir(args.data_dir) as data_dir:
        log(f"starting the worker and loading {args.model} on both sides")
        worker, baseline = WorkerSide(args, str(data_dir), env), PeftSide(args, str(data_dir), batch)
        try:
            # Steps alternate between the two sides (and which goes first), so drift in the machine's speed hits both alike.
            ticks_from = 0
            for step in range(steps + 1):
                if step == 1:
                    ticks_from = worker.ticks() + 1  # the tick that answered that runtime_state
                sides: list[tuple[str, WorkerSide | PeftSide]] = [("worker", worker), ("baseline", baseline)]
                for name, side in sides if step % 2 == 0 else reversed(sides):
                    start = time.perf_counter()
                    side.step(batch)
                    elapsed = time.perf_counter() - start
                    if step > 0:  # step 0 warms up
                        seconds[name] += elapsed
                    log(f"step {step}{' (warm-up)' if step == 0 else ''}: {name:<8} {elapsed:6.2f} s")
            ticks_per_step = (worker.ticks() - ticks_from) / steps
        finally:
            worker.close()
            baseline.close()
    worker_tps, baseline_tps = tokens / seconds["worker"], tokens / seconds["baseline"]
    ratio = worker_tps / baseline_tps
    print(f"\nmodel {args.model}  device {worker.device}  {steps} timed steps × {batch_size} × {seq_len} tokens, "
          f"LoRA r={LORA['r']} on {baseline.targets}")
    print(f"{'path':<28}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'worker (RuntimeClient)':<28}{seconds['worker']:>10.2f}{worker_tps:>12.1f}")
    print(f"{'plain PEFT loop':<28}{seconds['baseline']:>10.2f}{baseline_tps:>12.1f}")
    print(f"ratio worker/baseline: {ratio:.3f} (target ≥ 0.95); runtime ticks per training step {ticks_per_step:.2f}")
    emit({"bench": "engine_throughput", "model": args.model, "device": worker.device, "steps": steps,
          "batch_size": batch_size, "seq_len": seq_len, "lora": worker.created["lora"],
          "worker_tokens_per_s": round(worker_tps, 1), "baseline_tokens_per_s": round(baseline_tps, 1),
          "ratio": round(ratio, 3), "ticks_per_step": round(ticks_per_step, 2),
          "targets": {"worker_vs_peft": target(ratio, ">=", 0.95)}, "all_pass": ratio >= 0.95})


if __name__ == "__main__":
    main()
