"""Bug 10 of issue 18: the playground's bounds are the engine contract's and this server's per-call ones, so the page
and the server agree; what the page would stop, the server refuses too (a posted temperature of 100 is never sampled
nor stored), and every message names a field as the contract does (`max_tokens`, `top_p`)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Browser

from gpu_runtime.contract.sampling_settings import MAX_SAMPLES, MAX_TEMPERATURE, MAX_TOKENS_LIMIT, MAX_TOP_P
from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, api_key_for, mint_login_link
from web.playground import DEFAULT_MAX_TOKENS

FORM = {"prompt": "Hello", "temperature": "0.7", "max_tokens": "4", "num_samples": "1"}


@pytest.fixture
def run_id(live_server: LiveServer, visitor: Visitor) -> str:
    return SignalClient(api_key=api_key_for(live_server, visitor.email), base_url=live_server.url).create_run(lora_r=4).id


def test_the_page_offers_the_contracts_bounds(visitor: Visitor, run_id: str, live_server: LiveServer) -> None:
    html = visitor.client.get(f"/playground?run={run_id}").text
    bounds = {name: float(value) for name, value in re.findall(r'name="(\w+)" type="number"[^>]* max="([^"]+)"', html)}
    budget = live_server.settings.max_sample_tokens
    assert bounds == {"temperature": MAX_TEMPERATURE, "top_p": MAX_TOP_P, "max_tokens": min(MAX_TOKENS_LIMIT, budget),
                      "num_samples": min(MAX_SAMPLES, budget // DEFAULT_MAX_TOKENS)}  # n's bound at the form's tokens
    assert f'data-sample-tokens="{budget}"' in html


@pytest.mark.parametrize(("changes", "message"), [
    ({"temperature": "100"}, f"temperature must be a number in [0, {MAX_TEMPERATURE}], got 100.0"),
    ({"max_tokens": str(MAX_TOKENS_LIMIT + 1)}, f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}"),
    ({"max_tokens": "many"}, "max_tokens must be a number, got 'many'"),
    ({"num_samples": str(MAX_SAMPLES + 1)}, f"num_samples must be an integer in 1..{MAX_SAMPLES}"),
    ({"top_p": "1.5"}, "top_p must be a number in (0, 1], got 1.5"),
    ({"top_p": "0"}, "top_p must be a number in (0, 1], got 0.0"),
    ({"num_samples": str(MAX_SAMPLES), "max_tokens": str(MAX_TOKENS_LIMIT)},
     f"{MAX_SAMPLES} sequences x max_tokens {MAX_TOKENS_LIMIT} = {MAX_SAMPLES * MAX_TOKENS_LIMIT} tokens"),
], ids=["temperature", "max_tokens", "not-a-number", "num_samples", "top_p-high", "top_p-zero", "n-x-max_tokens"])
def test_the_server_refuses_what_the_page_would_stop(visitor: Visitor, run_id: str, changes: dict[str, str],
                                                     message: str) -> None:
    answer = visitor.post("/playground", data=FORM | {"run_id": run_id} | changes)
    assert answer.status_code == 422 and message in answer.text, answer.text  # BAD_INPUT, as the API answers it
    assert "No samples yet" in visitor.client.get(f"/runs/{run_id}").text  # nothing sampled, nothing stored


def test_the_pages_max_tokens_bound_is_the_servers(browser: Browser, live_server: LiveServer, visitor: Visitor,
                                                   run_id: str) -> None:
    """With n = 16 the page's max tokens is this server's per-call bound over n: one token past it is refused by
    the page and by the server (naming max_tokens), the bound itself is accepted by both."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(mint_login_link(live_server, visitor.email))
    page.wait_for_url("**/runs")
    page.goto(f"{live_server.url}/playground?run={run_id}")
    page.fill("#num_samples", str(MAX_SAMPLES))
    bound = int(page.get_attribute("#max_tokens", "max") or 0)
    assert bound == min(MAX_TOKENS_LIMIT, live_server.settings.max_sample_tokens // MAX_SAMPLES)
    overflows = "(n) => { const el = document.getElementById('max_tokens'); el.value = n; return el.validity.rangeOverflow; }"
    assert page.evaluate(overflows, bound + 1) and not page.evaluate(overflows, bound)
    context.close()
    form = FORM | {"model": f"run:{run_id}", "num_samples": str(MAX_SAMPLES)}
    refused = visitor.post("/playground/stream", data=form | {"max_tokens": str(bound + 1)})
    assert refused.status_code == 422 and "max_tokens" in refused.text, refused.text
    accepted = visitor.post("/playground/stream", data=form | {"max_tokens": str(bound)})  # stored, never opened
    assert accepted.status_code == 200 and "data-stream=" in accepted.text, accepted.text
