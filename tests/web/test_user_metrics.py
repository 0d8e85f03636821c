"""A run's user-reported metrics (logMetrics, `run.log_metrics`): the numbers a training loop computes itself (a DPO
loss, a reward), stored with the run's metrics as `user:<name>` at a step, and drawn on the run's page as charts of
their own, live. Bad input is BAD_INPUT naming the field; another user's run is not found."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from rewardsignal import BadInputError, NotFoundError, SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import api_key_for, mint_login_link

BATCH = [{"text": "The quick brown fox jumps over the lazy dog."}]


def test_logged_metrics_are_stored_at_their_step_and_read_back_by_name(live_server: LiveServer) -> None:
    client = SignalClient(api_key=api_key_for(live_server, "metrics@example.com"), base_url=live_server.url)
    run = client.create_run(lora_r=4)
    assert run.log_metrics({"reward": 0.25, "dpo_margin": -1.5}) == 0  # the run's current step
    run.forward_backward(batch=BATCH)
    run.optim_step()
    assert run.log_metrics({"reward": 0.75}) == 1
    assert run.log_metrics({"reward": 1}, step=7) == 7
    assert [(r["step"], r["value"]) for r in run.metrics(name="user:reward")] == [(0, 0.25), (1, 0.75), (7, 1.0)]
    assert [(r["step"], r["value"]) for r in run.metrics(name="user:dpo_margin")] == [(0, -1.5)]
    assert "user:reward" not in {r["name"] for r in run.metrics(name="loss:mean")}  # apart from the runtime's


@pytest.mark.parametrize(("metrics", "step", "field"), [
    ({}, None, "metrics"),
    ({"has space": 1.0}, None, "metrics.has space"),
    ({"reward": "high"}, None, "metrics.reward"),
    ({"reward": True}, None, "metrics.reward"),
    ({"reward": 1.0}, -1, "step"),
    ({f"m{i}": 1.0 for i in range(33)}, None, "metrics"),
])
def test_bad_metrics_are_bad_input_naming_the_field(live_server: LiveServer, metrics: dict, step: int | None,
                                                    field: str) -> None:
    client = SignalClient(api_key=api_key_for(live_server, "bad-metrics@example.com"), base_url=live_server.url)
    run = client.create_run(lora_r=4)
    with pytest.raises(BadInputError) as raised:
        run.log_metrics(metrics, step=step)
    assert raised.value.field == field


def test_another_users_run_is_not_found(live_server: LiveServer) -> None:
    owner = SignalClient(api_key=api_key_for(live_server, "owner-m@example.com"), base_url=live_server.url)
    other = SignalClient(api_key=api_key_for(live_server, "other-m@example.com"), base_url=live_server.url)
    run_id = owner.create_run(lora_r=4).id
    with pytest.raises(NotFoundError):
        other.get_run(run_id).log_metrics({"reward": 1.0})


def test_the_run_page_draws_each_logged_metric_live(live_server: LiveServer, wide_page: Page) -> None:
    email = "draws-metrics@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    run = client.create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    run.log_metrics({"dpo_loss": 0.69})  # before the page opens: it comes with the stream's first rows
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    loss = wide_page.locator('[data-metric="user:dpo_loss"]')
    expect(loss.locator("h2")).to_have_text("dpo_loss")
    expect(loss.locator(".chart")).to_have_attribute("data-shown", "1")
    run.optim_step()
    run.log_metrics({"dpo_loss": 0.41, "dpo_margin": 2.5})  # while it is open: drawn live
    expect(loss.locator(".chart")).to_have_attribute("data-shown", "2")
    expect(loss.locator(".chart")).to_have_attribute("data-last", "0.41")
    margin = wide_page.locator('[data-metric="user:dpo_margin"] .chart')
    expect(margin).to_have_attribute("data-last", "2.5")
    expect(margin.locator("canvas")).to_have_count(1)
