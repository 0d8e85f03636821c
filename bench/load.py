"""Load with a flood (issue 19, "How it is checked"): 8 SDK clients on 4 users' runs, then a flooding user on top.

    .venv/bin/python bench/load.py [--warmup 20] [--flood 40] [--tiny] [--threads 1] [--model M]

A real `signal serve` on a fresh data directory. 4 users, 2 `rewardsignal` clients each, every client on a run of
its own, each looping forward_backward (one short text), optim_step, sample (8 tokens). Two phases:

- **warm-up** (`--warmup` s): the 8 clients alone;
- **flood** (`--flood` s): a fifth user, on 8 runs at once (raw GraphQL, no retries, so every refusal is counted),
  sends the largest calls the bounds accept: forward_backward of max_batch_size rows filling max_batch_tokens, then
  (when it was taken) optim_step, then a sample of max_sample_rows rows filling max_sample_tokens; and every third round, over-bound
  ones (one token past max_batch_tokens, one row past max_sample_rows), which must be refused BAD_INPUT. The flood
  user's calls in flight are bounded (SIGNAL_MAX_USER_CALLS_IN_FLIGHT / _WAITING below), so 8 at once also meets
  RESOURCE_EXHAUSTED.

`/healthz` is polled every 0.2 s throughout. Reported: p50 and p99 per call type and phase, and for /healthz;
errors by code (the clients', the flood's); each run's steps (every optim_step's answer, and the run's step at the
end); the server's and the runtime's RSS before and after. Targets: the clients' flood p99 per call type ≤ 3× their
warm-up p99; no client error and no flood error but its refusals (BAD_INPUT, RESOURCE_EXHAUSTED); every run's steps
contiguous (1..n, n = its final step); /healthz `ok` throughout.

The bounds are shrunk through the server's environment (BENCH_SETTINGS, in the JSON) so the flood's calls take
seconds, not minutes, on a CPU, and so is the tick's token budget (a CPU pass costs ~100x a GPU's per token: with
2048, a tick full of the flood's rows made every client's call 7-9x slower); a GPU run may raise them. `--tiny`: the tests' tiny model, for a CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
from benchlib import SHORT_TEXTS, common_args, emit, log, proc_status, target
from fairness import make_key, percentile, signal_serve, wait_ready
from openai_stream import use_tiny_model

from rewardsignal import SignalAPIError

RATIO_TARGET = 3.0
HEALTH_EVERY_S = 0.2
CLIENT_SAMPLE_TOKENS = 8
# The per-call bounds and the flood user's calls in flight, for this bench's server (each a SIGNAL_* setting).
BENCH_SETTINGS = {"SIGNAL_MAX_BATCH_SIZE": 16, "SIGNAL_MAX_BATCH_TOKENS": 1024, "SIGNAL_MAX_SAMPLE_ROWS": 16,
                  "SIGNAL_MAX_SAMPLE_TOKENS": 256, "SIGNAL_MAX_SAMPLE_PROMPT_TOKENS": 1024,
                  "SIGNAL_MAX_USER_CALLS_IN_FLIGHT": 4, "SIGNAL_MAX_USER_CALLS_WAITING": 2, "SIGNAL_TICK_TOKENS": 512}
FB = "mutation($r: ID!, $b: [BatchItem!]!) { forwardBackward(runId: $r, batch: $b) { loss } }"
OPT = "mutation($r: ID!) { optimStep(runId: $r) { step } }"
SAMPLE = ("mutation($r: ID!, $p: [[Int!]!]!, $n: Int!, $m: Int!) { sample(runId: $r, promptTokens: $p, numSamples: $n, "
          "maxTokens: $m, stop: []) { step } }")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    common_args(parser)
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds of the 8 clients alone")
    parser.add_argument("--flood", type=float, default=40.0, help="seconds of the flood on top")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model (built in a scratch directory)")
    return parser.parse_args()


class Recorder:
    """Every call's (phase, type, seconds, error code or None), from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, float, str | None]] = []
        self.flood_start = float("inf")

    def phase(self, started: float) -> str:
        return "flood" if started >= self.flood_start else "warmup"

    def add(self, started: float, kind: str, error: str | None) -> None:
        with self.lock:
            self.calls.append((self.phase(started), kind, time.monotonic() - started, error))


def error_code(exc: BaseException) -> str:
    return str(getattr(exc, "code", None) or type(exc).__name__)


