"""The run page's chart (issue 18 §2): loss against call, step (the token-weighted mean of the step's calls) or wall
time, smoothing, a log scale, and a CSV export of every metric row."""

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
