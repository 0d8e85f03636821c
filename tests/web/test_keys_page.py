"""The key form and Getting started's key snippet, in Chromium against a real server (issue 18, bugs 9 and 12):
what the copy button puts on the clipboard is a whole key or no key; the form empties after creating, refuses
an empty name, and a revoked key's secret leaves the screen."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect

from rewardsignal import AuthenticationError, SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, api_key_for, mint_login_link

expect.set_options(timeout=30_000)


@pytest.fixture
def page(browser: Browser, live_server: LiveServer) -> Iterator[Page]:
    # Loopback is a secure context: the copy button uses the clipboard API, which the test reads back.
    context = browser.new_context(viewport={"width": 1280, "height": 860},
                                  permissions=["clipboard-read", "clipboard-write"])
    page = context.new_page()
    yield page
    context.close()


def sign_in(page: Page, server: LiveServer, email: str) -> None:
    page.goto(mint_login_link(server, email))
    page.wait_for_url(f"{server.url}/runs")


def copied(page: Page, button_of: str) -> str:
    button = page.locator(f"[data-copy='{button_of}']")
    button.click()
    expect(button).to_have_text("Copied")
    return str(page.evaluate("navigator.clipboard.readText()"))


def test_the_form_empties_after_creating_and_enter_again_makes_no_duplicate(page: Page, live_server: LiveServer) -> None:
    sign_in(page, live_server, "keys-form@example.com")
    page.goto(f"{live_server.url}/keys")
    page.fill("#key-name", "laptop")
    page.press("#key-name", "Enter")
    expect(page.locator(".secret-box")).to_contain_text("Key “laptop” created.")
    expect(page.locator("#key-name")).to_have_value("")
    page.press("#key-name", "Enter")  # the browser holds an empty name back: `required`
    expect(page.locator("#key-name")).to_have_js_property("validity.valueMissing", True)
    expect(page.locator("#keys-table tbody tr")).to_have_count(1)


def test_an_empty_name_is_refused_by_the_server_too(visitor: Visitor) -> None:
    answer = visitor.post("/keys", data={"name": "   "})
    assert answer.status_code == 422
    assert answer.text.startswith("Name the key")
    assert "<tbody>" not in visitor.client.get("/keys").text  # no key was made


def test_revoking_the_key_on_screen_takes_its_secret_away(page: Page, live_server: LiveServer) -> None:
    sign_in(page, live_server, "keys-revoke@example.com")
    page.goto(f"{live_server.url}/keys")
    for name in ("old", "new"):
        page.fill("#key-name", name)
        page.get_by_role("button", name="Create key").click()
        expect(page.locator(".secret-box")).to_contain_text(f"Key “{name}” created.")
    page.on("dialog", lambda dialog: dialog.accept())
    rows = page.locator("#keys-table tbody tr")
    rows.filter(has_text="old").get_by_role("button", name="Revoke").click()
    expect(rows.filter(has_text="old").locator(".pill")).to_have_text("revoked")
    expect(page.locator(".secret-box")).to_contain_text("Key “new” created.")  # another key's secret stays
    rows.filter(has_text="new").get_by_role("button", name="Revoke").click()
    expect(rows.filter(has_text="new").locator(".pill")).to_have_text("revoked")
    expect(page.locator(".secret-box")).to_have_count(0)


CHECKOUT_INSTALL = "pip install ./rewardsignal  # from a checkout of this repository"


def test_getting_started_copies_a_whole_key_or_none(page: Page, live_server: LiveServer) -> None:
    email = "start-copy@example.com"
    old = api_key_for(live_server, email)
    sign_in(page, live_server, email)
    page.goto(f"{live_server.url}/start")
    expect(page.locator("#env-card")).to_contain_text(f"your key starting with {old[:10]}")
    text = copied(page, "#env-snippet")
    # This server has built no SDK wheel: the checkout's folder (tests/examples/test_snippets.py serves one).
    assert text == f"{CHECKOUT_INSTALL}\nexport SIGNAL_BASE_URL={live_server.url}"
    assert "sk-" not in copied(page, "#openai-snippet")

    page.get_by_role("button", name="Create a key for this snippet").click()
    expect(page.get_by_role("alert")).to_contain_text("Key “getting-started” created.")
    match = re.fullmatch(rf"{re.escape(CHECKOUT_INSTALL)}\nexport SIGNAL_BASE_URL={re.escape(live_server.url)}\n"
                         r"export SIGNAL_API_KEY=(sk-\S+)", copied(page, "#env-snippet"))
    assert match, "the snippet holds the new key's whole secret"
    client = SignalClient(api_key=match.group(1), base_url=live_server.url)
    assert client.list_runs() == []  # a key that works
    with pytest.raises(AuthenticationError):
        SignalClient(api_key=match.group(1)[:12], base_url=live_server.url).list_runs()