def client_loop(run: Any, recorder: Recorder, stop: threading.Event, steps: list[int], text: str) -> None:
    """One SDK client: forward_backward, optim_step, sample, until told to stop."""
    calls = [("forward_backward", lambda: run.forward_backward([{"text": text}])),
             ("optim_step", lambda: steps.append(run.optim_step().step)),
             ("sample", lambda: run.sample(text[:30], max_tokens=CLIENT_SAMPLE_TOKENS, store=False))]
    while not stop.is_set():
        for kind, call in calls:
            started = time.monotonic()
            try:
                call()
                recorder.add(started, kind, None)
            except (SignalAPIError, httpx.HTTPError) as exc:  # every error is a figure, by its code
                recorder.add(started, kind, error_code(exc))


def flood_loop(url: str, key: str, run_id: str, recorder: Recorder, stop: threading.Event, steps: list[int],
               seed: int) -> None:
    """The flooding user on one run: the largest accepted calls, and over-bound ones every third round."""
    rng = random.Random(seed)
    bounds = {name: int(value) for name, value in BENCH_SETTINGS.items()}
    rows, row_tokens = bounds["SIGNAL_MAX_BATCH_SIZE"], bounds["SIGNAL_MAX_BATCH_TOKENS"] // bounds["SIGNAL_MAX_BATCH_SIZE"]
    sample_rows = bounds["SIGNAL_MAX_SAMPLE_ROWS"]
    max_tokens = bounds["SIGNAL_MAX_SAMPLE_TOKENS"] // sample_rows
    prompt_len = bounds["SIGNAL_MAX_SAMPLE_PROMPT_TOKENS"] // sample_rows

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, 10_000) for _ in range(n)]

    def send(kind: str, query: str, variables: dict[str, Any]) -> dict[str, Any] | None:
        started = time.monotonic()
        try:
            body = httpx.post(f"{url}/graphql", json={"query": query, "variables": {"r": run_id, **variables}},
                              headers={"Authorization": f"Bearer {key}"}, timeout=600).json()
        except httpx.HTTPError as exc:
            recorder.add(started, kind, type(exc).__name__)
            return None
        errors = body.get("errors") or []
        recorder.add(started, kind, (errors[0].get("extensions") or {}).get("code", "UNKNOWN") if errors else None)
        return None if errors else body["data"]

    round_ = 0
    while not stop.is_set():
        round_ += 1
        if send("flood_forward_backward", FB, {"b": [{"tokens": ids(row_tokens)} for _ in range(rows)]}) is not None:
            answer = send("flood_optim_step", OPT, {})  # only with gradients: else FAILED_PRECONDITION, its own doing
            if answer is not None:
                steps.append(int(answer["optimStep"]["step"]))
        send("flood_sample", SAMPLE, {"p": [ids(prompt_len)], "n": sample_rows, "m": max_tokens})
        if round_ % 3 == 0:
            send("over_bound_forward_backward", FB, {"b": [{"tokens": ids(row_tokens + 1)}] + [
                {"tokens": ids(row_tokens)} for _ in range(rows - 1)]})
            send("over_bound_sample", SAMPLE, {"p": [ids(4)], "n": sample_rows + 1, "m": 1})


