"""Fairness on the `/v1` and Tinker wires (issue 34 #10), for bench/fairness.py's `--mode v1|tinker`.

User A floods one wire: `--streams` streamed `/v1/completions` held open again and again (v1), or `--futures`
Tinker `asample` futures kept in flight (tinker; past SIGNAL_MAX_USER_SAMPLES_IN_FLIGHT the server refuses A's
excess with 429 and the SDK backs off and resubmits it). User B sends a small call on the same wire, a 4-token
completion, `--alone-calls` times alone and, once A's first tokens arrived, back to back until `--calls` of them
were answered while A's flood ran. B's median together over its median alone is the ratio (target ≤ 3×).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from benchlib import log, median, sse_chunks

B_PROMPT, B_MAX_TOKENS = "Say hello.", 4  # B's small call: the 4-token completion
A_PROMPT = "Write a long story about a lighthouse keeper and the ships she guides."


class Flood:
    """A's load on one wire, run in a thread until `stop`; `started` is set once A's first tokens came back."""

    def __init__(self) -> None:
        self.stop, self.started = threading.Event(), threading.Event()
        self.finished, self.tokens, self.refused = 0, 0, 0
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()

    def done(self, tokens: int) -> None:
        with self.lock:
            self.finished += 1
            self.tokens += tokens
        self.started.set()


class V1Wire:
    """`/v1/completions` with plain httpx, as any OpenAI client sends it."""

    def __init__(self, url: str, a_key: str, b_key: str, model: str, streams: int, max_tokens: int) -> None:
        self.model, self.streams, self.max_tokens = model, streams, max_tokens
        # One pooled client per user, made before the clock starts: a client per request spreads A's arrivals
        # over a decode chunk and so splits its decode group (bench/openai_stream.py).
        self.a_http = httpx.Client(base_url=url, timeout=900, headers={"Authorization": f"Bearer {a_key}"},
                                   limits=httpx.Limits(max_connections=streams, max_keepalive_connections=streams))
        self.b_http = httpx.Client(base_url=url, timeout=900, headers={"Authorization": f"Bearer {b_key}"})
        self.shape = f"{streams} streams × {max_tokens} tokens"

    def b_call(self) -> float:
        start = time.perf_counter()
        answer = self.b_http.post("/v1/completions", json={"model": self.model, "prompt": B_PROMPT,
                                                            "max_tokens": B_MAX_TOKENS, "temperature": 0.0})
        answer.raise_for_status()
        return time.perf_counter() - start

    def _stream(self, flood: Flood, seed: int) -> None:
        body = {"model": self.model, "prompt": A_PROMPT, "max_tokens": self.max_tokens, "temperature": 1.0,
                "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        with self.a_http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:  # past the per-user bound: counted, and sent again
                response.read()
                with flood.lock:
                    flood.refused += 1
                time.sleep(float(response.headers.get("Retry-After", "1")))
                return
            response.raise_for_status()
            for chunk in sse_chunks(response):
                flood.started.set()  # A's tokens are flowing: B's calls now meet its decoding
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        flood.done(tokens)

    def flood(self, flood: Flood) -> Callable[[], None]:
        def one(index: int) -> None:
            try:
                seed = index
                while not flood.stop.is_set():
                    self._stream(flood, seed)
                    seed += self.streams
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                flood.errors.append(exc)
                flood.started.set()

        def run() -> None:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(self.streams)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        return run

    def close(self) -> None:
        self.a_http.close()
        self.b_http.close()


class TinkerWire:
    """The unmodified `tinker` SDK on /api/v1: A's futures awaited on one event loop."""

    def __init__(self, url: str, a_key: str, b_key: str, model: str, futures: int, max_tokens: int) -> None:
        import tinker
        from tinker import types

        self.types, self.futures, self.max_tokens = types, futures, max_tokens
        self.a_service = tinker.ServiceClient(base_url=url, api_key="tml-" + a_key)
        self.b_service = tinker.ServiceClient(base_url=url, api_key="tml-" + b_key)
        self.a_sampler = self.a_service.create_sampling_client(base_model=model).result()
        self.b_sampler = self.b_service.create_sampling_client(base_model=model).result()
        # Token ids, not text: the SDK's tokenizer would be fetched from the Hub (ids below 5k exist in every tokenizer).
        self.a_prompt = types.ModelInput.from_ints([(17 * j) % 5000 + 100 for j in range(16)])
        self.b_prompt = types.ModelInput.from_ints([(31 * j) % 5000 + 100 for j in range(4)])
        self.shape = f"{futures} asample futures × {max_tokens} tokens"

    def b_call(self) -> float:
        start = time.perf_counter()
        self.b_sampler.sample(prompt=self.b_prompt, num_samples=1, sampling_params=self.types.SamplingParams(
            max_tokens=B_MAX_TOKENS, temperature=0.0)).result()
        return time.perf_counter() - start

    def flood(self, flood: Flood) -> Callable[[], None]:
        async def one(seed: int) -> None:
            while not flood.stop.is_set():
                params = self.types.SamplingParams(max_tokens=self.max_tokens, temperature=1.0, seed=seed)
                result = await self.a_sampler.sample(prompt=self.a_prompt, num_samples=1,
                                                      sampling_params=params)
                flood.done(len(result.sequences[0].tokens))
                seed += self.futures

        async def all_of_them() -> None:
            # Once B is done, A's futures are dropped, not drained: 200 × max_tokens more would outlast `--quick`.
            flooding = asyncio.gather(*(one(i) for i in range(self.futures)))
            await asyncio.to_thread(flood.stop.wait)
            flooding.cancel()
            await asyncio.gather(flooding, return_exceptions=True)

        def run() -> None:
            try:
                asyncio.run(all_of_them())
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                flood.errors.append(exc)
                flood.started.set()

        return run

    def close(self) -> None:
        self.a_service.holder.close()
        self.b_service.holder.close()


def measure(wire: V1Wire | TinkerWire, alone_calls: int, calls: int) -> dict[str, Any]:
    """B alone, then B beside A's flood: each latency, and A's own completions meanwhile."""
    wire.b_call()  # warm-up: the base model's first sample compiles and caches
    alone = [wire.b_call() for _ in range(alone_calls)]
    log(f"B alone: {', '.join(f'{s:.2f}' for s in alone)} s")
    flood = Flood()
    thread = threading.Thread(target=wire.flood(flood))
    began = time.perf_counter()
    thread.start()
    flood.started.wait()
    log(f"A's first tokens after {time.perf_counter() - began:.1f} s")
    together: list[float] = []
    while len(together) < calls and not flood.errors:
        together.append(wire.b_call())
        log(f"B beside A: {together[-1]:.2f} s ({flood.finished} of A's completions done)")
    overlap = time.perf_counter() - began
    flood.stop.set()
    thread.join()
    if flood.errors:
        raise flood.errors[0]
    b_alone, b_together = median(alone), median(together)
    return {"b_latency_alone_s": [round(s, 3) for s in alone], "b_latency_beside_a_s": [round(s, 3) for s in together],
            "b_median_alone_s": round(b_alone, 4), "b_median_beside_a_s": round(b_together, 4),
            "ratio": b_together / b_alone, "a_completions_during": flood.finished, "a_tokens_during": flood.tokens,
            "seconds_from_a_start_to_b_done": round(overlap, 1),
            "a_refused_429": flood.refused if isinstance(wire, V1Wire) else None}  # the tinker SDK retries unseen
