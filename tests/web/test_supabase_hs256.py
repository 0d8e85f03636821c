"""The legacy HS256 path of the Supabase token check: accepted only with the configured secret, and held to
the same expiry, issuer and audience rules as JWKS tokens. No network: HS256 never fetches the JWKS."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import OctKey

from app.errors import Unauthenticated
from app.services.supabase_tokens import SupabaseTokenVerifier

URL = "http://127.0.0.1:9/supabase"  # never contacted: the JWKS is only fetched for ES256/RS256 tokens
SECRET = "a-legacy-jwt-secret-that-is-long-enough-for-hs256"


def token(secret: str = SECRET, **overrides: Any) -> str:
    claims = {"sub": "8a3f1c2e-0000-4000-8000-000000000001", "email": "legacy@example.com",
              "iss": f"{URL}/auth/v1", "aud": "authenticated", "exp": int(time.time()) + 600, **overrides}
    return jwt.encode({"alg": "HS256"}, claims, OctKey.import_key(secret))


async def verify(value: str, secret: str = SECRET) -> dict[str, Any]:
    async with httpx.AsyncClient() as http:
        return await SupabaseTokenVerifier(URL, http, jwt_secret=secret).verify(value)


async def test_a_token_signed_with_the_configured_secret_is_accepted() -> None:
    claims = await verify(token())
    assert claims["sub"] == "8a3f1c2e-0000-4000-8000-000000000001" and claims["email"] == "legacy@example.com"


@pytest.mark.parametrize(("value", "secret", "why"), [
    (token(secret="another-secret-of-the-same-sufficient-length!"), SECRET, "refused"),
    (token(), "", "no SIGNAL_SUPABASE_JWT_SECRET"),
    (token(exp=int(time.time()) - 10), SECRET, "refused"),
    (token(aud="anon"), SECRET, "refused"),
    (token(iss="http://elsewhere/auth/v1"), SECRET, "refused"),
], ids=["wrong-secret", "no-secret-configured", "expired", "wrong-audience", "wrong-issuer"])
async def test_bad_hs256_tokens_are_refused(value: str, secret: str, why: str) -> None:
    with pytest.raises(Unauthenticated) as caught:
        await verify(value, secret)
    assert why in str(caught.value)
