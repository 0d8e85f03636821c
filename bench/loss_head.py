"""Loss head memory: today's full-vocabulary logits + fp32 log_softmax against the chunked head (gpu_runtime/compute/loss_head.py).

    .venv/bin/python bench/loss_head.py [--rounds 3] [--quick] [--batch 8] [--seq 1024] [--vocab 128256]
                                        [--hidden 64] [--layers 2] [--device cpu|cuda] [--threads N]

One forward+backward of `--batch` × `--seq` tokens (8 × 1024) through a micro Llama (hidden 64, 2 layers, random
weights, a 128,256-token vocabulary as Llama 3's, embeddings and lm_head frozen as under LoRA, the layers trainable
so backward runs through the backbone) with a loss on every position, two sides:

- **today**: `model(...).logits`, then losses.py's `target_logprobs` (fp32 cross_entropy over the flattened
  logits, whose log_softmax autograd keeps), `-(logprobs · weights).sum()`, backward; the logits stay referenced
  through backward as training.py's pass holds them.
- **fused**: loss_head.py's `causal_lm_logprobs` (the decoder's hidden state, then the chunked head), the same
  loss, backward.

How memory is measured. Each side of each round runs in a fresh Python process (sides alternate: today, fused, then
fused, today, …), which builds the model and inputs, runs one small warm-up pass (1 × 64 tokens: lazy kernel and
thread-pool set-up), then measures one full pass. On the CPU the figure is the process's peak resident set size
during the pass minus its resident size just before: the peak is reset first (`5` written to /proc/self/clear_refs
sets VmHWM to the current VmRSS), and VmHWM read after. torch's CPU allocator has no cache: tensors this large
(≥ 32 MB) are glibc mmaps, faulted in when written and unmapped when freed, so RSS follows live tensors; small
ones reuse heap the warm-up already touched (both sides alike, a few MB). On CUDA the figure is
`max_memory_allocated` minus `memory_allocated` before the pass, after `reset_peak_memory_stats`. The figure is the
pass's transient: activations, logits, softmax, gradients; the model and inputs are outside it on both sides.
Wall time is the same single pass (CUDA synchronised), per side, medians over rounds.

Last line: JSON with both sides' peaks and times and the target: fused / today peak ≤ 0.25.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchlib import apply_threads, emit, log, median, proc_status, target

SIDES = ("today", "fused")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs both sides, each in its own process")
    parser.add_argument("--quick", action="store_true", help="1 round")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=None, help="the fused head's vocabulary block (default: its own)")
    parser.add_argument("--row-chunk", type=int, default=None, help="the fused head's token block (default: its own)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=0, help="torch threads, here and in each side's process (0: torch's default)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side, print its JSON
    return parser.parse_args()


def build(args: argparse.Namespace, device: Any) -> tuple[Any, Any, Any, Any, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(2048, args.seq), tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(device)
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    input_ids, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    mask = torch.ones_like(input_ids)
    weights = torch.ones(input_ids.shape, device=device)
    return model, input_ids, targets, mask, weights


def one_pass(side: str, model: Any, input_ids: Any, targets: Any, mask: Any, weights: Any, head: dict[str, int]) -> None:
    if side == "today":
        from gpu_runtime.losses import target_logprobs

        logits = model(input_ids=input_ids, attention_mask=mask).logits  # held through backward, as training.py does
        logprobs = target_logprobs(logits, targets)
    else:
        from gpu_runtime.compute.loss_head import causal_lm_logprobs

        logprobs = causal_lm_logprobs(model, input_ids, targets, attention_mask=mask, **head).logprobs
    (-(logprobs * weights).sum()).backward()


def run_side(args: argparse.Namespace) -> None:
    """In a fresh process: build, warm up, measure one pass; print {"peak_bytes", "seconds"}."""
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model, input_ids, targets, mask, weights = build(args, device)
    head = {k: v for k, v in (("chunk_size", args.chunk_size), ("row_chunk", args.row_chunk)) if v}
    one_pass(args.side, model, input_ids[:1, :64], targets[:1, :64], mask[:1, :64], weights[:1, :64], head)
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM := VmRSS
        before = proc_status()["VmRSS"]
    start = time.perf_counter()
    one_pass(args.side, model, input_ids, targets, mask, weights, head)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else proc_status()["VmHWM"]
    print(json.dumps({"side": args.side, "peak_bytes": peak - before, "seconds": seconds}), flush=True)


def spawn(args: argparse.Namespace, side: str, env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--side", side, "--batch", str(args.batch), "--seq", str(args.seq),
            "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--device", args.device, "--threads", str(args.threads)]
    for flag, value in (("--chunk-size", args.chunk_size), ("--row-chunk", args.row_chunk)):
        if value:
            argv += [flag, str(value)]
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {side} side failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    args = parse_args()
    env = apply_threads(args.threads)
    if args.side:
        run_side(args)
        return
    rounds = 1 if args.quick else args.rounds
    tokens = args.batch * args.seq
    logits_bytes = tokens * args.vocab * 4  # fp32
    if args.device == "cpu":
        # today's side holds about four fp32 [tokens, vocab] tensors at once in backward: refuse rather than swap or be killed
        available = _mem_available()
        if available and 4.2 * logits_bytes > available:
            raise SystemExit(f"today's side needs about {4.2 * logits_bytes / 2**30:.1f} GiB and {available / 2**30:.1f} GiB "
                             "is available: lower --seq or --batch")
    log(f"{args.batch} x {args.seq} tokens, vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers on {args.device}; "
        f"fp32 logits alone are {logits_bytes / 2**30:.2f} GiB")
    peaks: dict[str, list[int]] = {side: [] for side in SIDES}
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    for round_number in range(rounds):
        order = SIDES if round_number % 2 == 0 else SIDES[::-1]
        for side in order:
            result = spawn(args, side, env)
            peaks[side].append(int(result["peak_bytes"]))
            seconds[side].append(float(result["seconds"]))
            log(f"round {round_number}: {side:<6} peak {result['peak_bytes'] / 2**20:9.1f} MiB  {result['seconds']:7.2f} s")
    med_peak = {side: median([float(p) for p in values]) for side, values in peaks.items()}
    med_seconds = {side: median(values) for side, values in seconds.items()}
    ratio = med_peak["fused"] / med_peak["today"]
    time_ratio = med_seconds["fused"] / med_seconds["today"]
    print(f"\n{'side':<8}{'peak MiB':>12}{'seconds':>10}")
    for side in SIDES:
        print(f"{side:<8}{med_peak[side] / 2**20:>12.1f}{med_seconds[side]:>10.2f}")
    print(f"fused / today: peak {ratio:.4f}, time {time_ratio:.3f}")
    from gpu_runtime.compute.loss_head import DEFAULT_CHUNK_SIZE, DEFAULT_ROW_CHUNK

    targets = {"fused_vs_today_peak": target(ratio, "<=", 0.25)}
    emit({
        "bench": "loss_head", "device": args.device, "threads": args.threads, "rounds": rounds,
        "tokens": tokens, "batch": args.batch, "seq": args.seq, "vocab": args.vocab, "hidden": args.hidden,
        "layers": args.layers, "chunk_size": args.chunk_size or DEFAULT_CHUNK_SIZE,
        "row_chunk": args.row_chunk or DEFAULT_ROW_CHUNK, "fp32_logits_mib": round(logits_bytes / 2**20, 1),
        "memory": "peak RSS over the pass minus RSS before it, fresh process per side" if args.device == "cpu"
        else "max_memory_allocated over the pass minus memory_allocated before it",
        "peak_mib": {side: [round(p / 2**20, 1) for p in values] for side, values in peaks.items()},
        "median_peak_mib": {side: round(p / 2**20, 1) for side, p in med_peak.items()},
        "seconds": {side: [round(s, 3) for s in values] for side, values in seconds.items()},
        "median_seconds": {side: round(s, 3) for side, s in med_seconds.items()},
        "fused_vs_today_peak": round(ratio, 4), "fused_vs_today_seconds": round(time_ratio, 3),
        "targets": targets, "all_pass": all(t["pass"] for t in targets.values()),
    })


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    main()
