"""Stability info for stable_reinforce: what a sample with `record_stability_info` kept per sampled sequence (its
tokens, the sampler's per-token logprobs, the weights it sampled from), and the datums whose provenance names them.

A forward_backward datum's `loss_fn_input_spans` tile its positions; each SampledProvenanceSpan claims positions of
one recorded sequence, whose recorded logprobs replace the datum's own `logprobs` there (docs/LOSSES.md). The record
lives for the Tinker result TTL and is bounded per user by tokens (oldest dropped first). It is kept in this server
process: a deployment of several processes must send a datum to the process that sampled it (docs/TINKER.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from starlette.requests import Request

from app.errors import BadInput
from app.tinker.endpoint import services
from app.tinker.proto import TinkerDatum, Values

# Per user: 8M recorded tokens (about 100 MB of lists at most); an RL step of 64 x 16 x 4096 tokens fits twice.
MAX_TOKENS_PER_USER = 8_000_000


@dataclass(frozen=True)
class Recorded:
    tokens: list[int]
    logprobs: list[float]
    weights_version: str  # the sampler's weights: its tinker:// path, or the base model's name
    expires_at: float


class StabilityStore:
    """(user, sequence_id) → Recorded, per user in insertion order, bounded in time and tokens."""

    def __init__(self, ttl_s: float, max_tokens: int = MAX_TOKENS_PER_USER) -> None:
        self.ttl_s, self.max_tokens = ttl_s, max_tokens
        self._users: dict[str, OrderedDict[str, Recorded]] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, user_id: str, sequence_id: str, tokens: list[int], logprobs: list[float],
               weights_version: str) -> None:
        with self._lock:
            records = self._users.setdefault(user_id, OrderedDict())
            self._expire(user_id, records)
            records[sequence_id] = Recorded(list(tokens), list(logprobs), weights_version,
                                            time.monotonic() + self.ttl_s)
            self._sizes[user_id] = self._sizes.get(user_id, 0) + len(tokens)
            while self._sizes[user_id] > self.max_tokens and records:
                _, dropped = records.popitem(last=False)
                self._sizes[user_id] -= len(dropped.tokens)

    def get(self, user_id: str, sequence_id: str) -> Recorded | None:
        """The user's own record; None if unknown, expired or another user's (indistinguishable on purpose)."""
        with self._lock:
            records = self._users.get(user_id)
            if records is None:
                return None
            self._expire(user_id, records)
            return records.get(sequence_id)

    def _expire(self, user_id: str, records: OrderedDict[str, Recorded]) -> None:
        now = time.monotonic()
        while records:
            key, oldest = next(iter(records.items()))
            if oldest.expires_at > now:
                break
            del records[key]
            self._sizes[user_id] -= len(oldest.tokens)


def store(request: Request) -> StabilityStore:
    """The server's one store (on the app's state, made at first use with the result TTL as its clock)."""
    state = request.app.state
    if not hasattr(state, "tinker_stability"):
        state.tinker_stability = StabilityStore(services(request).settings.tinker_result_ttl_s)
    return state.tinker_stability  # type: ignore[no-any-return]  # Starlette's state is untyped


def resolve(store: StabilityStore, user_id: str, datums: list[TinkerDatum], loss_fn: str) -> list[str]:
    """For stable_reinforce, each datum's recorded logprobs in place of its own at the positions its sampled spans
    claim; returns the weights versions the datums' sequences were sampled from. A datum without spans keeps its own
    logprobs. Other losses ignore provenance (the cookbook's rl/train.py sends it with every loss, sampled without
    record_stability_info): their spans are dropped unread."""
    versions: list[str] = []
    for i, datum in enumerate(datums):
        spans, datum.spans = datum.spans, []
        if not spans or loss_fn != "stable_reinforce":
            continue
        at = f"data[{i}].loss_fn_input_spans"
        inputs = datum.loss_fn_inputs
        n = len(datum.model_input)
        if sum(span.length for span in spans) != n:
            raise BadInput(f"{at} cover {sum(s.length for s in spans)} positions; the datum has {n}", field=at)
        logprobs = _flat(inputs.get("logprobs") or [0.0] * n, f"data[{i}].loss_fn_inputs.logprobs")
        targets = _flat(inputs.get("target_tokens") or [], f"data[{i}].loss_fn_inputs.target_tokens")
        position = 0
        for j, span in enumerate(spans):
            if span.kind == "sampled":
                where = f"{at}[{j}].sequence_id"
                found = store.get(user_id, span.sequence_id)
                if found is None:
                    raise BadInput(f"{where}: no recorded sequence {span.sequence_id!r} (unknown, expired, or "
                                   "sampled without record_stability_info)", field=where)
                end = span.offset + span.length
                if end > len(found.tokens):
                    raise BadInput(f"{at}[{j}] reaches position {end} of a sequence of {len(found.tokens)} tokens",
                                   field=f"{at}[{j}].length")
                if targets[position:position + span.length] != found.tokens[span.offset:end]:
                    raise BadInput(f"{at}[{j}]: target_tokens differ from the recorded sequence's tokens",
                                   field=f"{at}[{j}]")
                logprobs[position:position + span.length] = found.logprobs[span.offset:end]
                versions.append(found.weights_version)
            position += span.length
        inputs["logprobs"] = logprobs
    return versions


def _flat(values: Values, field: str) -> list[float]:
    """A 1-D loss input (a copy): stable_reinforce's logprobs and targets are per position."""
    flat = [v for v in values if not isinstance(v, list)]
    if len(flat) != len(values):
        raise BadInput(f"{field} must be 1-D for stable_reinforce", field=field)
    return flat


def ratio_metrics(datums: list[TinkerDatum], outputs: list[dict[str, list[float]]], cap: float) -> dict[str, float]:
    """The correction stable_reinforce applied, from the learner's logprobs the pass returned: the importance ratio's
    mean and max over the positions that carry an advantage, and the fraction truncated at the cap."""
    ratios: list[float] = []
    for i, (datum, output) in enumerate(zip(datums, outputs)):
        inputs = datum.loss_fn_inputs
        at = f"data[{i}].loss_fn_inputs"
        weights = _flat(inputs["weights"], f"{at}.weights") if "weights" in inputs else None
        for k, (lp, slp, adv) in enumerate(zip(output["logprobs"], _flat(inputs["logprobs"], f"{at}.logprobs"),
                                               _flat(inputs["advantages"], f"{at}.advantages"))):
            if adv != 0 and (weights is None or weights[k] != 0):
                ratios.append(math.exp(min(lp - slp, 700.0)))  # exp's overflow bound: a ratio that large is just huge
    if not ratios:
        return {}
    return {"stability/ratio:mean": sum(ratios) / len(ratios), "stability/ratio:max": max(ratios),
            "stability/truncated:mean": sum(r > cap for r in ratios) / len(ratios)}
