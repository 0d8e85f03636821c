"""JSON as the edges hold it: `JSON`, the one recursive type of what is written, and the readers that narrow what was
read (a `Mapping[str, object]` from json.loads or a `.remote()` payload) to the type a field holds.

A reader raises `BadInput` naming the field when the value is not of its type: the caller's mistake, or a file
written by no version of Signal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TypeAlias, TypeVar, cast

from gpu_runtime.errors import BadInput

# Sequence and Mapping (not list and dict): covariant, so a list[int] or a dict[str, float] is JSON as it stands.
JSON: TypeAlias = None | bool | int | float | str | Sequence["JSON"] | Mapping[str, "JSON"]
JSONObject: TypeAlias = dict[str, JSON]  # a JSON object as built to be written: a dict, so its keys can be added

# json.dumps given any option builds a JSONEncoder per call, a third of a small record's cost: these are built once
# (an encoder keeps no state between calls, so threads share them). COMPACT writes journal records and wire messages;
# CANONICAL (keys sorted) the texts that are hashed or compared: a call's body, manifest lines.
COMPACT = json.JSONEncoder(separators=(",", ":"))
CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))

T = TypeVar("T")
_MISSING = object()


def _typed(value: object, kind: type[T] | tuple[type, ...], field: str, what: str) -> T:
    # A bool is an int to Python, never to JSON's readers here.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadInput(f"{field} must be {what}, got {value!r}", field=field)
    if not isinstance(value, kind):
        raise BadInput(f"{field} must be {what}, got {value!r}", field=field)
    return value  # type: ignore[return-value]  # isinstance against `kind` is what T means


def _get(data: Mapping[str, object], key: str, default: object) -> object:
    value = data.get(key, default)
    if value is _MISSING:
        raise BadInput(f"{key} is missing", field=key)
    return value


def get_str(data: Mapping[str, object], key: str) -> str:
    return _typed(_get(data, key, _MISSING), str, key, "a string")


def get_int(data: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = _get(data, key, _MISSING if default is None else default)
    return _typed(value, int, key, "an integer")


def get_float(data: Mapping[str, object], key: str) -> float:
    # An int stays an int (a float to the type checker): what was read is written back as it was.
    value: float = _typed(_get(data, key, _MISSING), (int, float), key, "a number")
    return value


def get_bool(data: Mapping[str, object], key: str, default: bool | None = None) -> bool:
    return _typed(_get(data, key, _MISSING if default is None else default), bool, key, "true or false")


def opt_str(data: Mapping[str, object], key: str, default: str | None = None) -> str | None:
    value = data.get(key, default)
    return None if value is None else _typed(value, str, key, "a string or null")


def opt_int(data: Mapping[str, object], key: str) -> int | None:
    value = data.get(key)
    return None if value is None else _typed(value, int, key, "an integer or null")


def get_list(data: Mapping[str, object], key: str) -> list[object]:
    value: list[object] = _typed(_get(data, key, _MISSING), list, key, "a list")
    return value


def as_object(value: object, field: str) -> Mapping[str, object]:
    """A JSON object as read; its keys are strings (json.loads makes no others)."""
    mapping: Mapping[str, object] = _typed(value, Mapping, field, "an object")
    return mapping


def get_object(data: Mapping[str, object], key: str) -> Mapping[str, object]:
    return as_object(_get(data, key, _MISSING), key)


def opt_object(data: Mapping[str, object], key: str) -> Mapping[str, object]:
    """An object that may be absent or null: {} then."""
    value = data.get(key)
    return {} if value is None else as_object(value, key)


def get_numbers(data: Mapping[str, object], key: str) -> dict[str, float]:
    """An object of numbers (AdamW's settings, a loss's config); absent or null: {}."""
    return {name: _typed(v, (int, float), f"{key}.{name}", "a number") for name, v in opt_object(data, key).items()}


def as_json(value: object) -> JSON:
    """What json.loads gave, typed as the JSON it is (a value built by our own code is JSON by its type)."""
    return cast(JSON, value)  # json.loads makes nothing but JSON


def typed_json(value: Mapping[str, object]) -> JSONObject:
    """A TypedDict whose fields are all JSON, as the JSON object it is: mypy sees a TypedDict only as a
    Mapping[str, object], never as a dict[str, JSON], however JSON its fields' types."""
    return cast(JSONObject, value)


def as_json_object(value: object, field: str) -> JSONObject:
    """A JSON object as read, kept whole to be written again (a result remembered for retries)."""
    if not isinstance(value, dict):
        raise BadInput(f"{field} must be an object, got {value!r}", field=field)
    return cast(JSONObject, value)  # json.loads makes nothing but JSON, and only str keys
