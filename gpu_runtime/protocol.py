"""The worker's wire format: one JSON object per line, each way.

request  {"id": 7, "method": "forward_backward", "params": {...}}
response {"id": 7, "result": {...}}  or  {"id": 7, "error": SignalError.to_dict()}
first line from the worker: {"ready": true, "pid": 123}  (or {"ready": false, "error": {...}})
No torch here: the server imports this module.
"""

from __future__ import annotations

import json
from typing import Any


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), allow_nan=True).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a protocol message must be a JSON object")
    return message
