"""Dashboard sessions on the server (issue 18 §5, bugs 1, 4, 5 and 11) against a real server and a real Chromium.

The cookie carries a random id and the `sessions` table its hash: sign-out, "Sign out everywhere" and disabling a
user end a session at once (a copied cookie too), open event streams say `signed-out`, and GraphiQL runs as the
signed-in user only with the session's CSRF token.
"""

from __future__ import annotations

import asyncio
import json
import re
from base64 import b64encode
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import websockets
from itsdangerous import TimestampSigner
from playwright.sync_api import Browser, BrowserContext, Page, expect
from sqlalchemy import func, select, update
from websockets.typing import Subprotocol

from app.db import Database
from app.services.next_path import safe_next_path
from app.services.sessions import SessionService, session_hash
from app.services.users import UserService
from app.tables import DashboardSession, utcnow
from rewardsignal import AuthenticationError, SignalClient
from tests.helpers.live_server import LiveServer, error_code, settings_for
from tests.web.conftest import api_key_for, mint_login_link, run_async, sign_in
from web.session import COOKIE as COOKIE_NAME
from web.session import session_secret

expect.set_options(timeout=30_000)
RECHECK_S = 0.3  # streams re-check their session this often here (the default is 15 s)
LONG = 200  # tokens: a generation that outlasts a re-check (the tiny model's context is 256)
ME = "{ me { email } }"


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("sessions"), tiny_model_dir,
                                           session_recheck_s=RECHECK_S,
                                           decode_chunk_seconds=0.001))  # a progress event per token or two
    yield server
    server.stop()


