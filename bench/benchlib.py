"""What every benchmark here shares: progress lines, a scratch data directory, medians, targets, the JSON line.

Each benchmark prints progress to stderr and one JSON object as the last line of stdout, with its
figures, its targets and whether each target passed. Runs live in a scratch data directory whose
`models/` points at the real one, so the default model is de-quantized once and reused after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

_STARTED = time.monotonic()

# ~20 tokens each in SmolLM2's tokenizer: one short training example per run.
SHORT_TEXTS = [
    "The quick brown fox jumps over the lazy dog, then naps beside the old stone wall.",
    "Water boils at one hundred degrees Celsius at sea level, and less on a mountain.",
    "A haiku has three lines: five syllables, then seven, then five again at the end.",
    "Paris is the capital of France, and Berlin is the capital of Germany, of course.",
    "To reverse a list in Python, call its reverse method or slice it with a step of -1.",
    "The train left the station at nine, and by noon it had crossed the wide river.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen.",
    "She opened the letter slowly, smiled, and put it back into the blue envelope.",
]


def log(message: str) -> None:
    """A progress line on stderr, with seconds since the benchmark started."""
    print(f"[{time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def common_args(parser: argparse.ArgumentParser) -> None:
    from gpu_runtime.client.model_files import DEFAULT_BASE_MODEL

    parser.add_argument("--model", default=DEFAULT_BASE_MODEL, help="base model: a catalogue name or a local directory")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir", default=str(REPO_ROOT / "data"),
                        help="the data directory whose models/ cache is reused (default ./data)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads, here and in worker processes (0: torch's default)")


def use_tiny_model(args: argparse.Namespace, scratch: Path) -> None:
    """Serve the tests' tiny model: a catalogue of it alone, through the environment `signal serve` inherits."""
    from tests.helpers.live_server import TINY_MODEL, write_catalog
    from tests.helpers.tiny_model import build_tiny_model

    path = build_tiny_model(scratch / TINY_MODEL, tokenizer_cache=scratch / "tokenizer")
    os.environ["SIGNAL_MODELS_FILE"] = str(write_catalog(scratch / "models.yaml", path))
    args.model = TINY_MODEL


def apply_threads(threads: int) -> dict[str, str]:
    """Set this process's torch threads; return the environment a worker process should get for the same."""
    load, cpus = load_average(), os.cpu_count() or 1
    if load and load[0] > cpus / 2:
        log(f"load average {load[0]} on {cpus} CPUs: other processes compete for them"
            + ("; torch's default threads spin-wait badly then, so figures swing: consider --threads 1" if threads <= 0 else ""))
    if threads <= 0:
        return {}
    import torch

    torch.set_num_threads(threads)
    # SIGNAL_THREADS too: a server started from this environment sets its runtime's threads from it (default: cores).
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "SIGNAL_THREADS": str(threads)}


@contextmanager
def scratch_data_dir(model_cache_parent: str | Path) -> Iterator[Path]:
    """A fresh data directory for this benchmark's runs, sharing the real one's model cache."""
    cache = Path(model_cache_parent).resolve() / "models"
    cache.mkdir(parents=True, exist_ok=True)
    # ignore_cleanup_errors: a runtime process still writing its last step as the server stops leaves files behind
    with tempfile.TemporaryDirectory(prefix="signal-bench-", ignore_cleanup_errors=True) as tmp:
        (Path(tmp) / "models").symlink_to(cache)
        yield Path(tmp)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Alternated:
    """What `alternate` measured: each side's timed seconds, and what each side returned in its last round."""

    seconds: dict[str, list[float]]
    last: dict[str, Any]

    def medians(self) -> dict[str, float]:
        return {name: median(values) for name, values in self.seconds.items()}


