"""Checks a Supabase access token on our side: signature, expiry, issuer and audience.

supabase-py's `get_claims` checks neither issuer nor audience, so it is not relied on. Keys come from the
project's JWKS (ES256/RS256); the legacy HS256 secret is accepted only when configured.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet, OctKey
from joserfc.jws import extract_compact
from joserfc.jwt import JWTClaimsRegistry

from app.errors import Unauthenticated

ASYMMETRIC = ("ES256", "RS256")
AUDIENCE = "authenticated"


class SupabaseTokenVerifier:
    def __init__(self, supabase_url: str, http: httpx.AsyncClient, jwt_secret: str = "",
                 refetch_interval_s: float = 30.0) -> None:
        self.issuer = f"{supabase_url.rstrip('/')}/auth/v1"
        self.jwks_url = f"{self.issuer}/.well-known/jwks.json"
        self.http = http
        # Built explicitly as an oct key: joserfc warns on implicit or weak keys (and tests treat warnings as errors).
        self.hs256_key = OctKey.import_key(jwt_secret) if jwt_secret else None
        self.refetch_interval_s = refetch_interval_s
        self._keys: KeySet | None = None
        self._fetched_at = float("-inf")

    async def verify(self, token: str) -> dict[str, Any]:
        """The token's claims, or Unauthenticated saying why it was refused."""
        try:
            header = extract_compact(token.encode()).protected
        except (JoseError, ValueError) as error:
            raise Unauthenticated("the sign-in token is malformed") from error
        alg = header.get("alg")
        key: Any
        if alg == "HS256":
            if self.hs256_key is None:
                raise Unauthenticated("HS256 tokens are refused: no SIGNAL_SUPABASE_JWT_SECRET is configured")
            key = self.hs256_key
        elif alg in ASYMMETRIC:
            key = await self._key(header.get("kid"))
        else:
            raise Unauthenticated(f"the sign-in token's algorithm {alg!r} is not accepted")
        try:
            claims = jwt.decode(token, key, algorithms=[alg]).claims
            JWTClaimsRegistry(
                iss={"essential": True, "value": self.issuer},
                aud={"essential": True, "value": AUDIENCE},
                exp={"essential": True},
                sub={"essential": True},
            ).validate(claims)
        except JoseError as error:
            raise Unauthenticated(f"the sign-in token was refused: {error.description or error.error}") from error
        return claims

    async def _key(self, kid: object) -> Any:
        if not isinstance(kid, str) or not kid:
            raise Unauthenticated("the sign-in token names no key id")
        if self._keys is None or not _has(self._keys, kid):
            # A key we do not know may be a rotation: refetch once, but not more often than the interval,
            # so a stream of forged key ids cannot make us hammer the JWKS endpoint.
            if time.monotonic() - self._fetched_at >= self.refetch_interval_s:
                await self._fetch()
        if self._keys is None or not _has(self._keys, kid):
            raise Unauthenticated(f"the sign-in token's key id {kid!r} is unknown")
        return self._keys.get_by_kid(kid)

    async def _fetch(self) -> None:
        self._fetched_at = time.monotonic()
        try:
            response = await self.http.get(self.jwks_url, timeout=10)
            response.raise_for_status()
            self._keys = KeySet.import_key_set(response.json())
        except (httpx.HTTPError, ValueError, JoseError) as error:
            raise Unauthenticated(f"could not fetch Supabase's signing keys from {self.jwks_url}") from error


def _has(keys: KeySet, kid: str) -> bool:
    return any(key.kid == kid for key in keys.keys)
