"""The runs list, live without disturbing the reader (issue 18, bug 2): while training changes a row's cells,
the same link node keeps keyboard focus and a selection in an unchanged cell stays; a new run is announced,
not inserted between the rows being read. Pages of 50 (issue 18 §1) keep the search and order, share no run, and a
later page's stream follows its own runs and announces none. Real server, real Chromium, runs made through the SDK."""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import unescape
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import Page, expect

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.web.conftest import Visitor, api_key_for, mint_login_link, sign_in

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
PAGE = 50  # runs on a page of the list
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


def test_a_first_run_is_announced_on_the_empty_list_and_its_row_opens_it(page: Page, live_server: LiveServer) -> None:
    email = "runs-first@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    page.goto(mint_login_link(live_server, email))
    page.wait_for_url(f"{live_server.url}/runs")
    expect(page.get_by_role("heading", name="No runs yet")).to_be_visible()
    run = client.create_run(lora_r=4)
    page.get_by_role("link", name="1 new run: show it").click()
    row = page.locator("#runs-table tbody tr")
    expect(row).to_have_count(1)

    # Clickable rows (issue 18 §1): the compare box only ticks; anywhere else on the row (here the Loss cell) opens it.
    box = row.get_by_role("checkbox")
    box.click()
    expect(box).to_be_checked()
    assert page.url == f"{live_server.url}/runs"
    assert page.evaluate("getComputedStyle(document.querySelector('#runs-table tbody tr')).cursor") == "pointer"
    # Dragging across the base model's name selects it and opens nothing.
    base = row.locator("td.run-base").bounding_box()
    assert base is not None
    page.mouse.move(base["x"] + 2, base["y"] + base["height"] / 2)
    page.mouse.down()
    page.mouse.move(base["x"] + base["width"] - 2, base["y"] + base["height"] / 2, steps=5)
    page.mouse.up()
    assert page.evaluate("getSelection().toString()") != "" and page.url == f"{live_server.url}/runs"
    row.locator("[data-cell=loss]").click()
    page.wait_for_url(f"{live_server.url}/runs/{run.id}")


@dataclass
class Listed:
    """A page of the runs list as served: its rows' ids and names in order, its range line, links and stream."""

    html: str
    ids: list[str]
    names: list[str]
    range: str | None
    prev: str | None
    next: str | None
    stream: dict[str, list[str]]


def listed(visitor: Visitor, url: str) -> Listed:
    html = visitor.client.get(url).text
    links = {rel: unescape(href) for rel, href in re.findall(r'<a class="btn" rel="(prev|next)" href="([^"]+)"', html)}
    shown = re.search(r'id="runs-range">([^<]*)<', html)
    stream = re.search(r'sse-connect="([^"]+)"', html)
    assert stream, "the list opens its one stream"
    return Listed(html, re.findall(r'<tr data-run-id="([^"]+)"', html),
                  re.findall(r'<span data-cell="name">([^<]*)</span>', html), shown.group(1) if shown else None,
                  links.get("prev"), links.get("next"), parse_qs(urlsplit(unescape(stream.group(1))).query))


def query(url: str | None) -> dict[str, list[str]]:
    assert url is not None
    return parse_qs(urlsplit(url).query)


def test_pages_of_fifty_keep_the_search_and_order_and_share_no_run(live_server: LiveServer) -> None:
    visitor = sign_in(live_server, "runs-pages@example.com")
    client = SignalClient(api_key=api_key_for(live_server, visitor.email), base_url=live_server.url)
    made = [client.create_run(lora_r=4, name=f"{'alpha' if i < 55 else 'beta'} {i:02d}").id for i in range(62)]
    newest = made[::-1]

    first = listed(visitor, "/runs")
    assert (first.ids, first.range, first.prev, first.next) == (newest[:PAGE], "Showing 1–50 of 62", None,
                                                                "/runs?page=2")
    second = listed(visitor, "/runs?page=2")
    assert (second.ids, second.range, second.prev, second.next) == (newest[PAGE:], "Showing 51–62 of 62", "/runs",
                                                                    None)
    # The second page's stream follows exactly its own runs, and knows it is not the first page.
    assert second.stream == {"page": ["2"], "ids": [",".join(newest[PAGE:])]}

    # Searched and sorted by name: the next page keeps both, and goes on where the first stopped.
    alpha = [f"alpha {i:02d}" for i in range(55)]
    first = listed(visitor, "/runs?q=alpha&sort=name&show=")
    assert (first.names, first.range) == (alpha[:PAGE], "Showing 1–50 of 55")
    assert query(first.next) == {"q": ["alpha"], "sort": ["name"], "page": ["2"]}
    assert str(first.next).startswith("/runs?")
    second = listed(visitor, str(first.next))
    assert (second.names, second.range, second.next) == (alpha[PAGE:], "Showing 51–55 of 55", None)
    assert 'value="alpha" aria-label="Search runs"' in second.html and '<option value="name" selected>' in second.html
    assert query(second.prev) == {"q": ["alpha"], "sort": ["name"]}
    assert not set(first.ids) & set(second.ids) and len(first.ids + second.ids) == 55

    # A page past the last is the last; a page that is not a number is the first.
    assert listed(visitor, "/runs?page=99").ids == newest[PAGE:]
    assert listed(visitor, "/runs?page=two").ids == newest[:PAGE]


def test_a_later_page_follows_its_own_runs_and_announces_none(page: Page, live_server: LiveServer) -> None:
    email = "runs-later-page@example.com"
    client = SignalClient(api_key=api_key_for(live_server, email), base_url=live_server.url)
    runs = [client.create_run(lora_r=4) for _ in range(PAGE + 1)]
    page.goto(mint_login_link(live_server, email))
    page.wait_for_url(f"{live_server.url}/runs")
    rows = page.locator("#runs-table tbody tr")
    expect(rows).to_have_count(PAGE)
    # At 1280 px the table fits its card and each default name ("tiny-llama 2026-12-05 02:14") is on one line.
    assert page.evaluate("""() => {
        const scroll = document.querySelector('#runs-table .table-scroll');
        return scroll.scrollWidth <= scroll.clientWidth
            && [...scroll.querySelectorAll('[data-cell=name]')].every(name => name.getClientRects().length === 1);
    }""")

    # Recently active first: the run on page 2 is the one made first, and training it will move it to page 1's top.
    page.goto(f"{live_server.url}/runs?sort=activity")
    page.get_by_role("link", name="Next").click()
    page.wait_for_url(f"{live_server.url}/runs?sort=activity&page=2")
    expect(rows).to_have_count(1)
    expect(page.locator("#runs-range")).to_have_text("Showing 51–51 of 51")
    oldest = page.locator(f"tr[data-run-id='{runs[0].id}']")
    expect(oldest.locator("[data-cell=step]")).to_have_text("0")
    # Training moves that run to the top of page 1, and a new run comes in: page 2 still follows the run it shows,
    # and says nothing of the new one (the first page's news). The step arrives after the run was made.
    client.create_run(lora_r=4)
    runs[0].forward_backward(batch=BATCH)
    runs[0].optim_step()
    expect(oldest.locator("[data-cell=step]")).to_have_text("1")
    expect(page.locator("#runs-new")).to_be_hidden()
    expect(rows).to_have_count(1)
