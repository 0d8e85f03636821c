"""Phones (issue 18 §9, bug 3): every page at 390×844 fits without sideways scroll, its navigation collapses behind a
menu button, and every control lies on screen or inside a card that scrolls sideways. The visits run under the
pages' own CSP, and fail on anything it refused. /graphql shows a notice there instead of GraphiQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, BrowserContext, expect

from tests.helpers.live_server import LiveServer
from tests.web.conftest import shot
from tests.web.tour import PAGES, PHONE, SIGNED_OUT, STATUS, Tour, finish, make_tour, play_side_by_side, stage

# What the phone rule reads, in the page: the document's width, whether html or body hide their sideways overflow
# (that hides the problem, it does not fix it), and every control that is neither on screen nor inside an element
# that scrolls sideways (itself on screen).
MEASURE = """() => {
  const width = window.innerWidth, doc = document.documentElement;
  const onScreen = (rect) => rect.left >= -0.5 && rect.right <= width + 0.5;
  const clipped = [doc, document.body].filter((el) => ["hidden", "clip"].includes(getComputedStyle(el).overflowX))
    .map((el) => el.tagName.toLowerCase());
  const off = [];
  for (const el of document.querySelectorAll("a[href], button, input, select, textarea, summary")) {
    const rect = el.getBoundingClientRect();
    if ((!rect.width && !rect.height) || onScreen(rect)) continue;
    let scroller = el.parentElement;
    while (scroller && scroller !== document.body && !["auto", "scroll"].includes(getComputedStyle(scroller).overflowX)) {
      scroller = scroller.parentElement;
    }
    if (scroller && scroller !== document.body && onScreen(scroller.getBoundingClientRect())) continue;
    const label = (el.textContent || el.name || "").trim().slice(0, 30);
    off.push(`${el.tagName.toLowerCase()} "${label}" ${Math.round(rect.left)}..${Math.round(rect.right)}`);
  }
  return {scrollWidth: doc.scrollWidth, clipped, off};
}"""


@pytest.fixture(scope="module")
def tour(live_server: LiveServer) -> Tour:
    return make_tour(live_server)


@pytest.fixture(scope="module")
def phone(browser: Browser, tour: Tour) -> Iterator[BrowserContext]:
    context = tour.context(browser, PHONE)
    yield context
    context.close()


@pytest.mark.parametrize("name", PAGES)
def test_every_page_fits_a_phone(name: str, tour: Tour, phone: BrowserContext, browser: Browser) -> None:
    context = tour.context(browser, PHONE, signed_in=False) if name in SIGNED_OUT else phone
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # Without bypass_csp (unlike test_accessibility.py): Chromium logs each thing the CSP refused as a console error.
    page.on("console", lambda message: errors.append(message.text) if "Content Security Policy" in message.text else None)
    try:
        stage(page, name)
        response = page.goto(tour.server.url + tour.path(name))
        # the page itself, not the 404 page in its place
        assert response is not None and response.status == STATUS.get(name, 200)
        if name in ("run", "signed-out"):
            page.wait_for_selector("#loss-chart canvas")
        else:
            page.wait_for_load_state("networkidle")
        finish(page, name)
        if name == "compare":
            page.wait_for_selector("#compare-chart canvas")
        if name == "graphql":
            expect(page.locator(".narrow-notice")).to_be_visible()
        shot(page, f"phone-{name}")
        measured = page.evaluate(MEASURE)
        assert measured["scrollWidth"] <= PHONE["width"] and measured["clipped"] == [] and measured["off"] == [], measured
        assert errors == []
    finally:
        page.close()
        if context is not phone:
            context.close()


def test_the_navigation_collapses_behind_a_menu_button(tour: Tour, phone: BrowserContext) -> None:
    page = phone.new_page()
    try:
        page.goto(f"{tour.server.url}/keys")
        nav_link = page.get_by_role("link", name="Playground")
        menu = page.get_by_role("button", name="Menu")
        expect(nav_link).to_be_hidden()
        expect(menu).to_have_attribute("aria-expanded", "false")
        heading = page.get_by_role("heading", name="API keys").bounding_box()
        assert heading and heading["y"] < 200, heading  # the page's own content starts on the first screen
        menu.click()
        expect(menu).to_have_attribute("aria-expanded", "true")
        nav_link.click()
        page.wait_for_url("**/playground")
        expect(page.get_by_role("link", name="Runs")).to_be_hidden()  # a new page starts with the menu closed
    finally:
        page.close()


def test_wide_tables_scroll_inside_their_cards(tour: Tour, phone: BrowserContext) -> None:
    page = phone.new_page()
    try:
        page.goto(f"{tour.server.url}/runs")
        scroller = page.locator("#runs-table .table-scroll")
        widths = scroller.evaluate("(el) => [el.scrollWidth, el.clientWidth, getComputedStyle(el).overflowX]")
        assert widths[0] > widths[1] and widths[2] == "auto", widths  # wider than the card, and it scrolls
        scroller.evaluate("(el) => { el.scrollLeft = el.scrollWidth; }")
        expect(page.locator("#runs-table td").last).to_be_in_viewport()
    finally:
        page.close()


def test_the_playgrounds_panes_fit_a_phone(tour: Tour, phone: BrowserContext) -> None:
    page = phone.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if "Content Security Policy" in message.text else None)
    try:
        play_side_by_side(page, tour)
        shot(page, "phone-playground-panes")
        measured = page.evaluate(MEASURE)
        assert measured["scrollWidth"] <= PHONE["width"] and measured["clipped"] == [] and measured["off"] == [], measured
        assert errors == []
    finally:
        page.close()
