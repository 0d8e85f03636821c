"""bench/gpu.sh's measuring parts, each one process whose sections are time-boxed (gpu_box.Box): one JSON line each.

    python3 bench/gpu_sections.py PART --model DIR --seconds S [--device cuda] [--tiny] [--threads N]

PART is `train_1b` (gpu_train: one run vs PEFT, 8 mixed-rank runs at 1024 and 128 tokens), `decode_1b` (gpu_decode:
decode at 64, 16 and 1 sequences; the RL step), `kernels` (gpu_kernels: LoRA and MoE expert kernels vs the torch
reference) or `eight_b` (the 8B shape: one run of 4 × 1024, 8 mixed-rank runs of 512, decode). The most important
section of each part goes first; with --tiny every size shrinks so the CPU runs each code path in seconds.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchlib import apply_threads, scratch_data_dir
from gpu_box import Box


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("part", choices=("train_1b", "decode_1b", "kernels", "eight_b"))
    parser.add_argument("--model", default="")
    parser.add_argument("--seconds", type=float, required=True, help="the part's time: sections that do not fit skip")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--data-dir", default=str(Path(__file__).resolve().parent.parent / "data"))
    return parser.parse_args()


def kernels(box: Box, tiny: bool, device_name: str) -> None:
    import gpu_kernels as k
    import torch

    device = torch.device("cuda" if device_name in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    box.run("lora_kernels", 10, lambda: k.lora_kernels(device, dtype, 256 if tiny else 8192, 64 if tiny else 2048,
                                                        2 if tiny else 10))
    moe = (64, 64, 32, 8, 2) if tiny else (1024, 2048, 768, 128, 8)
    box.run("moe_kernels", 10, lambda: k.moe_kernels(device, dtype, *moe, reps=2 if tiny else 5))
    box.run("moe_engine", 0, lambda: {"skipped": "no MoE LoRA layer in the engine yet (gpu_runtime/compute/lora wraps "
                                                 "nn.Linear only): 4 co-batched expert-LoRA runs through the Engine "
                                                 "are not measurable; the grouped kernel is, in moe_kernels"})


def engine_part(box: Box, args: argparse.Namespace) -> None:
    import gpu_decode as d
    import gpu_train as t

    from gpu_runtime.engine.engine import Engine

    tiny, m = args.tiny, args.model
    with scratch_data_dir(args.data_dir) as data_dir:
        engine = Engine(data_dir, device=args.device)
        box.run("engine", 0, lambda: {**t.device_note(engine), "model": m})
        sections: list[tuple[str, float, Any]]
        if args.part == "train_1b":
            sections = [
                ("one_run_8x1024", 45, lambda: t.one_run(engine, m, m, 8, 64 if tiny else 1024, 2 if tiny else 3, True,
                                                         {"vs_peft": 1.3})),
                ("eight_runs_1024", 30, lambda: t.eight_runs(engine, m, 64 if tiny else 1024, 2 if tiny else 3,
                                                             {"ceiling": 0.9, "sequential": 3.0})),
                ("eight_runs_128", 20, lambda: t.eight_runs(engine, m, 16 if tiny else 128, 2 if tiny else 3,
                                                            {"ceiling": 0.8, "sequential": 4.0})),
            ]
        elif args.part == "decode_1b":
            sections = [
                ("decode", 50, lambda: d.decode(engine, m, m, (16, 8, 1) if tiny else (64, 16, 1), 8 if tiny else 128)),
                ("rl_step", 30, lambda: d.rl_step(engine, m, m, *((4, 2, 8) if tiny else (16, 8, 128)), steps=1)),
            ]
        else:
            sections = [
                ("one_run_4x1024", 30, lambda: t.one_run(engine, m, m, 4, 64 if tiny else 1024, 2, False, {"mfu": 0.40})),
                ("eight_runs_512", 25, lambda: t.eight_runs(engine, m, 32 if tiny else 512, 2,
                                                            {"ceiling": 0.9, "sequential": 3.0, "tokens_per_s": 12_000})),
                ("decode", 40, lambda: d.decode(engine, m, m, (16, 1) if tiny else (64, 16, 1), 8 if tiny else 64)),
            ]
        for name, seconds, section in sections:
            box.run(name, seconds if not tiny else 1, section)
        engine.shutdown()


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    box = Box(args.part, args.seconds)
    if args.part == "kernels":
        kernels(box, args.tiny, args.device)
    else:
        engine_part(box, args)


if __name__ == "__main__":
    main()
