"""bench/gpu.sh's kernel sections: gpu_runtime/compute/lora/ops.py's Triton kernels against its torch reference.

- `lora_kernels`: the co-batched layer's op (`segmented_lora`, forward and backward) at tokens × hidden with 8 runs
  of ranks {8, 16, 32, 64} × 2, and the decode op (`rows_lora`, BGMV) at 64 rows.
- `moe_kernels`: `grouped_expert_lora` on a Qwen3-30B-A3B-shaped expert projection (hidden 2048, 768 per expert,
  128 experts, top-8): 4 runs' routed rows in one grouped call against one run's table over the same rows (the
  ceiling). The engine has no MoE LoRA layer yet, so training a MoE model end to end is a skip line of its own.
"""

from __future__ import annotations

import random
from typing import Any

from benchlib import target
from gpu_box import timed

RANKS = (8, 16, 32, 64, 8, 16, 32, 64)
# As a fraction of the reference's scale: tests/cuda/test_lora_ops_cuda.py's tolerances (its bf16 one is against an
# fp32 reference; here both sides are bf16, so the same bound is loose enough for either's rounding).
TOLERANCE = {"torch.float32": 1e-5, "torch.bfloat16": 2e-2}


def best(device: Any, fn: Any, reps: int) -> float:
    fn()
    return min(timed(device, fn) for _ in range(reps))


def rel_error(got: Any, want: Any) -> float:
    """The largest difference as a fraction of the reference's scale (tests/cuda/test_lora_ops_cuda.py's measure)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def agreement(x: Any, run: Any, impls_: list[str]) -> dict[str, Any]:
    """Triton's output and input gradient against the torch reference's on the same values, at the benchmark's size:
    the kernels' correctness where the timings are taken (the CUDA tests check it case by case)."""
    got = {}
    for impl in impls_:
        x.grad = None
        y = run(impl)
        y.float().sum().backward()
        got[impl] = (y.detach(), x.grad.detach().clone())
    if "triton" not in got:
        return {}
    (y_t, g_t), (y_r, g_r) = got["triton"], got["torch"]
    return {"forward": round(rel_error(y_t, y_r), 6), "input_grad": round(rel_error(g_t, g_r), 6)}


def impls(device: Any) -> list[str]:
    from gpu_runtime.compute.lora import ops

    return ["torch", "triton"] if device.type == "cuda" and ops.triton_installed() else ["torch"]


def lora_kernels(device: Any, dtype: Any, tokens: int, hidden: int, reps: int) -> dict[str, Any]:
    import torch

    from gpu_runtime.compute.lora import ops

    per = tokens // len(RANKS)
    table = ops.build_table([(i * per, (i + 1) * per, i, r, 2.0) for i, r in enumerate(RANKS)], device)
    A = torch.randn(len(RANKS), max(RANKS), hidden, device=device, dtype=dtype) * 0.02
    B = torch.randn(len(RANKS), hidden, max(RANKS), device=device, dtype=dtype) * 0.02
    x = torch.randn(per * len(RANKS), hidden, device=device, dtype=dtype, requires_grad=True)
    rows = 64
    rows_table = ops.build_rows_table([i % len(RANKS) if i % 8 else -1 for i in range(rows)], list(RANKS),
                                      [2.0] * len(RANKS), device)
    xr, base = torch.randn(rows, hidden, device=device, dtype=dtype), torch.zeros(rows, hidden, device=device, dtype=dtype)
    ms: dict[str, dict[str, float]] = {}
    for impl in impls(device):
        def fwd_bwd(impl: Any = impl) -> None:
            ops.segmented_lora(x, A, B, table, impl=impl).sum().backward()

        def decode(impl: Any = impl) -> None:
            ops.rows_lora(xr, A, B, rows_table, out=base.clone(), impl=impl)

        ms[impl] = {"segmented_fwd_bwd_ms": round(best(device, fwd_bwd, reps) * 1e3, 3),
                    "rows_lora_ms": round(best(device, decode, reps) * 1e3, 3)}
    out: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "ranks": list(RANKS), "decode_rows": rows,
                           "dtype": str(dtype).removeprefix("torch."), "ms": ms}
    if "triton" in ms:
        out["triton_speedup"] = {k: round(ms["torch"][k] / ms["triton"][k], 3) for k in ms["torch"]}
        errors = agreement(x, lambda impl: ops.segmented_lora(x, A, B, table, impl=impl), impls(device))
        out["triton_vs_torch_rel_error"] = errors
        out["targets"] = {"segmented_vs_reference": target(out["triton_speedup"]["segmented_fwd_bwd_ms"], ">=", 1.0),
                          "segmented_agrees": target(max(errors.values()), "<=", TOLERANCE[str(dtype)])}
    else:
        out["triton"] = "skipped: kernels run on CUDA only (TRITON_INTERPRET=1 is a correctness check, not a speed)"
    return out


def moe_kernels(device: Any, dtype: Any, tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                reps: int) -> dict[str, Any]:
    import torch

    from gpu_runtime.compute.lora import ops

    runs, rank = 4, 32
    rng = random.Random(0)
    routed = [(rng.randrange(experts), t * runs // tokens) for t in range(tokens) for _ in range(top_k)]

    def table(slots_of: Any) -> Any:
        counts: dict[tuple[int, int], int] = {}
        for expert, run in routed:
            key = (expert, slots_of(run))
            counts[key] = counts.get(key, 0) + 1
        segs, start = [], 0
        for (expert, slot), n in sorted(counts.items()):
            segs.append((start, start + n, slot, expert, rank, 2.0))
            start += n
        return ops.build_expert_tables(segs, experts, rank, device, start)

    # the expert slot buffers (compute/lora/slots.py): A [slots, E·R, in], Bᵀ [slots, R·E, out], and their gradients
    A = torch.randn(runs, experts * rank, hidden, device=device, dtype=dtype) * 0.02
    B = torch.randn(runs, rank * experts, 2 * inter, device=device, dtype=dtype) * 0.02
    into = (torch.zeros_like(A), torch.zeros_like(B))
    x = torch.randn(len(routed), hidden, device=device, dtype=dtype, requires_grad=True)
    tables = {"four_runs": table(lambda run: run), "one_run": table(lambda run: 0)}
    ms: dict[str, dict[str, float]] = {}
    for impl in impls(device):
        ms[impl] = {}
        for name, t in tables.items():
            def fwd_bwd(t: Any = t, impl: Any = impl) -> None:
                ops.grouped_expert_lora(x, A, B, t, impl=impl, grad_into=into).sum().backward()

            ms[impl][name] = round(best(device, fwd_bwd, reps) * 1e3, 3)
    fastest = ms["triton"] if "triton" in ms else ms["torch"]
    ratio = fastest["one_run"] / fastest["four_runs"]
    checks = {"four_runs_vs_one_run": target(ratio, ">=", 0.9)}
    errors = agreement(x, lambda impl: ops.grouped_expert_lora(x, A, B, tables["four_runs"], impl=impl), impls(device))
    if errors:
        checks["grouped_agrees"] = target(max(errors.values()), "<=", TOLERANCE[str(dtype)])
    return {"triton_vs_torch_rel_error": errors or "no Triton here: the torch reference only",
            "shape": {"tokens": tokens, "hidden": hidden, "expert_intermediate": inter, "experts": experts, "top_k": top_k,
                      "projection": "gate_up", "rank": rank}, "routed_rows": len(routed), "ms_fwd_bwd": ms,
            "four_runs_vs_one_run": round(ratio, 3), "targets": checks}
