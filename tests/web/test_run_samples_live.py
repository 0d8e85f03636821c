"""Bug 6 of issue 18: samples made through the SDK appear on an open run page without a reload, over the page's one
event stream, each once."""

from __future__ import annotations

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
