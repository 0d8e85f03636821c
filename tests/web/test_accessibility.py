"""Accessibility (issue 18): axe-core, vendored under tests/vendor/, finds no serious or critical violation on any
dashboard page at 1280 and at 390 pixels wide.

axe is injected as a script, which the pages' CSP (scripts from 'self' only) would refuse: these contexts bypass
the CSP. tests/web/test_phone.py visits every page without the bypass and fails on any CSP violation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserContext, ViewportSize

from tests.helpers.live_server import LiveServer
from tests.web.conftest import shot
from tests.web.tour import DESKTOP, PAGES, PHONE, SIGNED_OUT, STATUS, Tour, finish, make_tour, play_side_by_side, stage

AXE = Path(__file__).parents[1] / "vendor" / "axe-core-4.14.1" / "axe.min.js"
BLOCKING = ("serious", "critical")
# On /graphql only our own markup counts: GraphiQL's (vendored, not ours to fix) is excluded. What axe finds inside
# it, at serious or critical, is exactly this list; the test fails if an upgrade changes it, so it stays true.
GRAPHIQL = ".graphiql-container"
GRAPHIQL_RULES = {"color-contrast", "label", "scrollable-region-focusable"}
RUN_AXE = """(context) => axe.run(context, {resultTypes: ["violations"]}).then((result) => result.violations.map(
  (v) => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.slice(0, 3).map((node) => node.target.join(" "))})))"""


@pytest.fixture(scope="module")
def tour(live_server: LiveServer) -> Tour:
    return make_tour(live_server, "axe@example.com")


@pytest.fixture(scope="module", params=[DESKTOP, PHONE], ids=["1280", "390"])
def viewport(request: pytest.FixtureRequest) -> ViewportSize:
    return request.param  # type: ignore[no-any-return]  # pytest's param is untyped


@pytest.fixture(scope="module")
def contexts(browser: Browser, tour: Tour, viewport: ViewportSize) -> Iterator[dict[bool, BrowserContext]]:
    signed_in, signed_out = tour.context(browser, viewport, bypass_csp=True), tour.context(
        browser, viewport, signed_in=False, bypass_csp=True)
    yield {True: signed_in, False: signed_out}
    signed_in.close()
    signed_out.close()


def violations(context: BrowserContext, url: str, within: dict[str, Any], ready: str | None,
               picture: str | None = None, name: str = "") -> list[dict[str, Any]]:
    page = context.new_page()
    try:
        stage(page, name)
        response = page.goto(url)
        # the page itself, not the 404 page in its place
        assert response is not None and response.status == STATUS.get(name, 200), url
        page.wait_for_selector(ready, state="attached") if ready else page.wait_for_load_state("networkidle")
        finish(page, name)
        if picture:
            shot(page, picture)  # before axe adds anything to the page
        page.add_script_tag(path=str(AXE))
        found: list[dict[str, Any]] = page.evaluate(RUN_AXE, within)
        return [v for v in found if v["impact"] in BLOCKING]
    finally:
        page.close()


@pytest.mark.parametrize("name", PAGES)
def test_no_serious_accessibility_violations(name: str, tour: Tour, contexts: dict[bool, BrowserContext],
                                            viewport: ViewportSize) -> None:
    url = tour.server.url + tour.path(name)
    ready = {"run": "#loss-chart canvas", "signed-out": "#loss-chart canvas", "compare": "#compare-chart canvas",
             "graphql": f"{GRAPHIQL} .graphiql-execute-button"}.get(name)
    within = {"exclude": [[GRAPHIQL]]} if name == "graphql" else {"exclude": []}
    picture = f"desktop-{name}" if viewport == DESKTOP else None  # the 390 px set is test_phone.py's
    assert violations(contexts[name not in SIGNED_OUT], url, within, ready, picture, name) == []


def test_the_playgrounds_panes_have_no_serious_violations(tour: Tour, contexts: dict[bool, BrowserContext]) -> None:
    page = contexts[True].new_page()
    try:
        play_side_by_side(page, tour)
        page.add_script_tag(path=str(AXE))
        found: list[dict[str, Any]] = page.evaluate(RUN_AXE, {"exclude": []})
    finally:
        page.close()
    assert [v for v in found if v["impact"] in BLOCKING] == []


def test_graphiqls_own_violations_are_the_listed_ones(tour: Tour, browser: Browser) -> None:
    context = tour.context(browser, DESKTOP, bypass_csp=True)
    try:
        found = violations(context, f"{tour.server.url}/graphql", {"include": [[GRAPHIQL]]},
                           f"{GRAPHIQL} .graphiql-execute-button")
    finally:
        context.close()
    assert {v["id"] for v in found} == GRAPHIQL_RULES, found
