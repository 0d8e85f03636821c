"""/v1 streams against Signal's own sample: 8 concurrent streamed chat requests vs the same 8 through `sample`.

    .venv/bin/python bench/openai_stream.py [--rounds 2] [--requests 8] [--max-tokens 128] [--threads 1] [--model M]
                                            [--tiny]

A real `signal serve` on a fresh data directory (its `models/` shared with ./data). One user's run gets 8 sampler
snapshots. Two layouts: every request on one snapshot, and request i on snapshot i (8 adapters in one decode
group). Per layout and round, both sides run, in an order that flips every round:

- **openai**: `--requests` concurrent `POST /v1/chat/completions` with `stream: true` (one httpx client, as
  the SDK has one; the SSE lines read as they come), `max_tokens`, temperature 1, seed i; time to first token is the first content chunk's arrival;
- **sample**: the same requests through the SDK's `run.sample(prompt_tokens=…, snapshot=…)` in threads, on the
  prompt ids the chat template gave (from the /v1 answer's `prompt_token_ids`); its "first token" is its answer,
  since `sample` answers once.

Tokens/s is every generated token (usage's completion_tokens, the sample's token counts) over the wall time from
the first request sent to the last answer. Target: openai ≥ 0.9 × sample. Last line: one JSON object.
`--tiny`: the tests' tiny random Llama (SmolLM2's tokenizer) instead of `--model`, for a machine too slow for it.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from benchlib import common_args, emit, log, median, sse_chunks, target, use_tiny_model
from fairness import make_key, percentile, signal_serve, wait_ready

PROMPT = "Write a long story about a lighthouse keeper and the ships she guides."
RATIO_TARGET = 0.9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per layout (after a warm-up)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model (built in a scratch directory)")
    return parser.parse_args()


def stream_one(http: httpx.Client, model: str, max_tokens: int, seed: int, start: float) -> tuple[float, int]:
    """One streamed chat request: seconds from `start` to its first content chunk, and its completion tokens."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
    first, tokens = float("nan"), 0
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for chunk in sse_chunks(response):
            delta = (chunk["choices"][0].get("delta") or {}) if chunk.get("choices") else {}
            if first != first and delta.get("content"):  # NaN: not yet
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return first, tokens


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="signal-bench-tiny-") as scratch:
        if args.tiny:
            use_tiny_model(args, Path(scratch))
        bench(args)


def bench(args: argparse.Namespace) -> None:
    from rewardsignal import SignalClient

    n = args.requests
    with signal_serve(args) as server:
        url = server["url"]
        wait_ready(url)
        key = make_key(server["env"], "stream@x")
        run = SignalClient(api_key=key, base_url=url).create_run(seed=0)
        names = [f"s{i}" for i in range(n)]
        for name in names:
            run.save_weights_for_sampler(name=name)
        probe = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=600,
                           json={"model": f"{run.id}@s0", "messages": [{"role": "user", "content": PROMPT}],
                                 "max_tokens": 2, "return_token_ids": True}).json()
        prompt_ids = probe["prompt_token_ids"]
        log(f"signal serve at {url}; run {run.id} with {n} snapshots; prompt of {len(prompt_ids)} tokens")

        # One client for every /v1 request, made before the clock starts, as the SDK's is (and the openai package's):
        # a client per request costs ~0.1 s of SSL setup in the bench's own threads, which spread the requests'
        # arrival over a decode chunk and so split their decode group.
        http = httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {key}"},
                            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

        def openai_side(snapshots: list[str]) -> dict[str, Any]:
            start = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                answers = list(pool.map(lambda i: stream_one(http, f"{run.id}@{snapshots[i]}", args.max_tokens, i,
                                                             start), range(n)))
            wall = time.perf_counter() - start
            return {"wall": wall, "tokens": sum(t for _, t in answers), "ttft": [f for f, _ in answers]}

        def sample_side(snapshots: list[str]) -> dict[str, Any]:
            start = time.perf_counter()
            firsts: list[float] = []
            lock = threading.Lock()

            def one(i: int) -> int:
                result = run.sample(prompt_tokens=[prompt_ids], max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                    snapshot=snapshots[i], store=False)
                with lock:
                    firsts.append(time.perf_counter() - start)
                return len(result["sequences"][0][0]["tokens"])

            with ThreadPoolExecutor(n) as pool:
                tokens = sum(pool.map(one, range(n)))
            return {"wall": time.perf_counter() - start, "tokens": tokens, "ttft": firsts}

        layouts = {"one_snapshot": ["s0"] * n, "eight_snapshots": names}
        log("warm-up")
        openai_side(layouts["eight_snapshots"])
        sample_side(layouts["eight_snapshots"])
        figures: dict[str, Any] = {}
        for layout, snapshots in layouts.items():
            seen: dict[str, list[dict[str, Any]]] = {"openai": [], "sample": []}
            for r in range(args.rounds):
                order = [("openai", openai_side), ("sample", sample_side)]
                for side, work in order if r % 2 == 0 else order[::-1]:
                    got = work(snapshots)
                    seen[side].append(got)
                    log(f"{layout} round {r} {side}: {got['tokens']} tokens in {got['wall']:.2f} s, "
                        f"first token p50 {median(got['ttft']):.2f} s")
            per_side = {}
            for side, results in seen.items():
                ttft = [t for got in results for t in got["ttft"]]
                per_side[side] = {"tokens_per_s": round(sum(g["tokens"] for g in results) /
                                                       sum(g["wall"] for g in results), 2),
                                  "ttft_p50_s": round(percentile(ttft, 0.5), 3),
                                  "ttft_p95_s": round(percentile(ttft, 0.95), 3)}
            ratio = per_side["openai"]["tokens_per_s"] / per_side["sample"]["tokens_per_s"]
            figures[layout] = {**per_side, "ratio": target(ratio, ">=", RATIO_TARGET)}
        http.close()
    emit({"benchmark": "openai_stream", "model": args.model, "tiny": args.tiny, "device": args.device, "threads": args.threads,
          "requests": n, "max_tokens": args.max_tokens, "rounds": args.rounds, **figures,
          "pass": all(f["ratio"]["pass"] for f in figures.values())})


if __name__ == "__main__":
    main()
