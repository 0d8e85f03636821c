"""Bug 10 of issue 18: the playground's bounds are the engine contract's, so the page and the server agree; what the
page would stop, the server refuses too (a posted temperature of 100 is never sampled nor stored), and every message
names a field as the contract does (`max_tokens`)."""

from __future__ import annotations

import re

import pytest

from gpu_runtime.contract.settings import MAX_SAMPLES, MAX_TEMPERATURE, MAX_TOKENS_LIMIT
from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, api_key_for


@pytest.fixture
def run_id(live_server: LiveServer, visitor: Visitor) -> str:
    return SignalClient(api_key=api_key_for(live_server, visitor.email), base_url=live_server.url).create_run(lora_r=4).id


def test_the_page_offers_the_contracts_bounds(visitor: Visitor, run_id: str) -> None:
    html = visitor.client.get(f"/playground?run={run_id}").text
    bounds = {name: float(value) for name, value in re.findall(r'name="(\w+)" type="number"[^>]* max="([^"]+)"', html)}
    assert bounds == {"temperature": MAX_TEMPERATURE, "max_tokens": MAX_TOKENS_LIMIT, "num_samples": MAX_SAMPLES}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", "100", f"temperature must be a number in [0, {MAX_TEMPERATURE}], got 100.0"),
    ("max_tokens", str(MAX_TOKENS_LIMIT + 1), f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}"),
    ("max_tokens", "many", "max_tokens must be a number, got 'many'"),
    ("num_samples", str(MAX_SAMPLES + 1), f"num_samples must be an integer in 1..{MAX_SAMPLES}"),
])
def test_the_server_refuses_what_the_page_would_stop(visitor: Visitor, run_id: str, field: str, value: str,
                                                     message: str) -> None:
    form = {"run_id": run_id, "prompt": "Hello", "temperature": "0.7", "max_tokens": "4", "num_samples": "1"}
    answer = visitor.post("/playground", data=form | {field: value})
    assert answer.status_code == 422 and message in answer.text, answer.text  # BAD_INPUT, as the API answers it
    assert "No samples yet" in visitor.client.get(f"/runs/{run_id}").text  # nothing sampled, nothing stored
