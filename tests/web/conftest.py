"""Dashboard fixtures: signed-in HTTP clients and a real Chromium (Debian's, driven by Playwright)."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from app.db import Database
from app.services.keys import KeyService
from app.services.login_links import LoginLinkService
from app.services.users import UserService

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

    from tests.helpers.live_server import LiveServer

CHROMIUM = Path("/usr/bin/chromium")
# The committed screenshots (the README shows run.png), written on purpose by `make screenshots`, which points
# SIGNAL_TEST_SCREENSHOTS here. Any other test run writes its own to build/screenshots/ (ignored): it leaves the tree clean.
COMMITTED_SCREENSHOTS = Path(__file__).parent / "screenshots"
TEST_SCREENSHOTS = Path(__file__).parents[2] / "build" / "screenshots"
# What the committed set's browser clock reads (page.clock.set_fixed_time), so that making them again changes no
# picture for the time of day it was made.
SCREENSHOT_CLOCK = "2025-06-02T10:00:00Z"
CSRF = re.compile(r'"X-CSRF-Token": "([^"]+)"')


def screenshots_dir() -> Path:
    """Where browser tests leave screenshots now (read at each call: a test may set the variable)."""
    return Path(os.environ.get("SIGNAL_TEST_SCREENSHOTS") or TEST_SCREENSHOTS)


def shot(page: Page, name: str) -> None:
    """A full-page screenshot, `name`.png, where this run keeps them."""
    folder = screenshots_dir()
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"{name}.png"), full_page=True)


def committing_screenshots() -> bool:
    return screenshots_dir().resolve() == COMMITTED_SCREENSHOTS.resolve()


def run_async(coroutine: Any) -> Any:
    # A thread of its own, so this works whether or not the caller already runs an event loop.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def mint_login_link(server: LiveServer, email: str, is_admin: bool = False) -> str:
    """A one-time sign-in URL for `email` (the user is created if new), as `signal login-link` makes."""

    async def mint() -> str:
        db = Database(server.settings.resolved_database_url)
        try:
            user, _ = await UserService(db).get_or_create(email, is_admin=is_admin)
            return await LoginLinkService(db, server.settings.login_link_ttl_s).mint(user)
        finally:
            await db.dispose()

    return f"{server.url}/auth/link?token={run_async(mint())}"


def api_key_for(server: LiveServer, email: str, is_admin: bool = False) -> str:
    """A new API key of `email` (the user is created if new, an admin with `is_admin`; an existing one keeps its role)."""

    async def make() -> str:
        db = Database(server.settings.resolved_database_url)
        try:
            user, _ = await UserService(db).get_or_create(email, is_admin=is_admin)
            return (await KeyService(db).create(user, "test"))[0]
        finally:
            await db.dispose()

    return str(run_async(make()))


@dataclass
class Visitor:
    """A signed-in dashboard visitor: an httpx client holding the session cookie, and its CSRF token."""

    email: str
    client: httpx.Client
    csrf: str

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.client.post(url, headers={"X-CSRF-Token": self.csrf, "HX-Request": "true"}, **kwargs)

    def delete(self, url: str) -> httpx.Response:
        return self.client.delete(url, headers={"X-CSRF-Token": self.csrf, "HX-Request": "true"})


def csrf_of(html: str) -> str:
    match = CSRF.search(html)
    assert match, "every page carries the CSRF token in hx-headers"
    return match.group(1)


def sign_in(server: LiveServer, email: str | None = None, is_admin: bool = False) -> Visitor:
    email = email or f"web-{uuid.uuid4().hex[:8]}@example.com"
    client = httpx.Client(base_url=server.url, timeout=120)
    page = client.get(mint_login_link(server, email, is_admin))
    token = re.search(r'name="token" value="([^"]+)"', page.text)
    assert page.status_code == 200 and token
    csrf = csrf_of(page.text)
    signed = client.post("/auth/link", data={"token": token.group(1)},
                         headers={"X-CSRF-Token": csrf, "HX-Request": "true"})
    assert signed.status_code == 204 and signed.headers["hx-redirect"] == "/runs", signed.text
    # Signing in starts a fresh session with a fresh token.
    return Visitor(email, client, csrf_of(client.get("/keys").text))


@pytest.fixture
def visitor(live_server: LiveServer) -> Iterator[Visitor]:
    visitor = sign_in(live_server)
    yield visitor
    visitor.client.close()


# Per module, not per session: sync Playwright keeps an event loop running on this thread until it stops,
# and async tests collected after it (pytest-asyncio) could not start their own.
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail("browser tests need Debian's chromium: apt-get install -y chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield browser
        browser.close()


@pytest.fixture
def wide_page(browser: Browser) -> Iterator[Page]:
    """A desktop-sized page whose test fails on any uncaught script error in it."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert errors == []
