"""bench/gpu.sh's measuring parts, each one process whose sections are time-boxed (gpu_box.Box): one JSON line each.

    python3 bench/gpu_sections.py PART --model DIR --seconds S [--deadline EPOCH] [--device cuda] [--tiny] [--threads N]

PART is `train_1b` (gpu_train: one run vs PEFT, 8 mixed-rank runs at 1024 and 128 tokens), `decode_1b` (gpu_decode:
decode at 64, 16 and 1 sequences), `kernels` (gpu_kernels: LoRA and MoE expert kernels vs the torch reference),
`eight_b` (the 8B shape: one run of 4 × 1024, 8 mixed-rank runs of 512, decode), `rl_1b` (gpu_decode: the RL step)
or `moe` (Qwen3-30B-A3B's shape, a few layers: 4 co-batched expert-LoRA runs against one run's ceiling).
The part ends by the earlier of `--seconds` from its start and `--deadline` (the whole script's end, an epoch time);
its sections go most important first, each with a nominal limit (seconds on an H100) scaled to what is left. With
--tiny every size shrinks and one timed round follows the warm-up, so the CPU runs each code path in seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchlib import apply_threads
from gpu_box import Box, Section

ROUNDS = 2  # timed rounds after the warm-up on a GPU, sides alternating (--tiny: 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("part", choices=("train_1b", "decode_1b", "kernels", "eight_b", "rl_1b", "moe"))
    parser.add_argument("--model", default="")
    parser.add_argument("--seconds", type=float, required=True, help="the part's time: sections that do not fit skip")
    parser.add_argument("--deadline", type=float, default=None, help="the whole script's end (epoch seconds)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "signal-gpu-sections"),
                        help="the Engine's data directory is a fresh folder PART-data under it")
    return parser.parse_args()


def kernel_sections(tiny: bool, device_name: str) -> list[Section]:
    import gpu_kernels as k
    import torch

    device = torch.device("cuda" if device_name in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    moe = (64, 64, 32, 8, 2) if tiny else (1024, 2048, 768, 128, 8)
    return [
        Section("lora_kernels", 20, 5, lambda _: k.lora_kernels(device, dtype, 256 if tiny else 8192, 64 if tiny else 2048,
                                                                 2 if tiny else 10)),
        Section("moe_kernels", 15, 5, lambda _: k.moe_kernels(device, dtype, *moe, reps=2 if tiny else 5)),
    ]


def engine_sections(part: str, engine: Any, m: str, tiny: bool) -> list[Section]:
    import gpu_decode as d
    import gpu_train as t

    rounds = 1 if tiny else ROUNDS
    note = Section("engine", 0, 0, lambda _: {**t.device_note(engine), "model": m})

    def one_run(rows: int, length: int, baselines: bool, targets: dict[str, float]) -> Any:
        return lambda limit: t.one_run(engine, m, m, rows, length, rounds, baselines, targets, limit)

    def eight_runs(length: int, targets: dict[str, float]) -> Any:
        return lambda limit: t.eight_runs(engine, m, length, rounds, targets, limit)

    def decode(rows: tuple[int, ...], tokens: int) -> Any:
        return lambda limit: d.decode(engine, m, m, rows, tokens, limit)

    if part == "train_1b":
        return [note,
                Section("one_run_8x1024", 45, 15, one_run(4 if tiny else 8, 32 if tiny else 1024, True, {"vs_peft": 1.3})),
                Section("eight_runs_1024", 35, 10, eight_runs(32 if tiny else 1024, {"ceiling": 0.9, "sequential": 3.0})),
                Section("eight_runs_128", 20, 6, eight_runs(8 if tiny else 128, {"ceiling": 0.8, "sequential": 4.0}))]
    if part == "decode_1b":
        return [note, Section("decode", 60, 15, decode((16, 4, 1) if tiny else (64, 16, 1), 8 if tiny else 128))]
    if part == "moe":
        moe = Section("four_runs_512", 30, 10, lambda limit: t.moe_runs(engine, m, 8 if tiny else 512, rounds,
                                                                          {"ceiling": 0.8}, limit))
        return [note, moe]
    if part == "rl_1b":
        shape = (4, 2, 8) if tiny else (16, 8, 128)
        return [note, Section("rl_step", 40, 10, lambda limit: d.rl_step(engine, m, m, *shape, rounds, limit))]
    return [note,
            Section("one_run_4x1024", 30, 10, one_run(4, 32 if tiny else 1024, False, {"mfu": 0.40})),
            Section("eight_runs_512", 30, 10, eight_runs(16 if tiny else 512, {"ceiling": 0.9, "sequential": 3.0,
                                                                                 "tokens_per_s": 12_000})),
            Section("decode", 40, 10, decode((16, 1) if tiny else (64, 16, 1), 8 if tiny else 64))]


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    box = Box(args.part, args.seconds, args.deadline)
    if args.part == "kernels":
        box.run_all(kernel_sections(args.tiny, args.device))
    else:
        from gpu_runtime.engine.engine import Engine

        data_dir = Path(args.data_dir) / f"{args.part}-data"
        shutil.rmtree(data_dir, ignore_errors=True)
        data_dir.mkdir(parents=True)
        engine = Engine(data_dir, device=args.device)
        box.run_all(engine_sections(args.part, engine, args.model, args.tiny))
    # Every line is out: the Engine's shutdown would snapshot and close each run's journal, which this throwaway data
    # directory does not need and which a loaded disk makes slow (gpu.sh removes the folder).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
