"""The engine contract, torch-free: defaults, bounds and validators shared by `app` and `gpu_runtime`.

One source for every default and bound. The server validates with these before a call leaves it;
the runtime validates again with the same functions, so a client that skips the server is held to
the same rules. Errors are `BadInput` naming the field in the contract's own (snake_case) names;
the server renames them to GraphQL's camelCase.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from gpu_runtime.errors import BadInput

# ---- ids ---------------------------------------------------------------------------------------

SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_REQUEST_ID_LENGTH = 128


def check_id(value: Any, field: str) -> str:
    # Run and user ids become directory names, so nothing that could climb out of runs/.
    if not isinstance(value, str) or not SAFE_ID.match(value) or ".." in value:
        raise BadInput(f"{field} must be 1-128 characters of letters, digits, '_', '-', '.', got {value!r}", field=field)
    return value


def check_request_id(request_id: Any) -> None:
    # The runtime journals it with every call: a bounded, printable token (the SDK sends a UUID).
    if request_id is not None and not (isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH
                                       and request_id.isprintable()):
        raise BadInput(f"request_id must be 1..{MAX_REQUEST_ID_LENGTH} printable characters", field="request_id")


def check_text(value: Any, field: str) -> None:
    """A string the tokenizer will see must be encodable: JSON's \\ud800 escapes deliver lone surrogates."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadInput(f"{field} has a character that is not valid Unicode text at {exc.start}", field=field) from None


def check_batch_text(batch: list[Any]) -> None:
    """`check_text` on every string of a batch: its items' values and their messages' fields. Token lists are
    skipped whole: a 64 x 2048 batch is 131k ints the walk need not visit on every call."""
    for i, item in enumerate(batch):
        if not isinstance(item, dict):
            continue  # the renderer names a non-object item
        for key, value in item.items():
            check_text(value, f"batch[{i}].{key}")
            if key == "messages" and isinstance(value, list):
                for j, message in enumerate(value):
                    if isinstance(message, dict):
                        for name, text in message.items():
                            check_text(text, f"batch[{i}].{key}[{j}].{name}")


# ---- AdamW -------------------------------------------------------------------------------------

ADAM_DEFAULTS: dict[str, float] = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 1.0,  # 0 turns clipping off
}
# (lowest, highest, lowest allowed itself?, highest allowed itself?) per setting.
ADAM_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "learning_rate": (0.0, 1.0, False, True),
    "beta1": (0.0, 1.0, True, False),
    "beta2": (0.0, 1.0, True, False),
    "eps": (0.0, 1.0, False, True),
    "weight_decay": (0.0, 10.0, True, True),
    "grad_clip_norm": (0.0, math.inf, True, True),
}


def check_adam_value(key: str, value: Any) -> float:
    low, high, low_ok, high_ok = ADAM_BOUNDS[key]
    ok = _is_number(value) and (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
    if not ok:
        bound = f"{'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
        raise BadInput(f"adam.{key} must be a number in {bound}, got {value!r}", field=f"adam.{key}")
    return float(value)


def adam_settings(adam: Any) -> dict[str, float]:
    """The user's AdamW overrides over the defaults; unknown or out-of-range settings name their field."""
    adam = {} if adam is None else adam
    if not isinstance(adam, dict):
        raise BadInput("adam must be an object of AdamW settings", field="adam")
    settings = dict(ADAM_DEFAULTS)
    for key, value in adam.items():
        if key not in ADAM_DEFAULTS:
            raise BadInput(f"unknown AdamW setting {key!r}; known: {sorted(ADAM_DEFAULTS)}", field=f"adam.{key}")
        if value is not None:
            settings[key] = check_adam_value(key, value)
    return settings


# ---- LoRA --------------------------------------------------------------------------------------

LORA_DEFAULTS: dict[str, Any] = {"r": 32, "alpha": 64.0, "dropout": 0.0}  # alpha = 2r, the usual choice
LORA_R_MAX = 512
LORA_KEYS = {"r", "alpha", "dropout", "target_modules"}
# Attention projections by architecture family; the default targets are whichever the model has.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "out_proj")


def default_target_modules(available: set[str]) -> list[str]:
    return [name for name in ATTENTION_PROJECTIONS if name in available]


def lora_settings(lora: Any, available: set[str] | None = None) -> dict[str, Any]:
    """Validate the user's LoRA dict and fill defaults; errors name the field (`lora.r`).

    With `available` (the base's linear layer names) the targets are checked and defaulted too;
    without it (the server, which has no model) they are only checked for shape.
    """
    lora = {} if lora is None else lora
    if not isinstance(lora, dict):
        raise BadInput(f"lora must be an object with r, alpha, dropout, target_modules, got {type(lora).__name__}", field="lora")
    for key in lora:
        if key not in LORA_KEYS:
            raise BadInput(f"unknown LoRA setting {key!r}; known: {sorted(LORA_KEYS)}", field=f"lora.{key}")
    r = lora.get("r", LORA_DEFAULTS["r"])
    if not _is_int(r) or not 1 <= r <= LORA_R_MAX:
        raise BadInput(f"lora.r must be an integer in 1..{LORA_R_MAX}, got {r!r}", field="lora.r")
    alpha = lora.get("alpha")
    alpha = 2.0 * r if alpha is None else alpha
    if not _is_number(alpha) or not alpha > 0:
        raise BadInput(f"lora.alpha must be a number > 0, got {alpha!r}", field="lora.alpha")
    dropout = lora.get("dropout", LORA_DEFAULTS["dropout"])
    dropout = LORA_DEFAULTS["dropout"] if dropout is None else dropout
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise BadInput(f"lora.dropout must be a number in [0, 1), got {dropout!r}", field="lora.dropout")
    targets = lora.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if targets is None:
        if available is not None:
            targets = default_target_modules(available)
            if not targets:
                raise BadInput("this architecture has no known attention projections; name lora.target_modules",
                               field="lora.target_modules")
    elif not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise BadInput("lora.target_modules must be a non-empty list of module names", field="lora.target_modules")
    if targets is not None and available is not None:
        missing = [t for t in targets if t not in available]
        if missing:
            raise BadInput(f"lora.target_modules {missing} not in this model; it has {sorted(available)}",
                           field="lora.target_modules")
    return {"r": r, "alpha": float(alpha), "dropout": float(dropout),
            "target_modules": sorted(set(targets)) if targets is not None else None}


# ---- batches -------------------------------------------------------------------------------------

# A batch item is one of these key sets (gpu_runtime/batches.py renders them): text, a prompt/answer pair, a chat,
# or token level. Token items take per-token logprobs and advantages for the RL losses.
TEXT_KEYS = ({"text"}, {"input", "output"}, {"input"}, {"output"}, {"messages"})
TOKEN_KEYS = {"tokens", "weights", "logprobs", "advantages"}
ITEM_KEYS = {"text", "input", "output", "messages"} | TOKEN_KEYS
DEFAULT_LOSS_FN = "cross_entropy"

# ---- sampling ----------------------------------------------------------------------------------

MAX_TOKENS_LIMIT = 4096
MAX_SAMPLES = 16
SAMPLE_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "num_samples": 1}


