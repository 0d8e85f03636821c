"""Host cost of the decode engine's step against a minimal static-cache greedy loop, on a micro model.

    .venv/bin/python bench/decode_host.py [--rounds 5] [--quick] [--steps 32] [--threads 1]

A random Llama of hidden 64, 4 layers and a 512-token vocabulary, so compute is negligible and a decode step's
wall time is its host work (the regime a GPU's small batches are in). Two sides at 1, 16 and 64 rows, each
prefilling rows prompts of 8 tokens and then timing `--steps` greedy decode steps:

- **engine**: gpu_runtime/compute/decode's DecodeEngine (slot cache, batched sampler, one host copy per step,
  stop and length checks on the host), `step()` per token.
- **loop**: the gpt-fast shape written here: transformers' StaticCache, the model's forward on the batch's last
  tokens at their positions, argmax, nothing else (no logprobs, no stop checks, no host copy).

Sides alternate within each round (their order flips each round); the first round warms up and is not counted;
figures are medians of rounds. Last line: JSON with the engine's speed as a fraction of the loop's at each batch
size and the target (engine >= 0.8x the loop).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchlib import apply_threads, emit, log, median, target

ROWS = (1, 16, 64)
PROMPT = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (plus one warm-up round)")
    parser.add_argument("--quick", action="store_true", help="2 timed rounds")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per side and batch size")
    return parser.parse_args()


def micro_model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def engine_side(model: Any, rows: int, steps: int) -> float:
    """Seconds per decode step of the engine."""
    from gpu_runtime.compute.decode.engine import DecodeEngine, DecodeSettings
    from gpu_runtime.compute.decode.slot_cache import SlotCache

    engine = DecodeEngine(model, SlotCache(model.config, PROMPT + steps + 8, slots=rows), prefill_tokens=PROMPT * rows)
    for i in range(rows):
        engine.add([(i * 7 + j) % 500 + 1 for j in range(PROMPT)], DecodeSettings(max_tokens=steps + 2))
    engine.step()  # every prefill and first token
    began = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - began) / steps


def loop_side(model: Any, rows: int, steps: int) -> float:
    """Seconds per decode step of a minimal static-cache greedy loop (gpt-fast's shape)."""
    import torch
    from transformers.cache_utils import StaticCache

    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=PROMPT + steps + 8)
        ids = torch.tensor([[(i * 7 + j) % 500 + 1 for j in range(PROMPT)] for i in range(rows)])
        positions = torch.arange(PROMPT)[None].expand(rows, -1)
        logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position = torch.full((rows, 1), PROMPT)
        began = time.perf_counter()
        for _ in range(steps):
            logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            position = position + 1
        return (time.perf_counter() - began) / steps


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    import torch

    torch.set_grad_enabled(False)
    model = micro_model()
    rounds = 2 if args.quick else args.rounds
    sides = {"engine": engine_side, "loop": loop_side}
    seconds: dict[int, dict[str, list[float]]] = {rows: {name: [] for name in sides} for rows in ROWS}
    for round_ in range(rounds + 1):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for rows in ROWS:
            for name in order:
                took = sides[name](model, rows, args.steps)
                if round_:
                    seconds[rows][name].append(took)
        log(f"round {round_}{' (warm-up)' if round_ == 0 else ''} done")
    med = {rows: {name: median(values) for name, values in by.items()} for rows, by in seconds.items()}
    ratio = {rows: med[rows]["loop"] / med[rows]["engine"] for rows in ROWS}
    print(f"{'rows':>5}{'engine ms/step':>16}{'loop ms/step':>14}{'engine speed / loop':>21}")
    for rows in ROWS:
        print(f"{rows:>5}{med[rows]['engine'] * 1e3:>16.3f}{med[rows]['loop'] * 1e3:>14.3f}{ratio[rows]:>21.3f}")
    targets = {f"engine_vs_loop_{rows}_rows": target(ratio[rows], ">=", 0.8) for rows in ROWS}
    emit({
        "bench": "decode_host", "device": "cpu", "threads": args.threads, "rounds": rounds, "steps": args.steps,
        "model": "random Llama, hidden 64, 4 layers, vocab 512, fp32",
        "ms_per_step": {str(rows): {name: round(s * 1e3, 4) for name, s in med[rows].items()} for rows in ROWS},
        "engine_speed_vs_loop": {str(rows): round(ratio[rows], 4) for rows in ROWS},
        "targets": targets, "all_pass": all(t["pass"] for t in targets.values()),
    })


if __name__ == "__main__":
    main()
