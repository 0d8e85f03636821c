"""Errors name their field in the API's spelling and quote at most a short prefix of the input."""

from __future__ import annotations

import httpx
import pytest

from gpu_runtime.errors import MAX_MESSAGE_CHARS
from tests.helpers.live_server import LiveServer

CREATE = "mutation($m: String) { createRun(input: {baseModel: $m, loraR: 2}) { id } }"


def create_run(server: LiveServer, key: str, base_model: str) -> dict[str, object]:
    response = httpx.post(f"{server.url}/graphql", json={"query": CREATE, "variables": {"m": base_model}},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    (error,) = response.json()["errors"]
    return dict(error)


@pytest.mark.parametrize("base_model", ["", "   "], ids=["empty", "blank"])
def test_an_empty_base_model_is_refused_not_the_default(live_server: LiveServer, key: str, base_model: str) -> None:
    error = create_run(live_server, key, base_model)
    assert error["extensions"] == {"code": "BAD_INPUT", "field": "baseModel", "retryable": False}


def test_a_huge_input_is_quoted_by_a_prefix(live_server: LiveServer, key: str) -> None:
    error = create_run(live_server, key, "m" * 1_000_000)
    assert error["extensions"] == {"code": "BAD_INPUT", "field": "baseModel", "retryable": False}
    message = str(error["message"])
    assert len(message) < MAX_MESSAGE_CHARS + 60
    assert message.startswith("unknown base model 'mmm") and message.endswith("(add yours to config/models.yaml)")