@pytest.fixture
def context(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(60_000)
    yield context
    context.close()


@pytest.fixture
def page(context: BrowserContext) -> Page:
    return context.new_page()


def db_call(server: LiveServer, work):  # type: ignore[no-untyped-def]
    """Run `work(db)` against the server's database, from this (sync) test."""

    async def go():  # type: ignore[no-untyped-def]
        db = Database(server.settings.resolved_database_url)
        try:
            return await work(db)
        finally:
            await db.dispose()

    return run_async(go())


def session_rows(server: LiveServer) -> int:
    async def count(db: Database) -> int:
        async with db.session() as session:
            return int(await session.scalar(select(func.count()).select_from(DashboardSession)) or 0)

    return int(db_call(server, count))


def copy_of(client: httpx.Client, server: LiveServer) -> httpx.Client:
    """Another client holding the same cookie, as a thief who copied it would."""
    return httpx.Client(base_url=server.url, cookies={COOKIE_NAME: client.cookies[COOKIE_NAME]}, timeout=60)


# ---- the cookie and the table -------------------------------------------------------------------------------

def test_a_copied_session_cookie_is_refused_after_sign_out(live_server: LiveServer) -> None:
    visitor = sign_in(live_server)
    thief = copy_of(visitor.client, live_server)
    assert thief.get("/keys").status_code == 200  # the copy works while the session lives...
    assert visitor.post("/logout").headers["hx-redirect"] == "/login"
    refused = thief.get("/keys")
    assert refused.status_code == 303 and refused.headers["location"] == "/login?next=/keys"  # ...and not after
    assert thief.post("/graphql", json={"query": ME}, headers={"X-CSRF-Token": visitor.csrf}).json()["errors"][0][
        "extensions"]["code"] == "UNAUTHENTICATED"


def test_a_cookie_from_before_server_sessions_is_signed_out(live_server: LiveServer) -> None:
    # The old cookie held the user id itself, signed with the same secret: it must not sign anyone in now.
    visitor = sign_in(live_server)
    user = db_call(live_server, lambda db: UserService(db).find(visitor.email))
    payload = b64encode(json.dumps({"user_id": user.id, "csrf": "x"}).encode())
    old = TimestampSigner(session_secret(live_server.settings)).sign(payload).decode()
    client = httpx.Client(base_url=live_server.url, cookies={COOKIE_NAME: old})
    response = client.get("/keys")
    assert response.status_code == 303 and response.headers["location"].startswith("/login")


def test_no_row_is_written_before_sign_in(live_server: LiveServer) -> None:
    before = session_rows(live_server)
    client = httpx.Client(base_url=live_server.url)
    link = mint_login_link(live_server, "rowless@example.com")
    assert client.get("/login?next=/keys").status_code == 200
    assert client.get(link).status_code == 200  # the page that posts the link; the cookie now holds a CSRF token
    assert session_rows(live_server) == before
    assert COOKIE_NAME in client.cookies


def test_the_row_holds_a_hash_and_last_seen_moves_at_most_once_a_minute(live_server: LiveServer) -> None:
    async def work(db: Database) -> list[bool]:
        users = UserService(db)
        user, _ = await users.get_or_create("seen@example.com")
        sessions = SessionService(db, ttl_s=3600)
        sid = await sessions.create(user, "Mozilla/5.0 (X11; Linux x86_64) Chrome/130.0")
        async with db.session() as session:
            row = await session.get(DashboardSession, session_hash(sid))
            assert row is not None and row.user_agent.endswith("Chrome/130.0")
            first_seen = row.last_seen_at
        assert await session_rows_async(db, sid) == 1 and sid != session_hash(sid)
        live = await sessions.live(sid)
        assert live is not None and live.row.last_seen_at == first_seen  # a visit within the minute writes nothing
        earlier = utcnow() - timedelta(minutes=2)
        async with db.session() as session:
            await session.execute(update(DashboardSession).where(DashboardSession.id_hash == session_hash(sid))
                                  .values(last_seen_at=earlier))
        await sessions.live(sid)
        async with db.session() as session:
            moved = await session.get(DashboardSession, session_hash(sid))
        assert moved is not None and moved.last_seen_at > earlier + timedelta(minutes=1)
        assert moved.expires_at > utcnow() + timedelta(minutes=59)  # the expiry slid with the visit
        async with db.session() as session:  # expired: signed out
            await session.execute(update(DashboardSession).where(DashboardSession.id_hash == session_hash(sid))
                                  .values(expires_at=utcnow() - timedelta(seconds=1)))
        return [await sessions.live(sid) is None, await sessions.live("not-a-session") is None]

    assert db_call(live_server, work) == [True, True]


async def session_rows_async(db: Database, sid: str) -> int:
    async with db.session() as session:
        return int(await session.scalar(select(func.count()).select_from(DashboardSession)
                                        .where(DashboardSession.id_hash == session_hash(sid))) or 0)


def test_disabling_a_user_ends_their_sessions_keys_and_links(live_server: LiveServer) -> None:
    visitor = sign_in(live_server)
    other = sign_in(live_server, visitor.email)  # a second browser of the same user
    key = api_key_for(live_server, visitor.email)

    # From the admin page's Disable button (issue 18 §7): the button's URL holds the user's id.
    admin = sign_in(live_server, "disabler@example.com", is_admin=True)
    row = re.search(rf'<tr data-user="{re.escape(visitor.email)}">(.*?)</tr>', admin.client.get("/admin").text, re.S)
    assert row is not None
    button = re.search(r'hx-post="(/admin/users/[^"]+/disabled)"', row.group(1))
    assert button is not None
    disabled = admin.post(button.group(1), data={"disabled": "1"})
    after = re.search(rf'<tr data-user="{re.escape(visitor.email)}">(.*?)</tr>', disabled.text, re.S)
    assert disabled.status_code == 200 and after is not None and '<span class="pill muted">disabled</span>' in after.group(1)
    assert [c.get("/keys").status_code for c in (visitor.client, other.client)] == [303, 303]
    with pytest.raises(AuthenticationError):
        SignalClient(api_key=key, base_url=live_server.url).list_runs()
    client = httpx.Client(base_url=live_server.url)
    page = client.get(mint_login_link(live_server, visitor.email))
    assert page.status_code == 200  # the link is unused...
    token = re.search(r'name="token" value="([^"]+)"', page.text)
    assert token is not None
    refused = client.post("/auth/link", data={"token": token.group(1)}, headers={"X-CSRF-Token": csrf_in(page.text)})
    assert refused.status_code == 401 and "Sign in again" in refused.text  # ...but a disabled user cannot sign in


def csrf_in(html: str) -> str:
    match = re.search(r'"X-CSRF-Token": "([^"]+)"', html)
    assert match
    return match.group(1)


# ---- event streams end with their session --------------------------------------------------------------------

def _run_id(server: LiveServer, email: str) -> str:
    return SignalClient(api_key=api_key_for(server, email), base_url=server.url).create_run(lora_r=4).id


def _events_until(response: httpx.Response, name: str) -> list[str]:
    seen = []
    for line in response.iter_lines():
        if line.startswith("event:"):
            seen.append(line.split(":", 1)[1].strip())
            if seen[-1] == name:
                return seen
    raise AssertionError(f"the stream ended without `{name}`: {seen}")


def test_an_open_stream_says_signed_out_when_its_session_is_revoked(live_server: LiveServer) -> None:
    visitor = sign_in(live_server)
    run_id = _run_id(live_server, visitor.email)
    watcher = copy_of(visitor.client, live_server)  # the stream holds the same session as the tab that signs out
    with watcher.stream("GET", f"/runs/{run_id}/events", headers={"Accept": "text/event-stream"}) as stream:
        assert stream.status_code == 200
        visitor.post("/logout")
        assert _events_until(stream, "signed-out")[-1] == "signed-out"
    # Reopened with the dead cookie, the stream says so at once instead of redirecting (EventSource would retry).
    with watcher.stream("GET", f"/runs/{run_id}/events", headers={"Accept": "text/event-stream"}) as stream:
        assert stream.status_code == 200 and _events_until(stream, "signed-out") == ["signed-out"]


def _decoding(server: LiveServer, admin: str, run_id: str) -> bool:
    body = server.graphql("{ runtime }", key=admin)
    return any(run_id in str(group["runs"]) for group in body["data"]["runtime"]["decode_groups"])


def test_an_open_playground_stream_stops_its_generation_when_signed_out(live_server: LiveServer) -> None:
    visitor = sign_in(live_server)
    run_id = _run_id(live_server, visitor.email)
    admin = live_server.new_user(is_admin=True)
    answer = visitor.post("/playground/stream", data={"model": f"run:{run_id}", "prompt": "Tell me a long story",
                                                      "temperature": "1", "max_tokens": str(LONG)})
    assert answer.status_code == 200, answer.text
    url = answer.text.split('data-stream="')[1].split('"')[0]
    watcher = copy_of(visitor.client, live_server)
    with watcher.stream("GET", url, headers={"Accept": "text/event-stream"}) as stream:
        # One iterator over the stream: leaving an httpx line iterator closes the stream, which stops the sample.
        events = (line.split(":", 1)[1].strip() for line in stream.iter_lines() if line.startswith("event:"))
        assert next(events) == "progress"
        assert _decoding(live_server, admin, run_id)  # generating now
        visitor.post("/logout")
        seen = [next(events)]
        while seen[-1] != "signed-out":
            seen.append(next(events))
        assert "done" not in seen, seen  # the session's end came before the generation's
        # Stopped by the server while this client still holds the stream open.
        live_server.wait_for(lambda: not _decoding(live_server, admin, run_id),
                             "the signed-out stream's rows to leave the decode groups", 60)


def test_an_open_run_page_says_signed_out_after_sign_out_in_another_tab(context: BrowserContext,
                                                                         live_server: LiveServer) -> None:
    email = "two-tabs@example.com"
    run_id = _run_id(live_server, email)
    watching = context.new_page()
    watching.goto(mint_login_link(live_server, email))
    watching.wait_for_url("**/runs")
    watching.goto(f"{live_server.url}/runs/{run_id}")
    expect(watching.locator("#live-state")).to_have_attribute("data-state", "live")

    other = context.new_page()
    other.goto(f"{live_server.url}/keys")
    other.get_by_role("button", name="Sign out").click()
    other.wait_for_url("**/login")

    notice = watching.get_by_role("alert").filter(has_text="Signed out")
    expect(notice).to_be_visible()
    expect(watching.locator("#live-state")).to_have_attribute("data-state", "signed-out")
    expect(notice.get_by_role("link", name="Sign in again")).to_have_attribute(
        "href", f"/login?next=%2Fruns%2F{run_id}")


# ---- the Account page and signing out everywhere --------------------------------------------------------------

def test_sign_out_everywhere_ends_another_browsers_session(browser: Browser, live_server: LiveServer) -> None:
    email = "everywhere@example.com"
    first, second = browser.new_context(), browser.new_context()
    try:
        pages = [first.new_page(), second.new_page()]
        for page in pages:
            page.goto(mint_login_link(live_server, email))
            page.wait_for_url("**/runs")
        account = pages[1]
        account.get_by_role("link", name="Account").click()
        account.wait_for_url("**/account")
        rows = account.locator("#sessions-table tbody tr")
        expect(rows).to_have_count(2)
        expect(account.locator("tr[data-session=current]")).to_contain_text("this browser")
        expect(account.locator("tr[data-session=current]")).to_contain_text(" on Linux")  # the device, from its agent
        expect(account.locator("tr[data-session=other]")).to_have_count(1)
        account.once("dialog", lambda dialog: dialog.accept())
        account.get_by_role("button", name="Sign out everywhere").click()
        account.wait_for_url("**/login")

        pages[0].goto(f"{live_server.url}/keys")
        pages[0].wait_for_url("**/login?next=/keys")
        expect(pages[0].get_by_role("heading", name="Sign in")).to_be_visible()
    finally:
        first.close()
        second.close()


def test_signing_out_one_listed_browser_leaves_this_one(live_server: LiveServer) -> None:
    visitor = sign_in(live_server)
    other = sign_in(live_server, visitor.email)
    page = visitor.client.get("/account").text
    others = re.findall(r'data-session="other">.*?hx-delete="(/account/sessions/[0-9a-f]{64})"', page, re.S)
    assert len(others) == 1
    table = visitor.delete(others[0])
    assert table.status_code == 200 and 'data-session="other"' not in table.text
    assert other.client.get("/keys").status_code == 303
    assert visitor.client.get("/keys").status_code == 200


# ---- sign-in links: a used one says so and stays; `next` is kept --------------------------------------------------

def test_a_used_sign_in_link_shows_a_lasting_error_with_a_way_back(page: Page, live_server: LiveServer) -> None:
    link = mint_login_link(live_server, "used-twice@example.com")
    page.goto(link)
    page.wait_for_url("**/runs")
    page.context.clear_cookies()
    page.goto(link)
    expect(page.get_by_role("heading", name="This link cannot sign you in")).to_be_visible()
    expect(page.get_by_role("alert")).to_contain_text("used, has expired or is unknown")
    expect(page.get_by_text("Signing you in")).to_have_count(0)
    page.get_by_role("link", name="Sign in again").click()
    page.wait_for_url("**/login?next=/runs")


def test_a_deep_link_opened_signed_out_lands_there_after_the_one_time_link(page: Page, live_server: LiveServer) -> None:
    email = "deep-link@example.com"
    run_id = _run_id(live_server, email)
    page.goto(f"{live_server.url}/runs/{run_id}?tab=checkpoints")
    page.wait_for_url(f"**/login?next=/runs/{run_id}%3Ftab%3Dcheckpoints")
    page.goto(mint_login_link(live_server, email))  # the link `signal login-link` printed, opened in this browser
    page.wait_for_url(f"{live_server.url}/runs/{run_id}?tab=checkpoints")
    expect(page.locator("#live-state")).to_have_attribute("data-state", "live")


@pytest.mark.parametrize(("asked", "lands"), [("/keys", "/keys"), ("//evil.example/x", "/runs"),
                                              ("/\\evil.example", "/runs"), ("https://evil.example/", "/runs"),
                                              ("", "/runs")])
def test_next_is_kept_only_when_it_is_a_local_path(live_server: LiveServer, asked: str, lands: str) -> None:
    client = httpx.Client(base_url=live_server.url)
    client.get("/login", params={"next": asked})
    link = client.get(mint_login_link(live_server, "next@example.com"))
    token = re.search(r'name="token" value="([^"]+)"', link.text)
    assert token is not None
    signed = client.post("/auth/link", data={"token": token.group(1)},
                         headers={"X-CSRF-Token": csrf_in(link.text), "HX-Request": "true"})
    assert signed.status_code == 204 and signed.headers["hx-redirect"] == lands


@pytest.mark.parametrize(("path", "safe"), [("/runs/x?y=1", "/runs/x?y=1"), ("//x", "/runs"), ("/\\x", "/runs"),
                                            ("runs", "/runs"), ("/a\x00", "/runs"), ("/" + "a" * 600, "/runs")])
def test_safe_next_path(path: str, safe: str) -> None:
    assert safe_next_path(path) == safe


# ---- GraphiQL with the session ------------------------------------------------------------------------------

def test_graphql_uses_the_session_only_with_its_csrf_token(live_server: LiveServer) -> None:
    visitor = sign_in(live_server)
    client = visitor.client
    with_token = client.post("/graphql", json={"query": ME}, headers={"X-CSRF-Token": visitor.csrf}).json()
    assert with_token == {"data": {"me": {"email": visitor.email}}}
    assert error_code(client.post("/graphql", json={"query": ME}).json()) == "UNAUTHENTICATED"  # the cookie alone
    assert error_code(client.post("/graphql", json={"query": ME}, headers={"X-CSRF-Token": "forged"}).json()) \
        == "UNAUTHENTICATED"
    # A GET never uses the cookie, token or not.
    got = client.get("/graphql", params={"query": ME}, headers={"X-CSRF-Token": visitor.csrf, "Accept": "application/json"})
    assert error_code(got.json()) == "UNAUTHENTICATED"
    # A pasted Authorization header wins over the session.
    other = live_server.new_user("pasted-key@example.com")
    pasted = client.post("/graphql", json={"query": ME},
                         headers={"X-CSRF-Token": visitor.csrf, "Authorization": f"Bearer {other}"}).json()
    assert pasted == {"data": {"me": {"email": "pasted-key@example.com"}}}
    # An Authorization header that is not a key is refused, never read as "no header".
    bad = client.post("/graphql", json={"query": ME}, headers={"X-CSRF-Token": visitor.csrf, "Authorization": "x"})
    assert error_code(bad.json()) == "UNAUTHENTICATED"


async def _ws_handshake(server: LiveServer, cookie: str, params: dict, origin: str | None = None) -> dict:
    headers = {"Cookie": f"{COOKIE_NAME}={cookie}", "Origin": origin or server.url}
    async with websockets.connect(server.url.replace("http", "ws") + "/graphql", subprotocols=[Subprotocol("graphql-transport-ws")],
                                  additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "connection_init", "payload": params}))
        try:
            return {"type": json.loads(await asyncio.wait_for(ws.recv(), timeout=30))["type"]}
        except websockets.ConnectionClosed as closed:
            return {"closed": closed.rcvd.code if closed.rcvd else None}


