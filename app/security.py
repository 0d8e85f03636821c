"""API keys: random secrets shown once; only a SHA-256 hash and a display prefix are stored."""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "sk-"


def generate_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(secret: str) -> str:
    # Keys carry 256 random bits, so a fast unsalted hash is safe here (no password stretching needed).
    return hashlib.sha256(secret.encode()).hexdigest()


def display_prefix(secret: str) -> str:
    return secret[:10]
