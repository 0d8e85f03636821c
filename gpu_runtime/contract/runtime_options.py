"""The runtime's own options (the server passes them through; `signal runtime` takes them) and the per-call size bounds
they set, checked by the server before a call leaves it and by the runtime again once it has tokenized."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from gpu_runtime.contract.checks import is_int, is_number
from gpu_runtime.contract.sampling_settings import SamplingSettings
from gpu_runtime.errors import BadInput

RESIDENT_BYTES_UNMEASURED = 2 * 1024**3  # the resident budget where resident_bytes is 0 and nothing is measured (a CPU)
ZERO_MEANS_SIZED = frozenset({"resident_bytes"})  # options whose 0 asks the runtime to size them


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime schedules, remembers and persists. Every default lives here and only here."""

    max_batch_size: int = 64  # most items in one forward_backward
    # Per-call sizes (docs/ERRORS.md#bounds): past them a call is BAD_INPUT naming its field, so that no one call holds
    # the runtime for minutes. The server checks what it can before a call leaves; the runtime checks again, tokenized.
    max_batch_tokens: int = 65536  # most tokens in one forward_backward or forward, its rows summed
    max_sample_rows: int = 2048  # most sequences one sample makes: prompts x num_samples (an RL step's 128 x 16)
    max_sample_prompt_tokens: int = 65536  # most prompt tokens one sample prefills: their sum x num_samples
    max_sample_tokens: int = 32768  # most tokens one sample may generate: its rows x max_tokens
    tick_tokens: int = 8192  # most tokens of forward_backward rows in one co-batched pass
    decode_chunk_seconds: float = 0.25  # a decode group yields to other work after this long
    # LoRA + AdamW + gradients of resident runs; LRU idle runs are evicted past it. 0: sized from the device's free
    # memory each tick, a pass's activations at the token budget set aside (compute/memory_fit.py:resident_budget)
    resident_bytes: int = 0
    resident_runs: int = 256  # and at most this many runs in memory
    snapshot_every_steps: int = 50  # a run that changed is snapshotted every N optim_steps…
    snapshot_every_seconds: float = 600.0  # …or after this long, whichever comes first
    keep_snapshots: int = 2  # snapshots kept per run (the newest ones)
    base_idle_seconds: float = 900.0  # a base with no resident runs is unloaded after this long idle
    local_ranks: int = 1  # rank processes of the pool: N > 1 shards each base with FSDP (N GPUs, or N CPU processes)
    rank_timeout_seconds: float = 300.0  # a collective that waits longer means a hung rank: every rank stops
    unnamed_snapshot_seconds: float = 3600.0  # an unnamed sampler snapshot expires this long after it was made
    min_free_disk_bytes: int = 64 * 1024**2  # below this free space, calls that write are refused (RESOURCE_EXHAUSTED)
    # A user's calls in flight in the runtime (scheduler.py): past the first, calls wait their turn; past the second
    # waiting too, RESOURCE_EXHAUSTED (resource "calls", retry_after_s). An RL loop's 128 samples at once wait, not fail.
    max_user_calls_in_flight: int = 64
    max_user_calls_waiting: int = 1024
    # Most bytes of one checkpoint sent through the runtime's export_checkpoint (base64 in one JSON answer: Modal's
    # downloads); a bigger one is copied with `signal pull`, and the dashboard says so instead of offering a link.
    export_limit_bytes: int = 256 * 1024**2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not is_number(value) or value < 0 or (value == 0 and f.name not in ZERO_MEANS_SIZED):
                what = "a positive number (or 0: sized by the runtime)" if f.name in ZERO_MEANS_SIZED else "a positive number"
                raise BadInput(f"runtime option {f.name} must be {what}, got {value!r}", field=f.name)
            if f.type in ("int", int) and not is_int(value):
                raise BadInput(f"runtime option {f.name} must be an integer, got {value!r}", field=f.name)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)  # every option is a number

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuntimeOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BadInput(f"unknown runtime options {unknown}; known: {sorted(known)}", field=unknown[0])
        return cls(**data)


def check_sample_size(prompt_count: int, settings: SamplingSettings, options: RuntimeOptions, field: str,
                      prompt_lengths: list[int] | None = None) -> None:
    """One sample call's size against the bounds: its rows (prompts x num_samples), the tokens it may generate (rows
    x max_tokens) and, given the prompts' lengths in tokens, the tokens its prefill holds (their sum x num_samples).
    `field` names the prompts (prompts or prompt_tokens)."""
    rows = prompt_count * settings.num_samples
    if rows > options.max_sample_rows:
        raise BadInput(f"{prompt_count} prompts x num_samples {settings.num_samples} = {rows} sequences; a sample "
                       f"makes at most {options.max_sample_rows}",
                       field=field if prompt_count > options.max_sample_rows else "num_samples")
    generated = rows * settings.max_tokens
    if generated > options.max_sample_tokens:
        raise BadInput(f"{rows} sequences x max_tokens {settings.max_tokens} = {generated} tokens; a sample "
                       f"generates at most {options.max_sample_tokens}", field="max_tokens")
    if prompt_lengths is not None:
        prefill = sum(prompt_lengths) * settings.num_samples
        if prefill > options.max_sample_prompt_tokens:
            raise BadInput(f"{sum(prompt_lengths)} prompt tokens x num_samples {settings.num_samples} = {prefill}; a "
                           f"sample takes at most {options.max_sample_prompt_tokens}", field=field)


def check_batch_size(items: int, tokens: int, options: RuntimeOptions) -> None:
    """One forward_backward's (or forward's) size: its items and its rows' tokens. The server passes the tokens it
    can count without a tokenizer (token items), a lower bound; the runtime passes the rendered rows' own."""
    if items > options.max_batch_size:
        raise BadInput(f"batch has {items} items; a call takes at most {options.max_batch_size}", field="batch")
    if tokens > options.max_batch_tokens:
        raise BadInput(f"batch has {tokens} tokens; a call takes at most {options.max_batch_tokens}", field="batch")
