"""The parts of bench/gpu.sh that are not an existing benchmark: the machine, the wheels, the model, MFU, the tests' summary.

    python3 bench/gpu_bench.py env
    python3 bench/gpu_bench.py wheels --assets build/gpu-assets        # the carried wheels this machine needs
    python3 bench/gpu_bench.py model --assets build/gpu-assets --out DIR [--tiny] [--device cuda]
    python3 bench/gpu_bench.py mfu --model DIR [--device cuda] [--tiny] [--threads N]
    python3 bench/gpu_bench.py junit FILE.xml [--part NAME]            # a pytest junit report as one JSON line

Each prints progress on stderr and one JSON line last on stdout. `model` builds a random-weight Llama on SmolLM2's
tokenizer (the prepared folder's): 1B-class (Llama-3.2-1B's shape, ~1.07B parameters with tied embeddings, saved in bf16),
8B-shaped (--shape 8b, untied), a Qwen3-30B-A3B-shaped Qwen3-MoE of a few layers (--shape moe) or, with --tiny, the
tests' tiny dimensions in fp32 (the shape's tied or untied head; a tiny Qwen3-MoE for moe).
`mfu` trains through an in-process Engine (one run of 8 rows, and 8 runs of one row co-batched in one tick, sides
alternating) and counts 4N FLOPs per token: forward 2N, backward 2N for the activations' gradients (the base
is frozen, so no weight gradients; LoRA's own FLOPs and attention's quadratic term are left out, so MFU is a floor).
N is every Linear's weights (lm_head included): the matmuls a token goes through.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, cast

from benchlib import apply_threads, emit, log, median, scratch_data_dir

H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's datasheet figure for dense bf16 (no sparsity)
# Llama-3.2-1B's shape on SmolLM2's 49k vocabulary: ~1.07B parameters, 0.97B of them in the 16 layers.
ONE_B: dict[str, Any] = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "max_position_embeddings": 4096, "rope_theta": 500000.0}
# Llama-3.1-8B's dimensions on the same vocabulary: ~7.5B parameters (untied head), random bf16 built on the device.
EIGHT_B: dict[str, Any] = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                           "rope_theta": 500000.0}
# Qwen3-30B-A3B's dimensions (a Qwen3-MoE: 128 experts, 8 routed a token, expert width 768) on the same vocabulary,
# MOE_LAYERS of its 48 layers: each holds 0.6B expert parameters (1.2 GB in bf16), so a few fit the script's time.
MOE: dict[str, Any] = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                       "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096, "rope_theta": 1000000.0}
MOE_LAYERS = 2
SHAPES = {"1b": (ONE_B, True), "8b": (EIGHT_B, False), "moe": (MOE, False)}  # shape → (dimensions, tied embeddings)
# --tiny: the CPU tests' tiny Llama's dimensions (tests/helpers/tiny_model.py), built by the same code as the shapes.
TINY: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "max_position_embeddings": 256}
TINY_MOE: dict[str, Any] = {**TINY, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
ROUTER_STD = 0.06  # transformers may start a router at zero (every token to the first experts): spread, as the tests do


def emit_json(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


# ---- env, wheels -------------------------------------------------------------------------------


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def env(_: argparse.Namespace) -> None:
    import torch

    result: dict[str, Any] = {"part": "env", "python": sys.version.split()[0], "torch": torch.__version__,
                              "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    for name in ("transformers", "peft", "accelerate", "safetensors", "bitsandbytes", "tokenizers", "pytest"):
        result[name] = version(name)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        result.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 1024**3, 1),
                      capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                      multiprocessors=props.multi_processor_count, bf16=torch.cuda.is_bf16_supported())
    try:
        import bitsandbytes  # noqa: F401 - loading it is the check: its CUDA library must match this torch
        result["bitsandbytes_loads"] = True
    except Exception as exc:  # noqa: BLE001 - any failure means the quantized tests skip; say why
        result["bitsandbytes_loads"] = f"{type(exc).__name__}: {exc}"[:300]
    emit_json(result)


def wheels(args: argparse.Namespace) -> None:
    """Paths of the carried wheels to install here: a pinned one whose version differs, a fallback that is missing."""
    manifest = json.loads((Path(args.assets) / "manifest.json").read_text())
    for wheel in manifest["wheels"]:
        have = version(wheel["name"])
        if (wheel["role"] == "pinned" and have != wheel["version"]) or (wheel["role"] == "fallback" and have is None):
            print(Path(args.assets) / "wheels" / wheel["file"])
            log(f"install {wheel['name']}=={wheel['version']} (here: {have or 'none'})")


# ---- the model -----------------------------------------------------------------------------------


def model(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    started = time.monotonic()
    out, tokenizer_dir = Path(args.out), Path(args.assets) / "tokenizer"
    if not (tokenizer_dir / "tokenizer_config.json").exists():
        raise SystemExit(f"no tokenizer in {tokenizer_dir}: run make gpu-prepare (bench/gpu_prepare.py) and carry it")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dims, tied = SHAPES[args.shape]
    moe = args.shape == "moe"
    layers = args.layers or (MOE_LAYERS if moe else dims["num_hidden_layers"])
    dims = (TINY_MOE if moe else TINY) if args.tiny else {**dims, "num_hidden_layers": layers}
    dtype = torch.float32 if args.tiny else torch.bfloat16  # the tiny stand-in is the CPU tests' fp32 model
    config_class: Any = Qwen3MoeConfig if moe else LlamaConfig
    model_class: Any = Qwen3MoeForCausalLM if moe else LlamaForCausalLM
    config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied, **dims)
    torch.manual_seed(0)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    with device:  # random init on the GPU: seconds, not the CPU's minute
        built = model_class(config)
        cast(torch.nn.Module, built).to(dtype)  # in place; PreTrainedModel.to's @wraps confuses mypy
        with torch.no_grad():
            for name, param in built.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, ROUTER_STD)
    built.save_pretrained(out)
    tokenizer.save_pretrained(out)  # the Engine reads the model's own folder: weights, config and tokenizer
    del built
    path = str(out)
    if len(AutoTokenizer.from_pretrained(path)) != config.vocab_size:
        raise SystemExit(f"{path}'s tokenizer does not load as the one it was built on")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    weights = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    emit_json({"part": "model" if args.shape == "1b" else f"model_{args.shape}", "path": path, "shape": args.shape,
               "tiny": args.tiny, "dtype": str(dtype).removeprefix("torch."),
               "tied_embeddings": tied, "hidden_size": config.hidden_size,
               "layers": config.num_hidden_layers, "vocab_size": config.vocab_size, "weight_bytes": weights,
               **({"experts": config.num_experts, "experts_per_token": config.num_experts_per_tok} if moe else {}),
               "seconds": round(time.monotonic() - started, 1)})


# ---- MFU -----------------------------------------------------------------------------------------


def matmul_tflops(device: Any, dtype: Any, n: int) -> float:
    """The device's own n×n×n matmul rate: what MFU can reach here, beside the datasheet's."""
    import torch

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(args: argparse.Namespace) -> None:
    from cobatch import pump, submit
    from torch import nn

    from gpu_runtime.engine.engine import Engine

    apply_threads(args.threads)
    rows, length = (8, 64) if args.tiny else (8, args.seq_len)
    rng = random.Random(0)
    batch = [{"tokens": [rng.randrange(10_000) for _ in range(length)], "weights": [1.0] * length} for _ in range(rows)]
    lora = {"r": 32, "alpha": 64}
    adam = {"learning_rate": 1e-4}
    with scratch_data_dir(args.data_dir) as data_dir:
        engine = Engine(data_dir, device=args.device)
        log(f"loading {args.model} on {engine.device}; {rows} rows of {length} tokens per step")
        engine.create_run("one", "u0", args.model, lora, seed=0)
        many = [f"co-{i}" for i in range(rows)]
        for i, run in enumerate(many):
            engine.create_run(run, f"u{i + 1}", args.model, lora, seed=i + 1)
        base = engine.residency.bases[args.model].model
        linear_params = sum(m.weight.numel() for m in base.modules() if isinstance(m, nn.Linear))

        def one_run() -> None:
            engine.forward_backward("one", batch)
            engine.optim_step("one", adam)

        def eight_runs() -> None:
            futures = [submit(engine, "forward_backward", run_id=run, batch=[row]) for run, row in zip(many, batch)]
            futures += [submit(engine, "optim_step", run_id=run, adam=adam) for run in many]
            pump(engine, futures)

        sides = {"one_run": one_run, "eight_runs": eight_runs}
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for step in range(args.steps + 1):
            order = list(sides) if step % 2 == 0 else list(reversed(sides))  # sides alternate
            for name in order:
                sync(engine.device)
                start = time.perf_counter()
                sides[name]()
                sync(engine.device)
                if step:  # step 0 warms up
                    seconds[name].append(time.perf_counter() - start)
            log(f"step {step}{' (warm-up)' if not step else ''}: " + "  ".join(f"{n} {s[-1]:.3f} s" for n, s in seconds.items() if s))
        cuda = engine.device.type == "cuda"
        measured = matmul_tflops(engine.device, engine.dtype, 8192 if cuda else 512)
        dtype = str(engine.dtype).removeprefix("torch.")
        engine.shutdown()
    tokens = rows * length
    peak = H200_BF16_DENSE_TFLOPS if cuda and args.peak_tflops is None else args.peak_tflops
    sides_out = {}
    for name, values in seconds.items():
        tokens_per_s = tokens / median(values)
        achieved = tokens_per_s * 4 * linear_params / 1e12
        sides_out[name] = {"median_seconds": round(median(values), 4), "tokens_per_s": round(tokens_per_s, 1),
                           "tflops": round(achieved, 2), "mfu": round(achieved / peak, 4) if peak else None,
                           "of_measured_matmul": round(achieved / measured, 4)}
    emit({"bench": "gpu_mfu", "model": args.model, "device": str(args.device), "dtype": dtype, "linear_params": linear_params,
          "flops_per_token": 4 * linear_params, "tokens_per_step": tokens, "lora": lora, "steps": args.steps,
          "peak_tflops": peak, "matmul_tflops_measured": round(measured, 1), "sides": sides_out,
          "note": "4N FLOPs per token (frozen base: no weight gradients); LoRA and attention-score FLOPs not counted"})


# ---- the tests' summary ------------------------------------------------------------------------


def junit(args: argparse.Namespace) -> None:
    import xml.etree.ElementTree as ET

    path = Path(args.report)
    if not path.exists():
        emit_json({"part": args.part, "pytest_rc": args.pytest_rc, "error": f"no report at {path}: pytest did not finish"})
        return
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    details: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            outcomes["failed"].append(name)
            details[name] = (problem.get("message") or problem.text or "")[:400]
        elif skipped is not None:
            outcomes["skipped"].append(name)
            details[name] = (skipped.get("message") or "")[:200]
        else:
            outcomes["passed"].append(name)
    emit_json({"part": args.part, "pytest_rc": args.pytest_rc, **{k: len(v) for k, v in outcomes.items()},
               "failures": {n: details[n] for n in outcomes["failed"]},
               "skip_reasons": sorted({details[n] for n in outcomes["skipped"]}), "passed_tests": outcomes["passed"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parts = parser.add_subparsers(dest="part", required=True)
    parts.add_parser("env")
    p = parts.add_parser("wheels")
    p.add_argument("--assets", required=True)
    p = parts.add_parser("model")
    p.add_argument("--assets", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b",
                   help="1b: Llama-3.2-1B's dimensions; 8b: Llama-3.1-8B's; moe: Qwen3-30B-A3B's, MOE_LAYERS layers")
    p.add_argument("--layers", type=int, default=0, help="fewer: a smaller model of the same width (0: the shape's)")
    p.add_argument("--device", default="auto")
    p = parts.add_parser("mfu")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--tiny", action="store_true", help="8 rows of 64 tokens")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per row (8 rows: one tick's 8192)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=None, help=f"the device's peak (CUDA default {H200_BF16_DENSE_TFLOPS})")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parent.parent / "data"))
    p.add_argument("--threads", type=int, default=0)
    p = parts.add_parser("junit")
    p.add_argument("report")
    p.add_argument("--pytest-rc", type=int, default=None)
    p.add_argument("--part", default="cuda_tests", help="the name its JSON line carries")
    args = parser.parse_args()
    {"env": env, "wheels": wheels, "model": model, "mfu": mfu, "junit": junit}[args.part](args)


if __name__ == "__main__":
    main()
