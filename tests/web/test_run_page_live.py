"""The run page's live view (issue 18): samples made through the SDK appear without a reload, over the page's one
event stream, each once (bug 6); the chart plots loss against call, step (the token-weighted mean of the step's
calls) or wall time, with smoothing, a log scale, and a CSV export of every metric row (§2)."""

from __future__ import annotations

import csv
import io
from collections import defaultdict

import pytest
from playwright.sync_api import Page, expect

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import api_key_for, mint_login_link

expect.set_options(timeout=30_000)


def test_sdk_samples_appear_on_the_open_run_page(wide_page: Page, live_server: LiveServer) -> None:
    email = "live-samples@example.com"
    run = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url).create_run(lora_r=4, seed=2)
    before = run.sample(prompts=["Before the page"], max_tokens=3, temperature=0.5)["outputs"][0]
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto("about:blank")  # the runs list's own stream ends here, so only the run page's requests count
    streams: list[str] = []
    wide_page.on("request", lambda request: streams.append(request.url) if "/events" in request.url else None)
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    expect(wide_page.locator("#live-state")).to_have_attribute("data-state", "live")
    items = wide_page.locator("#samples-list > li")
    expect(items).to_have_count(1)
    expect(items.first.locator(".sample-output")).to_have_text(before)

    after = run.sample(prompts=["While the page is open"], max_tokens=4, temperature=0.9)["outputs"][0]
    expect(items).to_have_count(2)  # the new one, once; the old one not sent again
    expect(items.first.locator(".sample-prompt")).to_have_text("While the page is open")
    expect(items.first.locator(".sample-output")).to_have_text(after)
    expect(items.first.locator(".sample-meta")).to_contain_text("temperature 0.9")
    assert [url.split("?")[0] for url in streams] == [f"{live_server.url}/runs/{run.id}/events"]  # one stream


def test_the_first_sample_replaces_the_empty_state(wide_page: Page, live_server: LiveServer) -> None:
    email = "first-sample@example.com"
    run = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url).create_run(lora_r=4)
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    expect(wide_page.locator("#live-state")).to_have_attribute("data-state", "live")
    expect(wide_page.locator("#samples-empty")).to_be_visible()
    run.sample(prompts=["First"], max_tokens=2)
    expect(wide_page.locator("#samples-list > li")).to_have_count(1)
    expect(wide_page.locator("#samples-empty")).to_have_count(0)


SHORT = [{"input": "The quick brown fox", "output": " jumps."}]
LONG = [{"input": "The quick brown fox", "output": " jumps over the lazy dog and runs far into the woods."},
        {"input": "Once upon a time", "output": " there was a tiny model that learned to count."}]


def chart(page: Page) -> tuple[int, float]:
    shown, last = page.locator("#loss-chart").evaluate("(el) => [el.dataset.shown, el.dataset.last]")
    return int(shown), float(last)


def test_loss_against_call_step_and_time_smoothed_logged_and_exported(wide_page: Page, live_server: LiveServer) -> None:
    email = "chart@example.com"
    run = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url).create_run(
        lora_r=4, seed=6, learning_rate=0.01)
    for _ in range(2):  # two steps of two calls each, of different sizes: the step's loss weighs them by tokens
        run.forward_backward(batch=SHORT)
        run.forward_backward(batch=LONG)
        run.optim_step()
    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    wide_page.goto(f"{live_server.url}/runs/{run.id}")
    wide_page.wait_for_function("document.getElementById('loss-chart').dataset.points == 4")

    exported = wide_page.request.get(f"{live_server.url}/runs/{run.id}/metrics.csv")
    assert exported.status == 200 and exported.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(exported.text())))
    assert [r["name"] for r in rows].count("loss:mean") == 4 and [r["name"] for r in rows].count("grad_norm") == 2
    losses = [float(r["value"]) for r in rows if r["name"] == "loss:mean"]
    tokens = [float(r["value"]) for r in rows if r["name"] == "num_tokens"]
    steps = [int(r["step"]) for r in rows if r["name"] == "loss:mean"]
    assert tokens[0] != tokens[1]  # the weighting below is not a plain mean

    assert chart(wide_page) == pytest.approx((4, losses[-1]))
    wide_page.select_option("#chart-x", "step")
    by_step: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for step, loss, weight in zip(steps, losses, tokens):
        by_step[step][0] += loss * weight
        by_step[step][1] += weight
    last_step = max(by_step)
    assert chart(wide_page) == pytest.approx((2, by_step[last_step][0] / by_step[last_step][1]))
    expect(wide_page.locator("#chart-note")).to_contain_text("token-weighted mean")

    wide_page.select_option("#chart-x", "time")
    assert chart(wide_page)[0] == 4
    wide_page.select_option("#chart-x", "call")
    wide_page.locator("#chart-smooth").fill("0.5")  # a debiased moving average of the calls' losses
    average = 0.0
    for loss in losses:
        average = 0.5 * average + 0.5 * loss
    assert chart(wide_page) == pytest.approx((4, average / (1 - 0.5 ** len(losses))))
    wide_page.locator("#chart-log").check()
    expect(wide_page.locator("#loss-chart canvas")).to_have_count(1)  # redrawn once, on a log scale
    assert wide_page.locator("#loss-chart").evaluate("(el) => el.querySelectorAll('.u-legend .u-series').length") == 3
