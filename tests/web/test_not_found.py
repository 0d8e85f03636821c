"""Unknown addresses (issue 18, bug 8): the dashboard's own 404 page, never Starlette's bare "Not Found" text;
JSON for the paths programs call, each API in its clients' shape."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, expect

from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, mint_login_link, sign_in


@pytest.fixture(scope="module")
def visitor(live_server: LiveServer) -> Iterator[Visitor]:
    visitor = sign_in(live_server)
    yield visitor
    visitor.client.close()


def test_an_unknown_path_is_the_dashboards_404_page_signed_out(live_server: LiveServer) -> None:
    answer = httpx.get(f"{live_server.url}/no/such/page")
    assert answer.status_code == 404
    assert answer.headers["content-type"].startswith("text/html")
    assert '<div class="empty-code">404</div>' in answer.text and "<h1>Not found</h1>" in answer.text
    assert "There is no page at this address." in answer.text
    assert 'class="sidebar"' not in answer.text


def test_signed_in_the_404_page_keeps_the_navigation(visitor: Visitor) -> None:
    answer = visitor.client.get("/runz")
    assert answer.status_code == 404
    assert 'class="sidebar"' in answer.text and visitor.email in answer.text
    assert "There is no page at this address." in answer.text


def test_an_htmx_request_to_an_unknown_path_gets_the_toasts_text(visitor: Visitor) -> None:
    answer = visitor.client.get("/no/such/fragment", headers={"HX-Request": "true"})
    assert answer.status_code == 404
    assert answer.headers["content-type"].startswith("text/plain")
    assert answer.text == "There is no page at this address."


def test_a_run_id_that_cannot_be_one_is_not_printed_as_an_escape(visitor: Visitor) -> None:
    answer = visitor.client.get("/runs/%00")
    assert answer.status_code == 404
    assert "no run has that id" in answer.text
    assert "\\x00" not in answer.text and "\x00" not in answer.text


@pytest.mark.parametrize(("path", "shape"), [
    ("/api/v1/no_such_call", "tinker"),
    ("/v1/no/such/endpoint", "openai"),
    ("/api/v2/runs", "graphql"),
    ("/graphql/extra", "graphql"),
])
def test_api_paths_answer_json_in_their_own_shape(path: str, shape: str, live_server: LiveServer) -> None:
    answer = httpx.get(live_server.url + path)
    assert answer.status_code == 404
    assert answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    if shape == "openai":
        assert body["error"]["code"] == "unknown_url" and path in body["error"]["message"]
    elif shape == "tinker":
        assert "is not supported by Signal's Tinker endpoint" in answer.text
    else:
        assert body == {"errors": [{"message": f"no API at GET {path}", "extensions": {"code": "NOT_FOUND"}}]}


def test_the_404_page_in_a_browser_is_centred(browser: Browser, live_server: LiveServer) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    try:
        page.goto(mint_login_link(live_server, "lost@example.com"))
        page.wait_for_url(f"{live_server.url}/runs")
        page.goto(f"{live_server.url}/runs/missing/page")
        heading = page.get_by_role("heading", name="Not found")
        expect(heading).to_be_visible()
        expect(page.get_by_role("link", name="Back to your runs")).to_be_visible()
        # The heading's text sits under the status code, not at the left of its row.
        offset = page.evaluate("""() => {
            const range = document.createRange();
            range.selectNodeContents(document.querySelector('.empty h1'));
            const text = range.getBoundingClientRect(), code = document.querySelector('.empty-code').getBoundingClientRect();
            return Math.abs((text.left + text.right) / 2 - (code.left + code.right) / 2);
        }""")
        assert offset < 2
    finally:
        context.close()
