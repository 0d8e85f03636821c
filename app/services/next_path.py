"""Where a sign-in returns to: only a path on this site, and one the database column holds."""

from __future__ import annotations

from app.tables import NEXT_PATH_LENGTH

DEFAULT = "/runs"


def safe_next_path(path: object, default: str = DEFAULT) -> str:
    # Only paths on this site: an open redirect after sign-in would hand a phishing page our credibility
    # ("//evil.example" and "/\\evil.example" are other hosts to a browser).
    if not isinstance(path, str):
        return default
    on_site = path.startswith("/") and not path.startswith(("//", "/\\"))
    # And one the column holds: PostgreSQL refuses NUL and over-long text where SQLite would not.
    return path if on_site and len(path) <= NEXT_PATH_LENGTH and path.isprintable() else default
