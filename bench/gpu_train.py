"""bench/gpu.sh's training sections, on one in-process Engine (gpu_runtime/engine): the runtime's own code path.

- `one_run`: one run, rows × length tokens a step, r=32: tokens/s, MFU (4N FLOPs a token) and peak memory, against a
  plain PEFT loop on the same weights in fp32 and in bf16 autocast (torch's AdamW, fused on CUDA).
- `eight_runs`: 8 runs of ranks {8, 16, 32, 64} × 2, one row each, co-batched in one tick; against the one-run ceiling
  (one rank-32 run of the same 8 rows) and the 8 runs one after another; kernel launches and device-busy time of one
  co-batched and one ceiling round under the profiler, when the section's limit leaves time for them.

Every side: one warm-up step, then up to `rounds` timed steps, sides alternating, as many as the limit allows.
"""

from __future__ import annotations

import random
import time
from typing import Any

from benchlib import alternate, target
from gpu_box import Limit, Measure, launches, sync

PEAK_BF16_TFLOPS = 989.0  # H100 SXM and H200 dense bf16 (NVIDIA's datasheets): the same figure for both
RANKS = (8, 16, 32, 64, 8, 16, 32, 64)
ADAM = {"learning_rate": 1e-4}
PROFILER_SLOWDOWN = 10.0  # a profiled round, its events read back, against a plain one, until one is measured


def batch(rows: int, length: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)  # ids below 10k exist in every tokenizer shipped or tested with
    return [{"tokens": [rng.randrange(10_000) for _ in range(length)], "weights": [1.0] * length} for _ in range(rows)]


def linear_params(engine: Any, model: str) -> int:
    from torch import nn

    base = engine.residency.bases[model].model
    return sum(m.weight.numel() for m in base.modules() if isinstance(m, nn.Linear))


def rate(tokens: int, seconds: float, n: int) -> dict[str, Any]:
    tflops = tokens / seconds * 4 * n / 1e12
    return {"median_seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1), "tflops": round(tflops, 2),
            "mfu": round(tflops / PEAK_BF16_TFLOPS, 4)}


class PeftLoop:
    """The plain loop a user would write: transformers + PEFT LoRA on the same targets, torch's AdamW, clipping."""

    def __init__(self, path: str, device: Any, targets: list[str], batch_rows: list[dict[str, Any]], rank: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        self.model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                     target_modules=targets, task_type="CAUSAL_LM"))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, fused=device.type == "cuda")
        self.ids = torch.tensor([row["tokens"] for row in batch_rows], device=device)

    def step(self, autocast: bool) -> None:
        torch = self.torch
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def one_run(engine: Any, model: str, path: str, rows: int, length: int, rounds: int, baselines: bool,
            targets: dict[str, float], limit: Limit) -> dict[str, Any]:
    from gpu_runtime.compute.lora.wrap import linear_module_names
    from gpu_runtime.contract import default_target_modules

    rows_batch = batch(rows, length)
    run = f"one-{rows}x{length}"
    created = engine.create_run(run, "u-one", model, {"r": 32, "alpha": 64}, seed=0)
    device, n = engine.device, linear_params(engine, model)

    def signal() -> None:
        engine.forward_backward(run, rows_batch)
        engine.optim_step(run, ADAM)

    sides: dict[str, Any] = {"signal": signal}
    loop = None
    if baselines:
        base = engine.residency.bases[model].model
        loop = PeftLoop(path, device, default_target_modules(linear_module_names(base)), rows_batch, 32)
        sides.update(peft_fp32=lambda: loop.step(False), peft_bf16_autocast=lambda: loop.step(True))
    measure = Measure(device)
    timing = alternate(sides, rounds, measure=measure, deadline=limit.deadline)
    med = timing.medians()
    out: dict[str, Any] = {"rows": rows, "length": length, "lora": created["lora"], "linear_params": n,
                           "flops_per_token": 4 * n, "peak_tflops": PEAK_BF16_TFLOPS,
                           "timed_rounds": len(timing.seconds["signal"]),
                           "sides": {name: {**rate(rows * length, s, n), "peak_memory_gib": measure.peaks.get(name)}
                                     for name, s in med.items()}}
    checks = {}
    if baselines:
        out["signal_vs_peft_bf16"] = round(med["peft_bf16_autocast"] / med["signal"], 3)
        out["signal_vs_peft_fp32"] = round(med["peft_fp32"] / med["signal"], 3)
        checks["signal_vs_peft_bf16"] = target(out["signal_vs_peft_bf16"], ">=", targets.get("vs_peft", 1.3))
    if "mfu" in targets:
        checks["mfu"] = target(out["sides"]["signal"]["mfu"], ">=", targets["mfu"])
    out["targets"] = checks
    engine.delete_run(run)
    return out


def cobatch_round(engine: Any, runs: list[str], rows: list[Any]) -> int:
    """Each run's forward_backward of its row and its optim_step, submitted together and pumped: the round's base
    passes (1 when the runs shared one)."""
    from cobatch import pump, submit

    passes = engine.totals.base_passes
    futures = [submit(engine, "forward_backward", run_id=run, batch=[row]) for run, row in zip(runs, rows)]
    pump(engine, futures + [submit(engine, "optim_step", run_id=run, adam=ADAM) for run in runs])
    return int(engine.totals.base_passes - passes)


