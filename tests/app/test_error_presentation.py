"""How errors reach GraphQL clients: typed errors keep message and code, everything else is masked.

Each test builds a small schema inline (as strawberry's own tests do) with Signal's error extension.
"""

from __future__ import annotations

import logging

import pytest
import strawberry

from app.errors import BadInput, InternalError, RunNotFound, WorkerFailed
from app.schema.errors import INTERNAL_MESSAGE, SignalErrors

RAISED: dict[str, Exception] = {}


@strawberry.type
class Query:
    @strawberry.field
    def fails(self, kind: str) -> int:
        raise RAISED[kind]

    @strawberry.field
    def not_a_number(self) -> float:
        return float("nan")


SCHEMA = strawberry.Schema(query=Query, extensions=[SignalErrors])


@pytest.mark.parametrize(
    ("error", "code", "field"),
    [(BadInput("loraR must be between 1 and 512", field="loraR"), "BAD_INPUT", "loraR"),
     (RunNotFound("run 'x' not found", field="runId"), "NOT_FOUND", "runId"),
     (WorkerFailed("worker process exited with code -9"), "WORKER_FAILED", None)],
)
async def test_typed_errors_keep_message_and_code(error: Exception, code: str, field: str | None) -> None:
    RAISED["it"] = error
    result = await SCHEMA.execute('{ fails(kind: "it") }')
    assert result.data is None
    [formatted] = [e.formatted for e in result.errors or []]
    assert formatted["message"] == str(error)
    assert formatted["extensions"]["code"] == code
    assert formatted["extensions"].get("field") == field


@pytest.mark.parametrize("error", [RuntimeError("password=hunter2 in /srv/secret"),
                                   InternalError("KeyError: '/data/runs/u1/r1/optimizer_state.pt'")])
async def test_internal_errors_are_masked_and_logged(error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    RAISED["it"] = error
    with caplog.at_level(logging.ERROR, logger="signal.graphql"):
        result = await SCHEMA.execute('{ fails(kind: "it") }')
    [formatted] = [e.formatted for e in result.errors or []]
    assert formatted["message"] == INTERNAL_MESSAGE
    assert formatted["extensions"] == {"code": "INTERNAL", "retryable": False}
    assert str(error) not in str(formatted)
    assert any(record.exc_info and record.exc_info[1] is error for record in caplog.records)


async def test_validation_errors_say_where() -> None:
    result = await SCHEMA.execute("{ nope }")
    [formatted] = [e.formatted for e in result.errors or []]
    assert formatted["extensions"]["code"] == "GRAPHQL_VALIDATION_FAILED"
    assert "nope" in formatted["message"]


async def test_output_we_cannot_serialise_is_ours_not_the_clients() -> None:
    result = await SCHEMA.execute("{ notANumber }")
    [formatted] = [e.formatted for e in result.errors or []]
    assert formatted["extensions"] == {"code": "INTERNAL", "retryable": False} and formatted["message"] == INTERNAL_MESSAGE
