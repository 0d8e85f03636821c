"""What an exception means to a caller, for every wire's one exception mapping: a typed Signal error as it is, the
database's failures (disk full, locked, read-only) as app/db.py classes them, and a body too deep, a number too large
or bytes that are not text as the caller's BAD_INPUT. None: a bug, which each wire answers as its own 500."""

from __future__ import annotations

from app.db import database_error
from app.errors import BadInput, SignalError


def known_failure(exc: BaseException, field: str = "body") -> SignalError | None:
    if isinstance(exc, SignalError):
        return exc
    if isinstance(exc, RecursionError):
        return BadInput(f"{field} is nested too deeply", field=field)
    if isinstance(exc, OverflowError):
        return BadInput(f"{field} holds a number out of range ({exc})", field=field)
    if isinstance(exc, UnicodeError):
        return BadInput(f"{field} is not valid UTF-8 text", field=field)
    return database_error(exc)
