"""API keys: random secrets shown once; only a SHA-256 hash and a display prefix are stored. And how a caller presents
one: the bearer token of an `Authorization` header or a websocket's connection parameters (GraphQL, /v1, downloads)."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

KEY_PREFIX = "sk-"


def generate_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(secret: str) -> str:
    # Keys carry 256 random bits, so a fast unsalted hash is safe here (no password stretching needed).
    return hashlib.sha256(secret.encode()).hexdigest()


def display_prefix(secret: str) -> str:
    return secret[:10]


def bearer_from_header(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def bearer_from_connection_params(params: dict[str, Any] | None) -> str | None:
    """graphql-transport-ws clients send the key as `Authorization`, `authorization` or `apiKey`."""
    if not isinstance(params, dict):
        return None
    for key in ("Authorization", "authorization"):
        if isinstance(params.get(key), str):
            return bearer_from_header(params[key])
    value = params.get("apiKey") or params.get("api_key")
    return value if isinstance(value, str) and value else None
