"""What Tinker's wire costs: the same training step through Signal's SDK (GraphQL) and through the unmodified `tinker`
SDK (/api/v1, protobuf, futures), against one live Signal server.

    .venv/bin/python bench/tinker_overhead.py --threads 1 [--steps 5] [--model DIR] [--data-dir DIR]

The step, on both sides: a forward_backward of batch 8 × 128 tokens (cross_entropy, reduction sum, per-position
logprobs returned) and an optim_step submitted before either is awaited, on two runs of the same server with the
same LoRA (rank 16, alpha 32, attention + MLP + lm_head: Tinker's defaults) and AdamW. Steps alternate between the
sides (which goes first alternates too); the first of each is a warm-up. The ratio is the issue's: the Signal SDK's
step time divided by the Tinker SDK's (>= 0.9: the Tinker path's step takes at most ~11% longer).

Then the tiny random model (tests/helpers/tiny_model.py), where compute is negligible: each operation awaited alone,
alternating sides, and the Tinker SDK's median milliseconds per operation minus the Signal SDK's (no target).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

from benchlib import BenchServer, apply_threads, common_args, emit, log, median, scratch_data_dir, target

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK's telemetry loop (served as a no-op anyway)
RANK, ALPHA = 16, 32.0  # Tinker's alpha is fixed server-side (app/tinker/models.py TINKER_LORA_ALPHA)
ADAM = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
TINY_TOKENS = 16  # one datum of this many tokens per tiny-model operation


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tiny-ops", type=int, default=20, help="timed operations of each kind per side, tiny model")
    return parser.parse_args()


def token_rows(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # ids below 10k exist in every tokenizer shipped or tested with
    return [[rng.randrange(10_000) for _ in range(length + 1)] for _ in range(count)]


class Signal:
    """Signal's own SDK on a run of the server (GraphQL), Tinker's LoRA switches."""

    def __init__(self, served: BenchServer, rows: list[list[int]]) -> None:
        self.run = served.client.create_run(lora_r=RANK, lora_alpha=ALPHA, train_attn=True, train_mlp=True,
                                            train_unembed=True, seed=0)
        self.batch = [{"model_input": row[:-1], "loss_fn_inputs": {"target_tokens": row[1:],
                                                                   "weights": [1.0] * (len(row) - 1)}} for row in rows]

    def forward_backward(self) -> Any:
        return self.run.forward_backward_async(self.batch, loss_fn="cross_entropy", reduction="sum",
                                               return_outputs=True)

    def optim_step(self) -> Any:
        return self.run.optim_step_async(**ADAM)

    def close(self) -> None:
        self.run.delete()


class Tinker:
    """The unmodified `tinker` SDK on the same server's /api/v1, with the same key in Tinker's form."""

    def __init__(self, served: BenchServer, rows: list[list[int]]) -> None:
        import tinker
        from tinker import types

        self.service = tinker.ServiceClient(base_url=served.url, api_key="tml-" + served.api_key)
        self.training = self.service.create_lora_training_client(base_model=served.model_name, rank=RANK,
                                                                 seed=0).result()
        self.data = [types.Datum(model_input=types.ModelInput.from_ints(row[:-1]),
                                 loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (len(row) - 1)})  # type: ignore[dict-item]  # Datum converts lists to TensorData
                     for row in rows]
        self.adam = types.AdamParams(**ADAM)

    def forward_backward(self) -> Any:
        return self.training.forward_backward(self.data, "cross_entropy")

    def optim_step(self) -> Any:
        return self.training.optim_step(self.adam)

    def close(self) -> None:
        self.service.holder.close()


def logprobs_of(result: Any) -> int:
    """How many per-position logprobs came back (both sides must return them)."""
    if hasattr(result, "loss_fn_outputs"):  # Tinker's ForwardBackwardOutput: TensorData per datum
        return sum(len(output["logprobs"].tolist()) for output in result.loss_fn_outputs)
    return sum(len(output["logprobs"]) for output in result["outputs"])


def alternate(sides: dict[str, Any], rounds: int, timed: Any) -> dict[str, list[float]]:
    """`timed(side)` for each side per round, the order flipping each round; round 0 warms up and is dropped."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(rounds + 1):
        for name in names if round_ % 2 == 0 else reversed(names):
            elapsed = timed(sides[name])
            if round_:
                seconds[name].append(elapsed)
            log(f"round {round_}{' (warm-up)' if not round_ else ''}: {name:<7} {elapsed * 1000:8.1f} ms")
    return seconds