@dataclass
class SamplingSettings:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    num_samples: int
    seed: int


def sampling_settings(
    prompts: Any, max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, stop: Any, num_samples: Any, seed: Any
) -> tuple[list[str], SamplingSettings]:
    if not isinstance(prompts, list) or not prompts:
        raise BadInput("prompts must be a non-empty list of strings", field="prompts")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise BadInput(f"prompts[{i}] must be a non-empty string", field=f"prompts[{i}]")
        check_text(prompt, f"prompts[{i}]")
    if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadInput(f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {max_tokens!r}", field="max_tokens")
    if not _is_number(temperature) or temperature < 0:
        raise BadInput(f"temperature must be a number >= 0, got {temperature!r}", field="temperature")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise BadInput(f"top_p must be a number in (0, 1], got {top_p!r}", field="top_p")
    if not _is_int(top_k) or top_k < 0:
        raise BadInput(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}", field="top_k")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadInput("stop must be a string or a list of non-empty strings", field="stop")
    if not _is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES:
        raise BadInput(f"num_samples must be an integer in 1..{MAX_SAMPLES}, got {num_samples!r}", field="num_samples")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    elif not _is_int(seed) or seed < 0:
        raise BadInput(f"seed must be a non-negative integer or null, got {seed!r}", field="seed")
    return prompts, SamplingSettings(max_tokens, float(temperature), float(top_p), top_k, stop, num_samples, seed)


# ---- saving ------------------------------------------------------------------------------------

SAVE_MODES = ("adapter", "merged", "state")

# ---- the runtime's own settings (the server passes them through; `signal runtime` takes them) ----


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime schedules, remembers and persists. Every default lives here and only here."""

    max_batch_size: int = 64  # most items in one forward_backward
    tick_tokens: int = 8192  # most tokens of forward_backward rows in one co-batched pass
    decode_chunk_seconds: float = 0.25  # a decode group yields to other work after this long
    resident_bytes: int = 2 * 1024**3  # LoRA + AdamW + gradients of resident runs; LRU idle runs are evicted past it
    resident_runs: int = 256  # and at most this many runs in memory
    snapshot_every_steps: int = 50  # a run that changed is snapshotted every N optim_steps…
    snapshot_every_seconds: float = 600.0  # …or after this long, whichever comes first
    keep_snapshots: int = 2  # snapshots kept per run (the newest ones)
    base_idle_seconds: float = 900.0  # a base with no resident runs is unloaded after this long idle
    local_ranks: int = 1  # rank processes of the pool: N > 1 shards each base with FSDP (N GPUs, or N CPU processes)
    rank_timeout_seconds: float = 300.0  # a collective that waits longer means a hung rank: every rank stops
    unnamed_snapshot_seconds: float = 3600.0  # an unnamed sampler snapshot expires this long after it was made

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not _is_number(value) or value <= 0:
                raise BadInput(f"runtime option {f.name} must be a positive number, got {value!r}", field=f.name)
            if f.type in ("int", int) and not _is_int(value):
                raise BadInput(f"runtime option {f.name} must be an integer, got {value!r}", field=f.name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuntimeOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BadInput(f"unknown runtime options {unknown}; known: {sorted(known)}", field=unknown[0])
        return cls(**data)


SNAPSHOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a path segment: no slashes, no "..", no "@"


def check_snapshot_name(value: Any, field: str) -> str:
    """A snapshot's or checkpoint's name: it becomes a directory name and half of a routing key ("<run>@<name>")."""
    if not isinstance(value, str) or not SNAPSHOT_NAME.match(value) or ".." in value:
        raise BadInput(f"{field} must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
                       f"got {value!r}", field=field)
    return value


# ---- shared checks ----------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