def health_loop(url: str, stop: threading.Event, seen: list[tuple[float, str]]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                status = client.get(f"{url}/healthz").json()["status"]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                status = type(exc).__name__
            seen.append((time.monotonic() - started, status))
            stop.wait(HEALTH_EVERY_S)


def rss(pid: int) -> dict[str, int]:
    """The server's and its runtime's (its child processes') RSS, in bytes."""
    children = psutil.Process(pid).children(recursive=True)
    return {"server": proc_status(pid)["VmRSS"], "runtime": sum(child.memory_info().rss for child in children)}


def figures(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50_s": round(percentile(values, 0.5), 4), "p99_s": round(percentile(values, 0.99), 4)}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="signal-bench-load-") as scratch:
        if args.tiny:
            use_tiny_model(args, Path(scratch))
        os.environ.update({name: str(value) for name, value in BENCH_SETTINGS.items()})  # signal serve inherits them
        bench(args)


def bench(args: argparse.Namespace) -> None:
    from rewardsignal import SignalClient

    with signal_serve(args) as server:
        url = server["url"]
        wait_ready(url)
        keys = [make_key(server["env"], f"user{u}@load") for u in range(4)]
        flood_key = make_key(server["env"], "flood@load")
        clients = [SignalClient(api_key=keys[i // 2], base_url=url) for i in range(8)]
        runs = [client.create_run(seed=i, lora_r=4) for i, client in enumerate(clients)]
        flood_client = SignalClient(api_key=flood_key, base_url=url)
        flood_runs = [flood_client.create_run(seed=100 + i, lora_r=4).id for i in range(8)]
        log(f"signal serve at {url}: 8 clients on {len(runs)} runs of 4 users; the flood user on 8 runs")
        rss_before = rss(server["pid"])

        recorder, stop, health_stop = Recorder(), threading.Event(), threading.Event()
        health: list[tuple[float, str]] = []
        steps: dict[str, list[int]] = {run.id: [] for run in runs}
        steps.update({run_id: [] for run_id in flood_runs})
        health_thread = threading.Thread(target=health_loop, args=(url, health_stop, health), daemon=True)
        health_thread.start()
        with ThreadPoolExecutor(16) as pool:
            workers = [pool.submit(client_loop, run, recorder, stop, steps[run.id], SHORT_TEXTS[i])
                       for i, run in enumerate(runs)]
            stop.wait(args.warmup)
            recorder.flood_start = time.monotonic()
            log("warm-up done: the flood starts")
            workers += [pool.submit(flood_loop, url, flood_key, run_id, recorder, stop, steps[run_id], i)
                        for i, run_id in enumerate(flood_runs)]
            stop.wait(args.flood)
            stop.set()
            log("flood done: waiting for calls in flight")
            for worker in workers:
                worker.result()
        health_stop.set()
        health_thread.join()
        rss_after = rss(server["pid"])
        final_steps = {run.id: run.refresh().step for run in runs}
        final_steps |= {run_id: flood_client.get_run(run_id).step for run_id in flood_runs}

    by_kind: dict[tuple[str, str], list[float]] = defaultdict(list)
    errors: dict[str, Counter[str]] = {"clients": Counter(), "flood": Counter()}
    for phase, kind, seconds, error in recorder.calls:
        who = "flood" if kind.startswith(("flood", "over_bound")) else "clients"
        if error is not None:
            errors[who][f"{kind}:{error}"] += 1
        elif who == "clients":
            by_kind[(kind, phase)].append(seconds)
    calls = {kind: {phase: figures(by_kind[(kind, phase)]) for phase in ("warmup", "flood")}
             for kind in ("forward_backward", "optim_step", "sample")}
    ratios = {kind: target(calls[kind]["flood"]["p99_s"] / calls[kind]["warmup"]["p99_s"], "<=", RATIO_TARGET)
              for kind in calls}
    flood_calls = Counter(kind for _, kind, _, _ in recorder.calls if kind.startswith(("flood", "over_bound")))
    refusals = {"BAD_INPUT", "RESOURCE_EXHAUSTED"}
    unexpected = sum(n for name, n in errors["flood"].items() if name.split(":")[1] not in refusals)
    over_bound_accepted = sum(1 for _, kind, _, error in recorder.calls if kind.startswith("over_bound") and error is None)
    contiguous = {run_id: sorted(seen) == list(range(1, len(seen) + 1)) and final_steps[run_id] == len(seen)
                  for run_id, seen in steps.items()}
    statuses = Counter(status for _, status in health)
    emit({"benchmark": "load", "model": args.model, "tiny": args.tiny, "device": args.device, "threads": args.threads,
          "bench_settings": BENCH_SETTINGS, "warmup_s": args.warmup, "flood_s": args.flood,
          "note": "bounds and tick_tokens shrunk (bench_settings) so the flood's largest calls take seconds on a CPU",
          "calls": calls, "p99_flood_over_warmup": ratios,
          "healthz": {**figures([s for s, _ in health]), "statuses": dict(statuses)},
          "flood_calls": dict(flood_calls), "errors": {who: dict(c) for who, c in errors.items()},
          "steps": {"runs": len(steps), "optim_steps": sum(len(s) for s in steps.values()),
                    "contiguous": sum(contiguous.values())},
          "rss_bytes": {"before": rss_before, "after": rss_after},
          "targets": {"client_errors": target(sum(errors["clients"].values()), "<=", 0),
                      "flood_errors_besides_refusals": target(unexpected + over_bound_accepted, "<=", 0),
                      "steps_contiguous": target(sum(contiguous.values()), ">=", len(steps)),
                      "healthz_not_ok": target(sum(n for s, n in statuses.items() if s != "ok"), "<=", 0)},
          "pass": all(r["pass"] for r in ratios.values()) and not sum(errors["clients"].values()) and not unexpected
          and not over_bound_accepted and all(contiguous.values()) and set(statuses) == {"ok"}})


if __name__ == "__main__":
    main()