def full_step(expected_logprobs: int) -> Any:
    def timed(side: Any) -> float:
        start = time.perf_counter()
        trained, stepped = side.forward_backward(), side.optim_step()  # both submitted before either is awaited
        result = trained.result()
        stepped.result()
        elapsed = time.perf_counter() - start
        assert logprobs_of(result) == expected_logprobs, "both sides return every position's logprob"
        return elapsed
    return timed


def one_op(op: str) -> Any:
    def timed(side: Any) -> float:
        start = time.perf_counter()
        getattr(side, op)().result()
        return time.perf_counter() - start
    return timed


def per_op(sides: dict[str, Any], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each side's forward_backward then optim_step (so the step has gradients), each awaited alone, the order of
    the sides flipping each round; round 0 warms up and is dropped."""
    out: dict[str, dict[str, list[float]]] = {op: {name: [] for name in sides}
                                              for op in ("forward_backward", "optim_step")}
    for round_ in range(rounds + 1):
        for name in list(sides) if round_ % 2 == 0 else list(reversed(sides)):
            for op in out:
                elapsed = one_op(op)(sides[name])
                if round_:
                    out[op][name].append(elapsed)
    return out


def measure(model: str, device: str, data_dir: Path, rows: list[list[int]], work: Any) -> Any:
    served = BenchServer(model, device, data_dir)
    sides: dict[str, Any] = {}
    try:
        sides = {"signal": Signal(served, rows), "tinker": Tinker(served, rows)}
        return work(sides)
    finally:
        for side in sides.values():
            side.close()
        served.close()


def main() -> None:
    args = parse_args()
    os.environ.update(apply_threads(args.threads))  # the server's runtime process inherits the same thread count
    positions = args.batch_size * args.seq_len
    with scratch_data_dir(args.data_dir) as data_dir:  # each server its own data directory, one model cache
        log(f"{args.model}: {args.steps} steps of {args.batch_size} × {args.seq_len} per side, alternating")
        steps = measure(args.model, args.device, data_dir, token_rows(args.batch_size, args.seq_len, 0),
                        lambda sides: alternate(sides, args.steps, full_step(positions)))
    with scratch_data_dir(args.data_dir) as data_dir:
        from tests.helpers.tiny_model import build_tiny_model

        tiny = build_tiny_model(data_dir / "tiny-llama", tokenizer_cache=data_dir / "smollm2-tokenizer")
        log(f"tiny model: {args.tiny_ops} of each operation per side, each awaited alone")
        ops = measure(tiny, args.device, data_dir, token_rows(1, TINY_TOKENS, 1),
                      lambda sides: per_op(sides, args.tiny_ops))
    per_step = {name: sum(values) / len(values) for name, values in steps.items()}
    ratio = per_step["signal"] / per_step["tinker"]
    tiny_ms = {op: {name: round(median(values) * 1000, 2) for name, values in sides.items()} for op, sides in ops.items()}
    overhead_ms = {op: round(ms["tinker"] - ms["signal"], 2) for op, ms in tiny_ms.items()}
    print(f"\nseconds per step: Signal SDK {per_step['signal']:.3f}, Tinker SDK {per_step['tinker']:.3f}; "
          f"ratio {ratio:.3f}; tiny model, Tinker minus Signal per operation (ms): {overhead_ms}")
    emit({"bench": "tinker_overhead", "model": args.model, "device": args.device, "threads": args.threads,
          "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lora_rank": RANK,
          "reduction": "sum", "logprobs_returned": True,
          "seconds_per_step": {k: round(v, 4) for k, v in per_step.items()},
          "median_seconds_per_step": {k: round(median(v), 4) for k, v in steps.items()},
          "seconds": {k: [round(x, 4) for x in v] for k, v in steps.items()},
          "ratio_signal_over_tinker": round(ratio, 4),
          "ratio_note": "the issue's ratio: Signal SDK step time / Tinker SDK step time; >= 0.9 means a step through "
                        "Tinker's wire takes at most ~11% longer than through Signal's own SDK",
          "tiny_model_ms_per_operation": tiny_ms, "tiny_model_tinker_overhead_ms": overhead_ms,
          "targets": {"signal_over_tinker": target(ratio, ">=", 0.9)}})


if __name__ == "__main__":
    main()
