"""Strict reads of a Tinker JSON body's fields: booleans are booleans, integers are in range, objects are objects,
strings are strings. Each refusal is BAD_INPUT naming the field (the wire's 400 `{"detail", "category": "user"}`),
checked at submit, before anything proportional to the value is built or a future is made."""

from __future__ import annotations

from collections.abc import Mapping

from app.errors import BadInput
from app.tables import MAX_INTEGER


def integer(value: object, field: str, low: int = 0, high: int = MAX_INTEGER) -> int:
    """A JSON integer in low..high, checked before anything proportional to it is built."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadInput(f"{field} must be an integer in {low}..{high}, got {_shown(value)}", field=field)
    return value


def optional_integer(data: Mapping[str, object], name: str, default: int | None, low: int = 0, high: int = MAX_INTEGER,
                     field: str | None = None) -> int | None:
    value = data.get(name)
    return default if value is None else integer(value, field or name, low, high)


def boolean(data: Mapping[str, object], name: str, default: bool, field: str | None = None) -> bool:
    """true or false (null or absent: `default`); "no" is not false, and 1 is not true."""
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadInput(f"{field or name} must be true or false, got {_shown(value)}", field=field or name)
    return value


def number(data: Mapping[str, object], name: str, default: float, field: str | None = None) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadInput(f"{field or name} must be a number, got {_shown(value)}", field=field or name)
    return float(value)


def obj(data: Mapping[str, object], name: str, field: str | None = None) -> Mapping[str, object]:
    """A JSON object (null or absent: empty)."""
    value = data.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInput(f"{field or name} must be an object, got {_shown(value)}", field=field or name)
    return value


def string(data: Mapping[str, object], name: str, default: str | None = None, field: str | None = None) -> str | None:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise BadInput(f"{field or name} must be a string, got {_shown(value)}", field=field or name)
    return value


def token_ids(value: object, field: str) -> list[int]:
    """A list of token ids (non-negative integers within the database's range)."""
    if not isinstance(value, list):
        raise BadInput(f"{field} must be a list of token ids, got {_shown(value)}", field=field)
    return [integer(token, f"{field}[{i}]") for i, token in enumerate(value)]


def _shown(value: object) -> str:
    # A refusal quotes what was sent, cut short: a 6 MB string is not echoed back.
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
