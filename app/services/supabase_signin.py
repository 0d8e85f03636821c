""""Sign in with Google" through Supabase Auth, with PKCE.

Each login builds its own auth client on a throwaway storage (supabase-auth keeps one verifier slot per
storage and `sign_in_with_oauth` does not return it), reads the verifier out, and keeps it in a
`login_attempts` row keyed by a random state. Supabase does not echo an app's state, so the state rides
in `redirect_to`. The callback consumes the row atomically, exchanges the code, and verifies the token.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlencode

import httpx
from sqlalchemy import update
from supabase_auth import AsyncGoTrueClient, AsyncMemoryStorage
from supabase_auth.errors import AuthError

from app.db import Database
from app.errors import Unauthenticated
from app.services.next_path import safe_next_path
from app.services.supabase_tokens import SupabaseTokenVerifier
from app.services.users import UserService
from app.tables import LoginAttempt, User, utcnow

ATTEMPT_TTL = timedelta(minutes=10)
STORAGE_KEY = "signal.login"


@dataclass
class SignedIn:
    user: User
    next_path: str


class SupabaseSignIn:
    def __init__(self, db: Database, users: UserService, verifier: SupabaseTokenVerifier, http: httpx.AsyncClient,
                 supabase_url: str, anon_key: str, admin_emails: frozenset[str]) -> None:
        self.db = db
        self.users = users
        self.verifier = verifier
        self.http = http
        self.auth_url = f"{supabase_url.rstrip('/')}/auth/v1"
        self.anon_key = anon_key
        self.admin_emails = admin_emails

    def _client(self, storage: AsyncMemoryStorage) -> AsyncGoTrueClient:
        return AsyncGoTrueClient(
            url=self.auth_url, headers={"apikey": self.anon_key, "Authorization": f"Bearer {self.anon_key}"},
            storage_key=STORAGE_KEY, storage=storage, flow_type="pkce", auto_refresh_token=False,
            persist_session=False, http_client=self.http,
        )

    async def start(self, callback_url: str, next_path: str = "/") -> tuple[str, str]:
        """(URL to send the browser to, the attempt's state)."""
        state = secrets.token_urlsafe(32)
        storage = AsyncMemoryStorage()
        response = await self._client(storage).sign_in_with_oauth({
            "provider": "google", "options": {"redirect_to": _with_state(callback_url, state)},
        })
        verifier = await storage.get_item(f"{STORAGE_KEY}-code-verifier")
        if not verifier:
            raise RuntimeError("supabase-auth stored no PKCE verifier; is flow_type still honoured?")
        now = utcnow()
        async with self.db.session() as session:
            session.add(LoginAttempt(state=state, code_verifier=verifier, next_path=_safe_next(next_path),
                                     created_at=now, expires_at=now + ATTEMPT_TTL))
        return response.url, state

    async def finish(self, state: str, code: str, callback_url: str) -> SignedIn:
        """Consume the attempt named by `state`, exchange `code` with its verifier, verify the token."""
        if not state or not code:
            raise Unauthenticated("the sign-in callback lacks its state or code")
        now = utcnow()
        async with self.db.session() as session:
            row = (await session.execute(
                update(LoginAttempt)
                .where(LoginAttempt.state == state, LoginAttempt.used_at.is_(None), LoginAttempt.expires_at > now)
                .values(used_at=now)
                .returning(LoginAttempt.code_verifier, LoginAttempt.next_path)
            )).first()
        if row is None:
            raise Unauthenticated("this sign-in attempt is unknown, used or expired; start again")
        verifier, next_path = row
        try:
            response = await self._client(AsyncMemoryStorage()).exchange_code_for_session({
                "auth_code": code, "code_verifier": verifier, "redirect_to": _with_state(callback_url, state),
            })
        except AuthError as error:
            raise Unauthenticated(f"Supabase refused the sign-in: {error.message}") from error
        if response.session is None:
            raise Unauthenticated("Supabase returned no session for this sign-in")
        claims = await self.verifier.verify(response.session.access_token)
        email = str(claims.get("email") or (response.user.email if response.user else "") or "")
        verified = bool(response.user and response.user.email_confirmed_at)
        user = await self.users.sign_in_external(
            str(claims["sub"]), email, name=str((claims.get("user_metadata") or {}).get("full_name") or ""),
            email_verified=verified, make_admin=email.lower() in self.admin_emails,
        )
        return SignedIn(user=user, next_path=next_path)


def _with_state(callback_url: str, state: str) -> str:
    return f"{callback_url}?{urlencode({'state': state})}"


def _safe_next(path: str) -> str:
    return safe_next_path(path, default="/")