def test_graphql_websockets_take_the_session_with_its_token_in_connection_params(live_server: LiveServer) -> None:
    visitor = sign_in(live_server)
    cookie = visitor.client.cookies[COOKIE_NAME]
    assert run_async(_ws_handshake(live_server, cookie, {"X-CSRF-Token": visitor.csrf})) == {"type": "connection_ack"}
    assert run_async(_ws_handshake(live_server, cookie, {})) == {"closed": 4403}
    assert run_async(_ws_handshake(live_server, cookie, {"X-CSRF-Token": "forged"})) == {"closed": 4403}
    # Strawberry's origin check still stands: a page on another site is refused before any message.
    with pytest.raises(websockets.InvalidStatus):
        run_async(_ws_handshake(live_server, cookie, {"X-CSRF-Token": visitor.csrf}, origin="https://evil.example"))
    visitor.post("/logout")
    assert run_async(_ws_handshake(live_server, cookie, {"X-CSRF-Token": visitor.csrf})) == {"closed": 4403}


def _set_editor(page: Page, selector: str, text: str) -> None:
    # GraphiQL 3's editors are CodeMirror 5: set the text through its API rather than typing (auto-closing brackets).
    page.locator(f"{selector} .CodeMirror").wait_for()
    page.evaluate("([selector, text]) => document.querySelector(selector + ' .CodeMirror').CodeMirror.setValue(text)",
                  [selector, text])


