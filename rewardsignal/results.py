"""Results: dicts with snake_case keys that also allow attribute access (`r["loss"]` and `r.loss`)."""

from __future__ import annotations

import re
from typing import Any

_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")
# JSON scalars pass through untouched: their keys are the user's or the engine's, not GraphQL fields.
_OPAQUE = {"optimizer", "params"}
# GraphQL Int is 32-bit, so counts travel as Float; hand users the ints they are.
_INTEGRAL = {"trainable_params", "total_params", "size_bytes", "parameters"}


class Result(dict[str, Any]):
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def snake(name: str) -> str:
    return _CAMEL.sub(r"_\1", name).lower()


def convert(value: Any) -> Any:
    if isinstance(value, list):
        return [convert(item) for item in value]
    if isinstance(value, dict):
        out = Result()
        for key, item in value.items():
            name = snake(key)
            if name in _OPAQUE:
                out[name] = item
            elif name in _INTEGRAL and isinstance(item, float):
                out[name] = int(item)
            else:
                out[name] = convert(item)
        return out
    return value
