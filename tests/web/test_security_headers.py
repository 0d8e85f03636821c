"""Security headers on every answer, and a CSP the dashboard's own pages keep to (checked in Chromium: a blocked
script or style raises a securitypolicyviolation event)."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import Browser

from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, mint_login_link
from web.security_headers import GRAPHIQL_CSP, PAGE_CSP

COMMON = {"x-content-type-options": "nosniff", "x-frame-options": "DENY"}
# Records every CSP violation the page raises, before any of its own scripts run.
WATCH_VIOLATIONS = """
window.__violations = [];
document.addEventListener('securitypolicyviolation', e => window.__violations.push(
  `${e.violatedDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber}`));
"""


@pytest.mark.parametrize("path", ["/runs", "/keys", "/playground", "/start", "/models"])
def test_signed_in_pages_carry_the_page_csp_and_no_store(visitor: Visitor, path: str) -> None:
    response = visitor.client.get(path)
    assert response.status_code == 200
    assert {k: response.headers[k] for k in COMMON} == COMMON
    assert response.headers["content-security-policy"] == PAGE_CSP
    assert response.headers["referrer-policy"] == "same-origin"
    assert response.headers["cache-control"] == "no-store"


def test_graphiql_page_allows_its_injected_styles_only(live_server: LiveServer) -> None:
    response = httpx.get(f"{live_server.url}/graphql", headers={"Accept": "text/html"}, timeout=30)
    assert response.status_code == 200 and "<script>" not in response.text and "<style>" not in response.text
    assert response.headers["content-security-policy"] == GRAPHIQL_CSP
    assert "style-src 'self' 'unsafe-inline'" in GRAPHIQL_CSP and "font-src 'self' data:" in GRAPHIQL_CSP


def test_login_link_page_sends_no_referrer(live_server: LiveServer) -> None:
    response = httpx.get(mint_login_link(live_server, "referrer@example.com"), timeout=30)
    assert response.status_code == 200
    assert response.headers["referrer-policy"] == "no-referrer"


def test_api_and_static_answers_carry_the_common_headers(live_server: LiveServer) -> None:
    for response in (httpx.post(f"{live_server.url}/graphql", json={"query": "{ models { name } }"}, timeout=30),
                     httpx.get(f"{live_server.url}/static/app.css", timeout=30)):
        assert {k: response.headers[k] for k in COMMON} == COMMON
        assert "content-security-policy" not in response.headers  # not HTML: nothing to run


def test_pages_run_under_their_csp_without_violations(browser: Browser, live_server: LiveServer) -> None:
    context = browser.new_context()
    context.add_init_script(WATCH_VIOLATIONS)
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        page.goto(mint_login_link(live_server, "csp@example.com"))
        page.wait_for_url(f"{live_server.url}/runs")
        for path in ("/runs", "/keys", "/playground", "/start", "/models"):
            page.goto(f"{live_server.url}{path}")
            page.wait_for_load_state("networkidle")
            assert page.evaluate("window.__violations") == [], path
        page.goto(f"{live_server.url}/graphql")
        page.wait_for_selector(".graphiql-container")  # React rendered GraphiQL from /static/graphiql.js
        assert page.evaluate("window.__violations") == []
    finally:
        context.close()