def ceiling_round(engine: Any, run: str, rows: list[Any]) -> None:
    """One run's forward_backward of all the rows and its optim_step: the co-batched round's ceiling."""
    from cobatch import pump, submit

    pump(engine, [submit(engine, "forward_backward", run_id=run, batch=rows),
                  submit(engine, "optim_step", run_id=run, adam=ADAM)])


def eight_runs(engine: Any, model: str, length: int, rounds: int, targets: dict[str, float], limit: Limit) -> dict[str, Any]:
    rows = batch(len(RANKS), length, seed=length)
    co = [f"co{length}-{i}" for i in range(len(RANKS))]
    seq = [f"seq{length}-{i}" for i in range(len(RANKS))]
    for i, rank in enumerate(RANKS):
        engine.create_run(co[i], f"u{i}", model, {"r": rank, "alpha": 2 * rank}, seed=i)
        engine.create_run(seq[i], f"u{i}", model, {"r": rank, "alpha": 2 * rank}, seed=i)
    ceiling_run = f"ceil{length}"
    engine.create_run(ceiling_run, "u-ceil", model, {"r": 32, "alpha": 64}, seed=0)
    from cobatch import pump, submit

    def sequential() -> None:
        for run, row in zip(seq, rows):
            pump(engine, [submit(engine, "forward_backward", run_id=run, batch=[row])])
            pump(engine, [submit(engine, "optim_step", run_id=run, adam=ADAM)])

    sides = {"cobatch": lambda: cobatch_round(engine, co, rows), "ceiling": lambda: ceiling_round(engine, ceiling_run, rows),
             "sequential": sequential}
    timing = alternate(sides, rounds, measure=Measure(engine.device), deadline=limit.deadline)
    med, one_pass = timing.medians(), timing.last["cobatch"]
    # A co-batched and a ceiling round again under the profiler, each when 3x its expected time is left: the
    # profiler's cost (its rounds and reading its events back) guessed at PROFILER_SLOWDOWN, then as measured.
    profile: dict[str, Any] = {}
    slowdown = PROFILER_SLOWDOWN
    for name in ("cobatch", "ceiling"):
        expected = med[name] * slowdown
        if limit.left() < 3 * expected:
            profile[name] = {"skipped": f"{limit.left():.1f} s left in the section, a profiled round takes ~{expected:.1f} s"}
            continue
        started = time.monotonic()
        profile[name] = launches(sides[name])
        slowdown = (time.monotonic() - started) / med[name]
    n, tokens = linear_params(engine, model), len(RANKS) * length
    vs_ceiling, vs_seq = med["ceiling"] / med["cobatch"], med["sequential"] / med["cobatch"]
    for run in co + seq + [ceiling_run]:
        engine.delete_run(run)
    checks = {"cobatch_vs_ceiling": target(vs_ceiling, ">=", targets["ceiling"]),
              "cobatch_vs_sequential": target(vs_seq, ">=", targets["sequential"]),
              "cobatched_in_one_pass": target(one_pass, "<=", 1)}
    if "tokens_per_s" in targets:
        checks["cobatch_tokens_per_s"] = target(tokens / med["cobatch"], ">=", targets["tokens_per_s"])
    return {"runs": len(RANKS), "ranks": list(RANKS), "length": length, "timed_rounds": len(timing.seconds["cobatch"]),
            "base_passes": one_pass,
            "sides": {name: rate(tokens, s, n) for name, s in med.items()},
            "cobatch_vs_ceiling": round(vs_ceiling, 4), "cobatch_vs_sequential": round(vs_seq, 4),
            "profile": profile, "targets": checks}


MOE_RUNS = 4


def moe_runs(engine: Any, model: str, length: int, rounds: int, targets: dict[str, float], limit: Limit) -> dict[str, Any]:
    rows = batch(MOE_RUNS, length, seed=length)
    lora = {"r": 32, "alpha": 64, "train_mlp": True}
    co = [f"moe{length}-{i}" for i in range(MOE_RUNS)]
    created = [engine.create_run(run, f"u{i}", model, lora, seed=i) for i, run in enumerate(co)]
    ceiling_run = f"moe-ceil{length}"
    engine.create_run(ceiling_run, "u-ceil", model, lora, seed=0)
    sides = {"cobatch": lambda: cobatch_round(engine, co, rows), "ceiling": lambda: ceiling_round(engine, ceiling_run, rows)}
    timing = alternate(sides, rounds, measure=Measure(engine.device), deadline=limit.deadline)
    med, tokens = timing.medians(), MOE_RUNS * length
    vs_ceiling = med["ceiling"] / med["cobatch"]
    for run in co + [ceiling_run]:
        engine.delete_run(run)
    return {"runs": MOE_RUNS, "length": length, "lora": created[0]["lora"],
            "timed_rounds": len(timing.seconds["cobatch"]), "base_passes": timing.last["cobatch"],
            "sides": {name: {"median_seconds": round(s, 4), "tokens_per_s": round(tokens / s, 1)} for name, s in med.items()},
            "cobatch_vs_ceiling": round(vs_ceiling, 4),
            "targets": {"cobatch_vs_ceiling": target(vs_ceiling, ">=", targets["ceiling"]),
                        "cobatched_in_one_pass": target(timing.last["cobatch"], "<=", 1)}}


def device_note(engine: Any) -> dict[str, Any]:
    sync(engine.device)
    return {"device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}
