"""Fairness through the API: user B's short forward_backward alone, and while user A samples 16 prompts × 128 tokens.

    .venv/bin/python bench/fairness.py [--rounds 2] [--quick] [--calls 20] [--alone-calls 8] [--threads 1]
                                       [--prompts 16] [--max-tokens 128] [--prompt-tokens N]

A real `signal serve` runs on a fresh data directory (its `models/` shared with ./data, so the default
model is de-quantized once). B is the admin whose key the server prints on first start; A is a second
user whose key `signal keys create --user a@x` makes. Both talk to it through the rewardsignal SDK, as
users do. Each round has three phases, in an order that flips every round so drift in the machine's
speed hits them alike:

- **B alone**: B's forward_backward of one short example (~20 tokens), `--alone-calls` times in turn;
- **A alone**: A's sample of 16 prompts × `--max-tokens` tokens (a fixed seed, so every sample is the
  same work);
- **together**: A samples the same prompts again and again; once its decode group is running (the
  runtime's state says so), B sends its calls back to back until at least `--calls` of them were
  answered while A was sampling, and A stops after the sample in flight.

B's ratio is each call's latency while A samples over the median alone; p50, p90 and the worst are
reported, since a median hides the tail. A's slowdown is its median sample time with B's calls over
alone. Targets (issue 14 §7): B's worst ≤ 3× alone, A ≤ 2× slower. `--prompt-tokens N`: A's prompts are token ids, N
each, so its prefill is long (issue 14 §7: a decode chunk, its prefill included, ends within its time bound).

`--mode v1|tinker` (issue 34 #10; bench/fairness_wires.py): A holds `--streams` streamed `/v1` completions or
`--futures` Tinker `asample` futures in flight, B sends a 4-token completion on the same wire; B's median beside A
over its median alone (target ≤ 3×). `--mode all` runs graphql, v1 and tinker, each on its own server, one JSON line
each. `--tiny`: the tests' tiny random Llama instead of `--model` (as bench/openai_stream.py).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from benchlib import REPO_ROOT, SHORT_TEXTS, common_args, emit, log, median, scratch_data_dir, target, use_tiny_model
from fairness_wires import TinkerWire, V1Wire, measure

PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle stays upright.",
    "List some facts about the Moon.", "Describe your favourite meal.", "What makes a good teacher?",
    "Tell me about the history of tea.", "How do bees make honey?", "Write a poem about autumn rain.",
    "Why is the sky blue?", "Give advice to a new programmer.", "Describe a busy market in the morning.",
    "What is the water cycle?", "Write a letter to a friend far away.", "How does a compass work?",
    "Summarise the plot of a famous fairy tale.", "What should I pack for a hiking trip?",
]
WORST_TARGET, SLOWDOWN_TARGET = 3.0, 2.0
WIRE_RATIO_TARGET = 3.0  # issue 34 #10: B's median beside A's flood within 3× of alone
MODES = ("graphql", "v1", "tinker")
SIGNAL_CLI = "import sys; from app.cli import main; sys.exit(main())"  # `signal`, from this checkout


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds (after a short warm-up)")
    parser.add_argument("--quick", action="store_true", help="1 round, 64-token samples")
    parser.add_argument("--calls", type=int, default=20, help="B's calls per round answered while A samples (at least)")
    parser.add_argument("--alone-calls", type=int, default=8, help="B's calls alone per round")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=0, help="A's prompts as N token ids each (a long prefill)")
    parser.add_argument("--mode", choices=(*MODES, "all"), default="graphql",
                        help="graphql: B's forward_backward beside A's sample; v1/tinker: A's flood on that wire")
    parser.add_argument("--streams", type=int, default=32, help="v1: A's streamed completions held in flight")
    parser.add_argument("--futures", type=int, default=200, help="tinker: A's asample futures held in flight")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model (built in a scratch directory)")
    return parser.parse_args()


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..1): a value that was measured, not interpolated."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))] if ordered else float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def signal_serve(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """`signal serve` on a fresh data directory; yields its url, the admin key it printed, its environment and pid."""
    with scratch_data_dir(args.data_dir) as data_dir:
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SIGNAL_DATA_DIR": str(data_dir),
               "SIGNAL_DEVICE": args.device, "SIGNAL_DEFAULT_MODEL": args.model, "SIGNAL_LOG_LEVEL": "warning"}
        if args.threads > 0:  # the runtime process inherits these: torch reads them when it starts
            env |= {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads), "SIGNAL_THREADS": str(args.threads)}
        process = subprocess.Popen([sys.executable, "-c", SIGNAL_CLI, "serve", "--port", str(port)], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert process.stdout is not None
            output = ""
            while "Signal at" not in output:
                line = process.stdout.readline()
                if not line:
                    raise RuntimeError(f"signal serve exited before serving:\n{output}")
                output += line
            key = re.search(r"SIGNAL_API_KEY=(sk-\S+)", output)
            if key is None:
                raise RuntimeError(f"signal serve printed no admin key:\n{output}")
            # Drain its output from here on, so a full pipe never blocks the server.
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()  # type: ignore[union-attr]
            url = f"http://127.0.0.1:{port}"
            yield {"url": url, "admin_key": key.group(1), "env": env, "pid": process.pid}
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=120)


def make_key(env: dict[str, str], email: str) -> str:
    result = subprocess.run([sys.executable, "-c", SIGNAL_CLI, "keys", "create", "--user", email, "--name", "bench"],
                            env=env, capture_output=True, text=True, check=True)
    return result.stdout.strip().splitlines()[-1]


def wait_ready(url: str) -> None:
    """Until /healthz says ok: the server binds after printing its address, and its runtime starts after that."""
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=5).json()["status"] == "ok":
                return
        except httpx.TransportError:
            pass  # not bound yet
        if time.monotonic() > deadline:
            raise TimeoutError("signal serve's runtime did not start")
        time.sleep(0.2)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="signal-bench-tiny-") as scratch:
        if args.tiny:
            use_tiny_model(args, Path(scratch))
        for mode in MODES if args.mode == "all" else (args.mode,):
            bench_wire(args, mode) if mode != "graphql" else bench_graphql(args)


def bench_wire(args: argparse.Namespace, mode: str) -> None:
    """A's flood on `/v1` or Tinker's wire beside B's 4-token completion on the same wire: one JSON line."""
    max_tokens = min(args.max_tokens, 64) if args.quick else args.max_tokens
    alone_calls, calls = (min(args.alone_calls, 5), min(args.calls, 8)) if args.quick else (args.alone_calls, args.calls)
    with signal_serve(args) as server:
        url = server["url"]
        wait_ready(url)
        a_key = make_key(server["env"], "a@x")
        wire = (V1Wire(url, a_key, server["admin_key"], args.model, args.streams, max_tokens) if mode == "v1" else
                TinkerWire(url, a_key, server["admin_key"], args.model, args.futures, max_tokens))
        log(f"signal serve at {url}: {mode}, A (a@x) holds {wire.shape}; B (the admin) sends 4-token completions")
        try:
            figures = measure(wire, alone_calls, calls)
        finally:
            wire.close()
    ratio = figures.pop("ratio")
    print(f"\n{args.model}, {mode}: B alone {figures['b_median_alone_s']:.3f} s, beside A's {wire.shape} "
          f"{figures['b_median_beside_a_s']:.3f} s: {ratio:.2f}× (target ≤ {WIRE_RATIO_TARGET}×)")
    targets = {"b_median_ratio": target(ratio, "<=", WIRE_RATIO_TARGET, "issue 34 #10: 15-19x before")}
    emit({"bench": "fairness", "mode": mode, "model": args.model, "device": args.device, "threads": args.threads,
          "a_load": wire.shape, "b_call": "4-token completion, same wire", **figures, "b_ratio": round(ratio, 3),
          "targets": targets, "all_pass": all(t["pass"] for t in targets.values())})


