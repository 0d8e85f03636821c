"""Which call type each method name is: `CALLS` (each type registers itself as it is defined: importing the three
families here fills it) and `parse_call` for what arrives."""

from __future__ import annotations

from typing import Any

from gpu_runtime.contract import control_calls, sampling_calls, training_calls
from gpu_runtime.contract.calls import CALLS, Call, Lane, Method
from gpu_runtime.errors import BadInput

FAMILIES = (control_calls, sampling_calls, training_calls)  # where the calls are defined (and so registered)
SYSTEM_CALLS = tuple(kind for kind in CALLS.values() if kind.kind.lane is Lane.SYSTEM)


def parse_call(method: Any, params: Any) -> Call:
    """The typed, validated request for a method name and its arguments (what crosses the wire)."""
    try:
        kind = CALLS[Method(method)]
    except (ValueError, KeyError):
        raise BadInput(f"unknown method {method!r}; the runtime answers {[m.value for m in Method]}",
                       field="method") from None
    call = kind.from_dict(params)
    call.validate()
    return call
