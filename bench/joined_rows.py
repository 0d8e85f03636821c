"""Joined rows against padding: one run's forward_backward pass of mixed-length datums (issue 30, item 6).

    .venv/bin/python bench/joined_rows.py [--rounds 6] [--quick] [--threads 1] [--device cpu|cuda]

A random Llama (hidden 256, 4 layers, a 4096-id vocabulary of SmolLM2's tokenizer) and one run of LoRA r=16 (no
dropout, so its datums may join). The pass takes 8 datums of lengths spread evenly over [32, 512]: padded, that is
8 rows of 512; joined (first-fit-decreasing, rows no wider than the longest), 5 rows. Two sides, alternating within
each round (SIGNAL_JOIN_ROWS=0 for the padded one): the same `forward_backward_pass`, the same datums. Figures are
medians after a warm-up round; tokens are the datums' own (padding is not counted). Memory: the bytes autograd saves
for backward in one more (untimed) pass of each side, and the peak allocated where the device measures it (CUDA).
Last line: JSON with the ratio and its target (joined ≥ 1.3× padded tokens/s).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path
from typing import Any

from benchlib import alternate, apply_threads, emit, log, target

HIDDEN, LAYERS, VOCAB = 256, 4, 4096
DATUMS, SHORTEST, LONGEST = 8, 32, 512
RANK = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="3 timed rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def build_model(path: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.tiny_model import smollm2_tokenizer

    tokenizer = smollm2_tokenizer(path.parent / "smollm2-tokenizer")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=int(HIDDEN * 8 / 3),
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=LONGEST, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def saved_bytes(fn: Any) -> int:
    """Bytes autograd keeps for backward while `fn` runs its pass (each storage once): the activations' memory, which
    a CPU can measure too."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    rounds = 3 if args.quick else args.rounds
    import torch

    from gpu_runtime.compute import joined_rows
    from gpu_runtime.compute.batches import Datum
    from gpu_runtime.compute.plan import PartOutcome, PassPart
    from gpu_runtime.compute.training import forward_backward_pass
    from gpu_runtime.engine.engine import Engine

    device = torch.device(args.device)
    lengths = [round(SHORTEST + i * (LONGEST - SHORTEST) / (DATUMS - 1)) for i in range(DATUMS)]
    rng = random.Random(0)
    datums = [Datum([rng.randrange(3, VOCAB) for _ in range(n)], [rng.randrange(3, VOCAB) for _ in range(n)], [1.0] * n)
              for n in lengths]
    tokens = sum(lengths)
    rows = joined_rows.first_fit_decreasing(lengths)
    cells = {"padded": DATUMS * LONGEST, "joined": len(rows) * max(sum(lengths[d] for d in row) for row in rows)}
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="signal-joined-", dir=parent, ignore_cleanup_errors=True) as tmp:
        model = build_model(Path(tmp) / "bench-llama")
        engine = Engine(Path(tmp) / "data", device=args.device)
        engine.create_run("run", "user", model, {"r": RANK, "alpha": 2 * RANK}, seed=0)
        entry, runs = engine.residency.bases[engine.runs["run"].base_key], engine.residency.runs
        peaks: dict[str, int] = {}

        def side(name: str) -> Any:
            os.environ[joined_rows.JOIN_ROWS_ENV] = "1" if name == "joined" else "0"
            part = PassPart("run", datums, 0, call_rows=DATUMS, call_width=LONGEST, dropout_seed=1,
                            loss_fn="cross_entropy")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            (outcome,) = forward_backward_pass(entry, runs, [part], device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peaks[name] = torch.cuda.max_memory_allocated(device)
            assert isinstance(outcome, PartOutcome) and outcome.join_rows is (name == "joined"), outcome
            return outcome.loss_sum

        measured = alternate({"padded": lambda: side("padded"), "joined": lambda: side("joined")}, rounds)
        saved = {name: saved_bytes(lambda name=name: side(name)) for name in ("padded", "joined")}  # untimed
        engine.shutdown()

    med = measured.medians()
    per_s = {name: tokens / s for name, s in med.items()}
    ratio = per_s["joined"] / per_s["padded"]
    for name in med:
        log(f"{name:<7} {med[name] * 1000:9.1f} ms  {per_s[name]:9.0f} tokens/s  {cells[name]} cells")
    log(f"joined / padded tokens/s: {ratio:.3f}")
    result: dict[str, Any] = {
        "bench": "joined_rows", "model": f"llama hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}", "device": args.device,
        "threads": args.threads, "lora_r": RANK, "lengths": lengths, "tokens": tokens, "rows": {"padded": DATUMS,
                                                                                                "joined": len(rows)},
        "cells": cells, "rounds": rounds, "median_ms": {k: round(v * 1000, 2) for k, v in med.items()},
        "tokens_per_s": {k: round(v, 1) for k, v in per_s.items()}, "joined_vs_padded": round(ratio, 4),
        "peak_memory_bytes": peaks or None, "saved_for_backward_bytes": saved}
    targets = {"joined_vs_padded_tokens_per_s": target(ratio, ">=", 1.3)}
    emit({**result, "targets": targets, "all_pass": all(t["pass"] for t in targets.values())})


if __name__ == "__main__":
    main()
