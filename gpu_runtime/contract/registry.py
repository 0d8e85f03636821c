"""Which call type each method name is: the registry the runtime dispatches on, and `parse_call` for what arrives."""

from __future__ import annotations

from typing import Any

from gpu_runtime.contract.calls import Call, Method
from gpu_runtime.contract.control_calls import (
    Cancel,
    CloseRun,
    CreateRun,
    DeleteCheckpoint,
    DeleteRun,
    ExportCheckpoint,
    LoadRun,
    LoadState,
    Ping,
    RunInfo,
    RuntimeState,
    SaveState,
    SaveWeightsForSampler,
)
from gpu_runtime.contract.sampling_calls import RenderChat, Sample, Tokenizer
from gpu_runtime.contract.training_calls import Forward, ForwardBackward, OptimStep, RenderDatums
from gpu_runtime.errors import BadInput

CALLS: dict[Method, type[Call]] = {cls.method: cls for cls in (
    CreateRun, ForwardBackward, Forward, RenderDatums, OptimStep, Sample, SaveState, LoadRun, RunInfo, CloseRun,
    DeleteRun, ExportCheckpoint, LoadState, DeleteCheckpoint, SaveWeightsForSampler, Ping, RuntimeState, Tokenizer,
    RenderChat, Cancel)}
SYSTEM_CALLS = (Ping, RuntimeState, Tokenizer, RenderChat, Cancel)  # calls on no run: answered first, at the next tick


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
