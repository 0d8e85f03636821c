"""Each call's kind is a class attribute of its contract type (its lane, whether it writes, whether its run must be
resident, whether it is a user's primitive), and the engine answers every call: adding one is its contract type
plus its handler."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpu_runtime.contract import CALLS, SYSTEM_CALLS, Call, ForwardBackward, Kind, Lane, Method, Sample
from gpu_runtime.engine.engine import Engine

TICK_PASSES = {ForwardBackward, Sample}  # answered by the tick's passes, not by a handler


@pytest.mark.parametrize("method", list(Method))
def test_every_method_has_a_contract_type_with_its_kind_set(method: Method) -> None:
    call = CALLS[method]
    assert call.method is method
    assert isinstance(call.__dict__.get("kind"), Kind), f"{call.__name__} sets no kind of its own"
    kind = call.kind
    assert isinstance(kind.lane, Lane)
    run_field = "run_id" in {f.name for f in dataclasses.fields(call)}
    assert run_field or not kind.on_run, f"{call.__name__} needs a resident run but names none"
    assert kind.lane is not Lane.SYSTEM or not (kind.writes or kind.primitive)  # the runtime's own calls change nothing
    # Only a call that may read frozen weights says when it does (then it is off its run's queue).
    assert (call.frozen is not Call.frozen) == (kind.lane is Lane.FREE)


def test_system_calls_are_read_from_the_kinds() -> None:
    assert {call.method for call in SYSTEM_CALLS} == {Method.PING, Method.RUNTIME_STATE, Method.TOKENIZER,
                                                        Method.RENDER_CHAT, Method.CANCEL}


def test_the_engine_answers_every_call(tmp_path: Path) -> None:
    engine = Engine(tmp_path, device="cpu")
    assert engine.handlers.kinds | TICK_PASSES == set(CALLS.values())
    assert not engine.handlers.kinds & TICK_PASSES
    assert engine.ping()["contract"] == engine.control.ping().contract  # a handler's typed result, as the wire has it
