"""Google sign-in through Supabase Auth (PKCE), end to end against a local stand-in of Supabase's auth endpoints
(tests/web/supabase_standin.py: Supabase itself cannot be reached from here). Each forgery is refused."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import update

from app.db import Database
from app.tables import NAME_LENGTH, LoginAttempt, User
from tests.helpers.live_server import LiveServer, settings_for
from tests.web.conftest import csrf_of, run_async
from tests.web.supabase_standin import SupabaseStandIn


@pytest.fixture(scope="module")
def standin() -> Iterator[SupabaseStandIn]:
    standin = SupabaseStandIn().start()
    yield standin
    standin.stop()


@pytest.fixture(scope="module")
def server(standin: SupabaseStandIn, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LiveServer]:
    settings = settings_for(tmp_path_factory.mktemp("signal-supabase"), tiny_model_dir, supabase_url=standin.url,
                            supabase_anon_key="anon-key", admin_emails="google-user@example.com")
    server = LiveServer.start(settings)
    yield server
    server.stop()


def start_login(server: LiveServer, next_path: str = "/keys") -> tuple[httpx.Client, str]:
    """A browser-like client that pressed "Sign in with Google"; returns it and the authorize URL."""
    client = httpx.Client(base_url=server.url, timeout=60)
    login = client.get("/login")
    assert "Sign in with Google" in login.text
    started = client.post("/auth/google", data={"next": next_path},
                          headers={"X-CSRF-Token": csrf_of(login.text), "HX-Request": "true"})
    assert started.status_code == 204
    return client, started.headers["hx-redirect"]


def callback_of(authorize_url: str) -> str:
    """Where the stand-in (as Supabase after Google's consent) sends the browser back."""
    response = httpx.get(authorize_url, follow_redirects=False)
    assert response.status_code == 302
    return response.headers["location"]


def test_google_sign_in_makes_the_supabase_user_a_signal_user(server: LiveServer, standin: SupabaseStandIn) -> None:
    client, authorize = start_login(server)
    assert authorize.startswith(f"{standin.url}/auth/v1/authorize?") and "code_challenge=" in authorize
    done = client.get(callback_of(authorize))
    assert done.status_code == 303 and done.headers["location"] == "/keys"
    keys = client.get("/keys")
    assert keys.status_code == 200 and "google-user@example.com" in keys.text
    assert client.get("/admin").status_code == 200  # listed in SIGNAL_ADMIN_EMAILS
    me = run_async(_stored_user(server, "google-user@example.com")).id
    assert me == standin.user_id and len(me) == 36  # the Supabase UUID is the Signal user id


def test_overlapping_logins_each_keep_their_verifier(server: LiveServer) -> None:
    client, first = start_login(server)
    second = client.post("/auth/google", data={"next": "/runs"},
                         headers={"X-CSRF-Token": csrf_of(client.get("/login").text), "HX-Request": "true"})
    second_callback = callback_of(second.headers["hx-redirect"])
    first_callback = callback_of(first)
    assert client.get(first_callback).headers["location"] == "/keys"
    assert client.get(second_callback).headers["location"] == "/runs"


def test_wrong_state_is_refused(server: LiveServer) -> None:
    client, authorize = start_login(server)
    callback = callback_of(authorize)
    forged = callback.replace("state=", "state=forged")
    assert client.get(forged).status_code == 401
    assert client.get("/keys").status_code == 303  # not signed in


def test_state_from_another_browser_is_refused(server: LiveServer) -> None:
    _, authorize = start_login(server)
    with httpx.Client(base_url=server.url) as victim:
        assert victim.get(callback_of(authorize)).status_code == 401


@pytest.mark.parametrize("verifier", ["", "a-wrong-verifier-" + "x" * 40], ids=["missing", "wrong"])
def test_missing_or_wrong_verifier_is_refused(server: LiveServer, verifier: str) -> None:
    client, authorize = start_login(server)
    callback = callback_of(authorize)
    state = httpx.URL(callback).params["state"]
    run_async(_set_verifier(server, state, verifier))  # as if the stored verifier were lost or swapped
    response = client.get(callback)
    assert response.status_code == 401 and "code verifier" in response.text


@pytest.mark.parametrize(("bend", "why"), [
    ({"exp": 1_000_000_000}, "expired"),
    ({"aud": "someone-else"}, "aud"),
    ({"iss": "https://evil.example.com/auth/v1"}, "iss"),
    ({"kid": "unknown-key"}, "unknown"),
], ids=["expired", "wrong-audience", "wrong-issuer", "unknown-key-id"])
def test_bad_tokens_are_refused(server: LiveServer, standin: SupabaseStandIn, bend: dict, why: str) -> None:
    client, authorize = start_login(server)
    standin.next_token = dict(bend)
    response = client.get(callback_of(authorize))
    assert response.status_code == 401 and why in response.text.lower()
    assert client.get("/keys").status_code == 303


@pytest.mark.parametrize("next_path", ["/runs/" + "a" * 600, "/runs\x00/keys"], ids=["over-long", "nul"])
def test_a_next_path_the_database_cannot_hold_returns_home(server: LiveServer, next_path: str) -> None:
    # PostgreSQL refuses both in login_attempts.next_path (SQLite would keep them): sign-in must still work.
    client, authorize = start_login(server, next_path)
    done = client.get(callback_of(authorize))
    assert done.status_code == 303 and done.headers["location"] == "/"


def test_a_full_name_longer_than_the_column_is_shortened(server: LiveServer, standin: SupabaseStandIn) -> None:
    client, authorize = start_login(server)
    standin.next_token = {"sub": str(uuid.uuid4()), "email": "long-name@example.com",
                          "user_metadata": {"full_name": "N" * 300, "email_verified": True}}
    done = client.get(callback_of(authorize))
    assert done.status_code == 303 and done.headers["location"] == "/keys"
    assert run_async(_stored_user(server, "long-name@example.com")).name == "N" * NAME_LENGTH


async def _stored_user(server: LiveServer, email: str) -> User:
    from app.services.users import UserService

    db = Database(server.settings.resolved_database_url)
    try:
        user = await UserService(db).find(email)
        assert user is not None
        return user
    finally:
        await db.dispose()


async def _set_verifier(server: LiveServer, state: str, verifier: str) -> None:
    db = Database(server.settings.resolved_database_url)
    try:
        async with db.session() as session:
            await session.execute(update(LoginAttempt).where(LoginAttempt.state == state).values(code_verifier=verifier))
    finally:
        await db.dispose()
