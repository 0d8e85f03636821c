"""The checks every call shares: ids, request ids, text a tokenizer will see, seeds, and what a number is.

Errors are `BadInput` naming the field in the contract's own (snake_case) names.
"""

from __future__ import annotations

import math
import re
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


# ---- seeds -------------------------------------------------------------------------------------

MAX_SEED = 2**63 - 1  # a sampling seed: int64, what torch's generator and JSON's readers hold
MAX_RUN_SEED = 2**31 - 1  # a run's seed: runs.seed is a 32-bit column on PostgreSQL (and GraphQL's Int is 32-bit)


def check_seed(seed: Any, most: int) -> int:
    """A seed the caller gave: an integer in 0..`most` (MAX_SEED for sampling, MAX_RUN_SEED for a run)."""
    if not is_int(seed) or not 0 <= seed <= most:
        raise BadInput(f"seed must be an integer in 0..{most} or null, got {seed!r}", field="seed")
    return int(seed)


# ---- numbers (a bool is an int to Python, never to the contract) -------------------------------


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