def wall_seconds(name: str, fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(sides: dict[str, Callable[[], Any]], rounds: int, *, measure: Callable[[str, Callable[[], Any]], float] = wall_seconds,
              deadline: float | None = None, describe: Callable[[Any], str] | None = None) -> Alternated:
    """One warm-up round of every side, then up to `rounds` timed rounds, the sides' order rotating each round so
    none always goes first. With a `deadline` (time.monotonic()), no timed round after the first starts when one
    more, as long as the last, would pass it. `measure(name, fn)` gives the seconds (default: wall time)."""
    names = list(sides)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, Any] = {}
    round_s = 0.0
    for number in range(rounds + 1):
        if deadline is not None and number > 1 and time.monotonic() + round_s > deadline:
            log(f"{number - 1} timed rounds: another of {round_s:.1f} s would pass the deadline")
            break
        started = time.monotonic()
        for name in names[number % len(names):] + names[:number % len(names)]:
            def side(name: str = name) -> None:
                last[name] = sides[name]()

            took = measure(name, side)
            if number:  # round 0 warms up
                seconds[name].append(took)
            shown = f"  {describe(last[name])}" if describe and last.get(name) is not None else ""
            log(f"round {number}{' (warm-up)' if not number else ''}: {name:<18} {took:7.3f} s{shown}")
        round_s = time.monotonic() - started
    return Alternated(seconds, last)


def target(value: float, op: str, bound: float, note: str | None = None) -> dict[str, Any]:
    """One figure against its target: {"value", "target", "pass"}."""
    passed = value >= bound if op == ">=" else value <= bound
    result: dict[str, Any] = {"value": round(value, 4), "target": f"{op} {bound}", "pass": bool(passed)}
    if note:
        result["note"] = note
    return result


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_average": load_average()}


def emit(result: dict[str, Any]) -> None:
    """The summary: one JSON object, the last line of stdout."""
    result = {**result, "machine_at_start": _MACHINE_AT_START, "machine_at_end": machine(),
              "wall_seconds": round(time.monotonic() - _STARTED, 1)}
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


_MACHINE_AT_START = machine()


def proc_io(pid: int) -> dict[str, int]:
    """A process's I/O counters from /proc/PID/io (write_bytes: to storage; wchar: through write calls)."""
    counters = {}
    with open(f"/proc/{pid}/io") as fh:
        for line in fh:
            key, value = line.split(":")
            counters[key.strip()] = int(value)
    return counters


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS) and friends from /proc/PID/status, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("Vm"):
                key, value = line.split(":")
                parts = value.split()
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


class BenchServer:
    """A real Signal server for a benchmark: uvicorn on loopback, its own runtime process and SQLite, the model in a
    one-entry catalogue as the default, and an SDK client with a fresh user's key (`client`)."""

    def __init__(self, model: str, device: str, data_dir: Path) -> None:
        import asyncio
        import socket
        import threading

        import uvicorn
        import yaml

        from app.db import Database
        from app.server import create_app
        from app.services.keys import KeyService
        from app.services.users import UserService
        from app.settings import Settings
        from rewardsignal import SignalClient

        catalog = data_dir / "bench-models.yaml"
        catalog.write_text(yaml.safe_dump({"models": [{"name": "bench-model", "path": model,
                                                        "parameters": 135_000_000}]}))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        settings = Settings(_env_file=None, data_dir=data_dir, port=port, device=device, models_file=catalog,
                            default_model="bench-model", bootstrap_admin=False)
        self.server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

        async def make_key() -> str:
            db = Database(settings.resolved_database_url)
            user, _ = await UserService(db).get_or_create("bench@localhost")
            secret, _ = await KeyService(db).create(user, "bench")
            await db.dispose()
            return secret

        self.url, self.model_name = f"http://127.0.0.1:{port}", "bench-model"
        self.api_key = asyncio.run(make_key())
        self.client = SignalClient(api_key=self.api_key, base_url=self.url)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=60)


def sse_chunks(response: Any) -> Iterator[dict[str, Any]]:
    """A streamed /v1 answer's `data:` chunks as JSON (an httpx streaming response); an error chunk raises."""
    for line in response.iter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            raise RuntimeError(chunk["error"])
        yield chunk