def test_graphiql_answers_as_the_signed_in_user_and_stores_no_key(context: BrowserContext, live_server: LiveServer,
                                                                  tmp_path: Path) -> None:
    email = "graphiql-session@example.com"
    page = context.new_page()
    page.goto(mint_login_link(live_server, email))
    page.wait_for_url("**/runs")
    # What the old page left behind: a pasted key in both places GraphiQL 3 keeps headers.
    page.evaluate("""() => {
        localStorage.setItem('graphiql:headers', '{"Authorization": "Bearer sk-oldstored"}');
        localStorage.setItem('graphiql:shouldPersistHeaders', 'true');
        localStorage.setItem('graphiql:tabState', JSON.stringify({activeTabIndex: 0, tabs: [{id: 't', hash: 'h',
            title: 'q', query: '{ models { name } }', variables: null, operationName: null, response: null,
            headers: '{"Authorization": "Bearer sk-oldstored"}'}]}));
    }""")
    page.goto(f"{live_server.url}/graphql")
    _set_editor(page, ".graphiql-query-editor", ME)
    page.locator(".graphiql-execute-button").click()
    expect(page.locator(".result-window")).to_contain_text(email)

    # A key pasted into the headers editor wins, and is not stored.
    other = live_server.new_user("graphiql-pasted@example.com")
    page.get_by_role("button", name="Headers").click()
    _set_editor(page, ".graphiql-editor-tool .graphiql-editor:not(.hidden)", json.dumps({"Authorization": f"Bearer {other}"}))
    page.locator(".graphiql-execute-button").click()
    expect(page.locator(".result-window")).to_contain_text("graphiql-pasted@example.com")
    # GraphiQL has written its tab state since the paste (the query is in it): still no key anywhere.
    page.wait_for_function("() => (localStorage.getItem('graphiql:tabState') || '').includes('me { email }')")
    stored = page.evaluate("() => Object.keys(localStorage).map(k => k + '=' + localStorage.getItem(k)).join('\\n')")
    assert "sk-" not in stored, stored
    page.reload()
    expect(page.locator(".graphiql-query-editor")).to_contain_text("me")
    stored = page.evaluate("() => Object.keys(localStorage).map(k => k + '=' + localStorage.getItem(k)).join('\\n')")
    assert "sk-" not in stored, stored


@pytest.mark.parametrize(("value", "ok"), [(15, True), (0.05, True), (16, False), (0, False)])
def test_streams_recheck_their_session_at_least_every_15_s(tmp_path: Path, value: float, ok: bool) -> None:
    from pydantic import ValidationError

    from app.settings import Settings

    if ok:
        assert Settings(_env_file=None, data_dir=tmp_path, session_recheck_s=value).session_recheck_s == value
    else:
        with pytest.raises(ValidationError, match="session_recheck_s"):
            Settings(_env_file=None, data_dir=tmp_path, session_recheck_s=value)
