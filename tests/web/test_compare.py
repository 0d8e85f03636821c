"""Compare (issue 18 §2): runs picked on the runs list are overlaid as one curve each, with a legend, and their
configurations are diffed; fewer than 2 or more than 8 runs is refused, and another user's run is a 404."""

from __future__ import annotations

import re
import uuid

import pytest
from playwright.sync_api import Page, expect

from app.services.dashboard import COMPARE_RUNS
from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, api_key_for, mint_login_link, sign_in

expect.set_options(timeout=30_000)

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]


def test_two_sdk_runs_are_two_curves_and_the_diff_shows_their_learning_rates(wide_page: Page,
                                                                              live_server: LiveServer) -> None:
    email = "compare@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    runs = []
    losses: dict[str, list[float]] = {}
    for name, rate, steps in (("slow", 0.001, 2), ("fast", 0.02, 3)):  # different lengths: the x axis is shared
        run = client.create_run(lora_r=4, seed=3, name=name, learning_rate=rate)
        losses[name] = []
        for _ in range(steps):
            losses[name].append(run.forward_backward(batch=BATCH)["loss"])
            run.optim_step()
        runs.append(run)

    wide_page.goto(mint_login_link(live_server, email))
    wide_page.wait_for_url("**/runs")
    for run in runs:
        wide_page.locator(f'tr[data-run-id="{run.id}"] input[name="ids"]').check()
    wide_page.get_by_role("button", name="Compare selected").click()
    wide_page.wait_for_url(re.compile(r"/runs/compare\?"))
    # The list is newest first, so the form sends fast then slow; the page keeps the URL's order throughout.
    assert wide_page.url.split("?")[1].split("&") == [f"ids={run.id}" for run in reversed(runs)]

    chart = wide_page.locator("#compare-chart")
    expect(chart).to_have_attribute("data-series", "2")
    # The legend names each run (after uPlot's x entry), and each curve holds that run's losses by step.
    expect(chart.locator(".u-legend .u-series")).to_have_count(3)
    expect(chart.locator(".u-legend .u-series .u-label")).to_have_text(["step", "fast", "slow"])
    curves = chart.evaluate("(el) => JSON.parse(el.dataset.curves)")
    assert [(c["name"], c["steps"]) for c in curves] == [("fast", [0, 1, 2]), ("slow", [0, 1])]
    for curve in curves:  # one forward_backward per step: the step's loss is that call's
        assert curve["losses"] == pytest.approx(losses[curve["name"]])

    rates = wide_page.locator("#compare-settings tr", has_text="Learning rates used")
    expect(rates.locator("td")).to_have_text(["0.02", "0.001"])
    expect(rates).to_have_class("differs")
    seeds = wide_page.locator("#compare-settings tr", has_text="Seed")
    expect(seeds.locator("td")).to_have_text(["3", "3"])
    expect(seeds).not_to_have_class("differs")


@pytest.fixture(scope="module")
def owner_runs(live_server: LiveServer) -> tuple[str, list[str]]:
    """An owner's runs, with no training: the count refusals need ids, not curves."""
    email = f"owner-{uuid.uuid4().hex[:6]}@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    return email, [client.create_run(lora_r=4).id for _ in range(COMPARE_RUNS[1] + 1)]


@pytest.mark.parametrize("count", [0, 1, COMPARE_RUNS[1] + 1])
def test_fewer_than_two_or_more_than_eight_runs_are_refused(live_server: LiveServer, owner_runs: tuple[str, list[str]],
                                                            count: int) -> None:
    email, ids = owner_runs
    owner = sign_in(live_server, email)
    answer = owner.client.get("/runs/compare", params={"ids": ",".join(ids[:count])})
    assert answer.status_code == 422
    assert f"pick 2 to 8 runs to compare, got {count}" in answer.text


def test_the_same_run_twice_is_one_run(live_server: LiveServer, owner_runs: tuple[str, list[str]]) -> None:
    email, ids = owner_runs
    answer = sign_in(live_server, email).client.get(f"/runs/compare?ids={ids[0]},{ids[0]}")
    assert answer.status_code == 422 and "got 1" in answer.text


def test_another_users_run_is_not_found(live_server: LiveServer, visitor: Visitor,
                                        owner_runs: tuple[str, list[str]]) -> None:
    mine = SignalClient(api_key=api_key_for(live_server, visitor.email), base_url=live_server.url).create_run(lora_r=4)
    answer = visitor.client.get(f"/runs/compare?ids={mine.id},{owner_runs[1][0]}")
    assert answer.status_code == 404 and f"run &#39;{owner_runs[1][0]}&#39; not found" in answer.text


def test_an_empty_runs_list_offers_no_compare_button(visitor: Visitor) -> None:
    runs = visitor.client.get("/runs")
    assert runs.status_code == 200 and "No runs yet" in runs.text and "Compare selected" not in runs.text
