"""API keys: random secrets shown once; only a SHA-256 hash and a display prefix are stored. How a caller presents
one: the bearer token of an `Authorization` header or a websocket's connection parameters (GraphQL, /v1, downloads).
And the server's signing secret (the dashboard's cookie, Tinker's signed download links)."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from app.settings import Settings

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


def bearer_from_connection_params(params: object) -> str | None:
    """graphql-transport-ws clients send the key as `Authorization`, `authorization` or `apiKey`."""
    if not isinstance(params, dict):
        return None
    for key in ("Authorization", "authorization"):
        header = params.get(key)
        if isinstance(header, str):
            return bearer_from_header(header)
    value = params.get("apiKey") or params.get("api_key")
    return value if isinstance(value, str) and value else None


def server_secret(settings: Settings) -> str:
    """SIGNAL_SESSION_SECRET, or one generated once into the data directory (mode 0600) and reused,
    so signatures survive restarts and every server process on this data directory agrees."""
    if settings.session_secret:
        return settings.session_secret
    path = Path(settings.data_dir) / "session_secret"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        # Written whole under a name of its own, then linked into place: a server starting beside this one never
        # reads a half-written (empty) secret, and the first link wins for every process.
        draft = path.with_name(f".session_secret.{os.getpid()}.{secrets.token_hex(4)}")
        with os.fdopen(os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
            handle.write(secrets.token_urlsafe(48))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(draft, path)
        except FileExistsError:
            pass  # another process's secret came first: this one uses it too
        finally:
            draft.unlink()
    secret = path.read_text().strip()
    if not secret:  # an empty key would sign cookies anyone can forge
        raise RuntimeError(f"{path} is empty: delete it (a new secret is made at the next start; sessions end) "
                           "or set SIGNAL_SESSION_SECRET")
    return secret
