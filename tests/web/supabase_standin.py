"""A local stand-in for the two Supabase Auth endpoints Signal uses, plus the project's JWKS.

Supabase cannot be reached from the test machines, so this speaks its wire format at the network boundary:
`/auth/v1/authorize` (redirects back with a code, remembering the PKCE challenge), `/auth/v1/token?grant_type=pkce`
(checks the verifier against the challenge, returns a session with an ES256 access token) and
`/auth/v1/.well-known/jwks.json`. It lives in the tests only. `next_token` bends the next token's claims
or key id, to check that Signal refuses it.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import uvicorn
from joserfc import jwt
from joserfc.jwk import ECKey
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from tests.helpers.live_server import free_port


@dataclass
class SupabaseStandIn:
    email: str = "google-user@example.com"
    user_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    key: ECKey = field(default_factory=lambda: ECKey.generate_key("P-256", parameters={"kid": "key-1"}))
    next_token: dict[str, Any] = field(default_factory=dict)  # claim overrides, and "kid", for the next token
    challenges: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    server: uvicorn.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SupabaseStandIn:
        app = Starlette(routes=[
            Route("/auth/v1/authorize", self.authorize),
            Route("/auth/v1/token", self.token, methods=["POST"]),
            Route("/auth/v1/.well-known/jwks.json", self.jwks),
        ])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        thread = threading.Thread(target=self.server.run, daemon=True)
        thread.start()
        started = threading.Event()
        while not self.server.started and thread.is_alive():
            started.wait(0.02)
        return self

    def stop(self) -> None:
        if self.server:
            self.server.should_exit = True

    async def authorize(self, request: Request) -> Response:
        assert request.query_params["provider"] == "google"
        assert request.query_params["code_challenge_method"] == "s256"
        code = secrets.token_urlsafe(16)
        self.challenges[code] = request.query_params["code_challenge"]
        # Google and the consent screen happen here in real life; the user comes back with a code.
        redirect_to = request.query_params["redirect_to"]
        return RedirectResponse(f"{redirect_to}&{urlencode({'code': code})}", status_code=302)

    async def token(self, request: Request) -> Response:
        body = await request.json()
        if request.query_params.get("grant_type") != "pkce" or request.headers.get("apikey") != "anon-key":
            return _error("bad_request", "grant_type=pkce and the apikey header are required")
        challenge = self.challenges.pop(body.get("auth_code") or "", None)
        verifier = body.get("code_verifier") or ""
        if challenge is None:
            return _error("flow_state_not_found", "invalid flow state, no valid flow state found")
        digest = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        if not verifier or digest != challenge:
            return _error("bad_code_verifier", "code challenge does not match previously saved code verifier")
        now = int(time.time())
        overrides, self.next_token = self.next_token, {}
        kid = overrides.pop("kid", self.key.kid)
        claims = {"sub": self.user_id, "email": self.email, "aud": "authenticated", "role": "authenticated",
                  "iss": f"{self.url}/auth/v1", "iat": now, "exp": now + 3600,
                  "user_metadata": {"full_name": "Google User", "email_verified": True}, **overrides}
        access_token = jwt.encode({"alg": "ES256", "kid": kid}, claims, self.key)
        user = {"id": self.user_id, "aud": "authenticated", "role": "authenticated", "email": self.email,
                "email_confirmed_at": "2026-01-01T00:00:00Z", "app_metadata": {"provider": "google"},
                "user_metadata": claims["user_metadata"], "created_at": "2026-01-01T00:00:00Z"}
        return JSONResponse({"access_token": access_token, "token_type": "bearer", "expires_in": 3600,
                             "expires_at": now + 3600, "refresh_token": secrets.token_urlsafe(12), "user": user})

    async def jwks(self, request: Request) -> Response:
        return JSONResponse({"keys": [self.key.as_dict(private=False)]})


def _error(code: str, message: str) -> Response:
    return JSONResponse({"code": 400, "error_code": code, "msg": message}, status_code=400)
