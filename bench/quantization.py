"""Quantized bases: the base's bytes in full precision, 8-bit and 4-bit, and a training step on each.

    .venv/bin/python bench/quantization.py [--steps 4] [--rounds 2] [--threads N]

For each precision, an in-process Engine loads the default model (SmolLM2-135M from the data dir's
cache) and one run (LoRA r=8 on q_proj/v_proj/up_proj/down_proj) trains `--steps` steps on a fixed
batch. Reported per precision:
- base bytes: every parameter and buffer of the loaded base, quantization state included (what the
  device holds for the base; the fit check's weights term);
- the median seconds of one step (forward_backward + optim_step), sides alternating over `--rounds`;
- the loss at step 0 against full precision (how much the quantized base changes the model) and
  whether the loss fell.
Targets: the whole base (embeddings and norms stay in the runtime's dtype, fp32 on CPU) at ≤ 0.55× its
full-precision bytes in 8-bit and ≤ 0.40× in 4-bit.
This runs on CPU: bitsandbytes' CPU kernels are not its CUDA ones, so the step times say nothing
about a GPU. Last line: JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchlib import apply_threads, common_args, emit, log, median, scratch_data_dir, target

BATCH = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"input": "Q: What is the capital of France?\nA:", "output": " Paris."},
]
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
KINDS = (None, "8bit", "4bit")


def base_bytes(model: Any) -> int:
    """Bytes of every tensor the base holds: parameters (packed, when quantized), buffers and quantization state."""
    import torch

    total, seen = 0, set()

    def add(tensor: torch.Tensor | None) -> None:
        nonlocal total
        if isinstance(tensor, torch.Tensor) and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()

    for tensor in [*model.parameters(), *model.buffers()]:
        add(tensor)
        state = getattr(tensor, "quant_state", None)  # 4-bit: absmax (and its own nested state), code
        while state is not None:
            add(state.absmax)
            add(state.code)
            state = getattr(state, "state2", None)
        add(getattr(tensor, "SCB", None))  # 8-bit: the per-row scales
    return total


def measure(engine: Any, model: str, kind: str | None, steps: int, run_id: str) -> dict[str, Any]:
    import time

    engine.create_run(run_id, "bench", model, LORA, seed=0, quantization=kind)
    losses, seconds = [], []
    for _ in range(steps):
        started = time.perf_counter()
        losses.append(engine.forward_backward(run_id, BATCH)["loss"])
        engine.optim_step(run_id, {"learning_rate": 1e-3})
        seconds.append(time.perf_counter() - started)
    return {"losses": losses, "seconds": seconds[1:] or seconds}  # the first step warms kernels up


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    apply_threads(args.threads)

    from gpu_runtime.engine.engine import Engine

    with scratch_data_dir(args.data_dir) as data_dir:
        engine = Engine(data_dir, device=args.device)
        sizes = {}
        for kind in KINDS:
            sizes[str(kind)] = base_bytes(engine.residency.base(args.model, kind).model)
            log(f"{kind or 'full precision'}: base {sizes[str(kind)] / 2**20:.1f} MiB")
        per_kind: dict[str, dict[str, list[float]]] = {str(k): {"losses": [], "seconds": []} for k in KINDS}
        for round_ in range(args.rounds):
            order = KINDS if round_ % 2 == 0 else KINDS[::-1]  # sides alternate, so drift does not favour one
            for kind in order:
                got = measure(engine, args.model, kind, args.steps, f"r{round_}-{kind}")
                per_kind[str(kind)]["seconds"] += got["seconds"]
                per_kind[str(kind)]["losses"] = got["losses"]  # the same seed every round: the same losses
                log(f"round {round_} {kind}: losses {[round(x, 4) for x in got['losses']]}")
    full = sizes["None"]
    results = {
        str(kind): {
            "base_bytes": sizes[str(kind)], "base_ratio": round(sizes[str(kind)] / full, 4),
            "median_step_seconds": round(median(per_kind[str(kind)]["seconds"]), 4),
            "loss_step0": round(per_kind[str(kind)]["losses"][0], 4),
            "loss_fell": per_kind[str(kind)]["losses"][-1] < per_kind[str(kind)]["losses"][0],
        } for kind in KINDS
    }
    targets = {"8bit_base_ratio": target(sizes["8bit"] / full, "<=", 0.55),
               "4bit_base_ratio": target(sizes["4bit"] / full, "<=", 0.40)}
    emit({"bench": "quantization", "model": args.model, "steps": args.steps, "rounds": args.rounds,
          "dtype": str(engine.dtype), "results": results, "targets": targets,
          "all_pass": all(t["pass"] for t in targets.values()) and all(r["loss_fell"] for r in results.values())})


if __name__ == "__main__":
    main()