def bench_graphql(args: argparse.Namespace) -> None:
    rounds, max_tokens = (1, min(args.max_tokens, 64)) if args.quick else (args.rounds, args.max_tokens)
    prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]
    from rewardsignal import SignalClient

    b_batch = [{"text": SHORT_TEXTS[0]}]
    with signal_serve(args) as server:
        url = server["url"]
        wait_ready(url)
        b_client = SignalClient(api_key=server["admin_key"], base_url=url)
        a_client = SignalClient(api_key=make_key(server["env"], "a@x"), base_url=url)
        log(f"signal serve at {url}: creating runs for user A (a@x) and user B (the admin)")
        a_run, b_run = a_client.create_run(seed=0), b_client.create_run(seed=1)

        long_prompts = [[(17 * i + 31 * j) % 5000 + 100 for j in range(args.prompt_tokens)] for i in range(len(prompts))]

        def sample() -> tuple[float, int]:
            start = time.perf_counter()
            if args.prompt_tokens:
                result = a_run.sample(prompt_tokens=long_prompts, max_tokens=max_tokens, temperature=1.0, seed=1234)
            else:
                result = a_run.sample(prompts=prompts, max_tokens=max_tokens, temperature=1.0, seed=1234)
            return time.perf_counter() - start, sum(len(s["tokens"]) for seqs in result["sequences"] for s in seqs)

        def b_call() -> tuple[float, float]:
            start = time.perf_counter()
            b_run.forward_backward(batch=b_batch)
            return start, time.perf_counter()

        def decoding() -> bool:
            """Whether the runtime is decoding (admins read its state): A's sample has begun."""
            response = httpx.post(f"{url}/graphql", json={"query": "{ runtime }"},
                                  headers={"Authorization": f"Bearer {server['admin_key']}"}, timeout=60)
            return bool(response.json()["data"]["runtime"].get("decode_groups"))

        log("warm-up")
        b_call()
        a_run.sample(prompts=prompts[:2], max_tokens=4, seed=0)

        alone: list[float] = []
        together: list[float] = []
        sample_alone: list[float] = []
        sample_together: list[float] = []
        generated = 0

        def phase_b_alone() -> None:
            for _ in range(args.alone_calls):
                start, end = b_call()
                alone.append(end - start)
            log(f"B alone: {', '.join(f'{s:.2f}' for s in alone[-args.alone_calls:])} s")

        def phase_a_alone() -> None:
            nonlocal generated
            seconds, generated = sample()
            sample_alone.append(seconds)
            log(f"A alone: {seconds:.2f} s for {generated} tokens")

        def phase_together() -> None:
            stop = threading.Event()
            spans: list[tuple[float, float]] = []  # A's samples, start to end
            errors: list[BaseException] = []

            def a_loop() -> None:
                try:
                    while not stop.is_set():
                        start = time.perf_counter()
                        seconds, _ = sample()
                        spans.append((start, start + seconds))
                except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                    errors.append(exc)

            a_thread = threading.Thread(target=a_loop)
            a_thread.start()
            while not decoding():
                time.sleep(0.01)  # A's decode group has started; B's calls now meet it
            began = time.perf_counter()
            calls: list[tuple[float, float]] = []
            while a_thread.is_alive():
                calls.append(b_call())
                if len(calls) >= args.calls:
                    stop.set()
            a_thread.join()
            if errors:
                raise errors[0]
            ended = spans[-1][1]
            overlapped = [end - start for start, end in calls if end <= ended]  # answered while A sampled
            together.extend(overlapped)
            sample_together.extend(end - start for start, end in spans)
            log(f"together: A {', '.join(f'{e - s:.2f}' for s, e in spans)} s; B ({len(overlapped)} calls in "
                f"{ended - began:.1f} s): {', '.join(f'{s:.2f}' for s in overlapped)} s")

        phases = [phase_b_alone, phase_a_alone, phase_together]
        for round_number in range(rounds):
            log(f"round {round_number + 1}/{rounds}")
            for phase in phases if round_number % 2 == 0 else reversed(phases):
                phase()
        device = b_run.refresh().info.get("device", args.device)
        b_client.close()
        a_client.close()

    b_alone = median(alone)
    ratios = [s / b_alone for s in together]
    p50, p90, worst = median(ratios), percentile(ratios, 0.9), max(ratios, default=float("nan"))
    slowdown = median(sample_together) / median(sample_alone)
    print(f"\n{args.model} on {device}; A samples {len(prompts)} prompts × {max_tokens} tokens; {rounds} rounds")
    print(f"B forward_backward alone  {b_alone:8.3f} s (median of {len(alone)})")
    print(f"B while A samples         p50 {p50:.2f}×  p90 {p90:.2f}×  worst {worst:.2f}× (of {len(together)} calls; "
          f"target worst ≤ {WORST_TARGET}×)")
    print(f"A's slowdown {slowdown:.2f}× ({median(sample_alone):.2f} s alone, {median(sample_together):.2f} s with "
          f"B's calls; target ≤ {SLOWDOWN_TARGET}×)")
    targets = {
        "b_worst_ratio": target(worst, "<=", WORST_TARGET, "issue 14: 8.0x through the API before"),
        "a_slowdown": target(slowdown, "<=", SLOWDOWN_TARGET, "issue 14: 2.0x through the API before"),
    }
    emit({
        "bench": "fairness", "model": args.model, "device": device, "threads": args.threads,
        "transport": "rewardsignal SDK → signal serve (GraphQL) → runtime", "prompts": len(prompts),
        "max_tokens": max_tokens, "prompt_tokens": args.prompt_tokens or None, "tokens_generated_per_sample": generated, "rounds": rounds,
        "b_calls_per_round_while_sampling": round(len(together) / rounds, 1),
        "b_latency_alone_s": [round(s, 3) for s in alone], "b_latency_while_sampling_s": [round(s, 3) for s in together],
        "b_median_alone_s": round(b_alone, 4),
        "b_ratio_p50": round(p50, 3), "b_ratio_p90": round(p90, 3), "b_ratio_worst": round(worst, 3),
        "sample_seconds_alone": [round(s, 3) for s in sample_alone],
        "sample_seconds_with_b": [round(s, 3) for s in sample_together],
        "a_slowdown": round(slowdown, 3),
        "targets": targets, "all_pass": all(t["pass"] for t in targets.values()),
    })


if __name__ == "__main__":
    main()
