"""The runs list, live without disturbing the reader (issue 18, bug 2): while training changes a row's cells,
the same link node keeps keyboard focus and a selection in an unchanged cell stays; a new run is announced,
not inserted between the rows being read. Real server, real Chromium, training through the SDK."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.web.conftest import api_key_for, mint_login_link

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
expect.set_options(timeout=30_000)


@pytest.fixture
def page(wide_page: Page) -> Page:
    return wide_page


def test_training_changes_cells_in_place_and_keeps_focus_and_selection(page: Page, live_server: LiveServer) -> None:
    email = "runs-live@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    run = client.create_run(lora_r=4, learning_rate=0.05, seed=3)
    page.goto(mint_login_link(live_server, email))
    page.wait_for_url(f"{live_server.url}/runs")
    row = page.locator(f"tr[data-run-id='{run.id}']")
    expect(row.locator("[data-cell=step]")).to_have_text("0")
    expect(row.locator("[data-cell=loss]")).to_have_text("—")

    # The reader is on the run's link (keyboard) and has selected the base model's name.
    row.get_by_role("link").focus()
    page.evaluate("""(id) => {
        window.runLink = document.querySelector(`tr[data-run-id="${id}"] a`);
        const range = document.createRange();
        range.selectNodeContents(window.runLink.closest('tr').cells[2]);  // after the compare box and the run
        getSelection().removeAllRanges();
        getSelection().addRange(range);
    }""", run.id)
    for step in range(1, 4):
        run.forward_backward(batch=BATCH)
        run.optim_step()
        expect(row.locator("[data-cell=step]")).to_have_text(str(step))
    expect(row.locator("[data-cell=loss]")).to_have_text(re.compile(r"^\d+\.\d{4}$"))
    assert page.evaluate("document.activeElement === window.runLink && window.runLink.isConnected")
    assert page.evaluate("getSelection().toString()") == TINY_MODEL

    # A run made meanwhile is announced, not inserted; following the link shows it.
    client.create_run(lora_r=4)
    expect(page.locator("#runs-new")).to_have_text("1 new run: show it")
    expect(page.locator("#runs-table tbody tr")).to_have_count(1)
    assert page.evaluate("document.activeElement === window.runLink")
    page.locator("#runs-new a").click()
    expect(page.locator("#runs-table tbody tr")).to_have_count(2)
    expect(page.locator("#runs-new")).to_be_hidden()


def test_a_first_run_is_announced_on_the_empty_list(page: Page, live_server: LiveServer) -> None:
    email = "runs-first@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    page.goto(mint_login_link(live_server, email))
    page.wait_for_url(f"{live_server.url}/runs")
    expect(page.get_by_role("heading", name="No runs yet")).to_be_visible()
    client.create_run(lora_r=4)
    page.get_by_role("link", name="1 new run: show it").click()
    expect(page.locator("#runs-table tbody tr")).to_have_count(1)
