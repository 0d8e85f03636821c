"""PostgreSQL LISTEN for cross-process wake-ups (the metric feed, Tinker's futures): one dedicated asyncpg
connection per channel, reconnected with backoff. NOTIFYs sent while it was down are lost, so each (re)connect
runs `on_connect` to catch up from the tables."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import asyncpg
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger("signal.events")


async def listen(url: str, channel: str, on_connect: Callable[[], Awaitable[None]],
                 deliver: Callable[[str], Awaitable[None]], what: str) -> None:
    """Forever (until cancelled): LISTEN on `channel`, `on_connect()` once listening, then `deliver(payload)` for
    each NOTIFY in order. A failure in either reconnects."""
    # Its own connection, outside the pool: LISTEN belongs to one session (so not a transaction pooler's).
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    delay = 0.5
    while True:
        try:
            connection = await asyncpg.connect(dsn)
        except (OSError, asyncpg.PostgresError) as error:
            log.warning("%s: LISTEN connection failed (%s); again in %.1f s", what, error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
            continue
        delay = 0.5
        try:
            await _listen_on(connection, channel, on_connect, deliver)
            log.warning("%s: the LISTEN connection closed; reconnecting", what)
        except (OSError, asyncpg.PostgresError, SQLAlchemyError) as error:
            log.warning("%s: LISTEN connection lost (%s); reconnecting", what, error)
        finally:
            with contextlib.suppress(Exception):
                await connection.close(timeout=5)


async def _listen_on(connection: asyncpg.Connection, channel: str, on_connect: Callable[[], Awaitable[None]],
                     deliver: Callable[[str], Awaitable[None]]) -> None:
    notices: asyncio.Queue[str | None] = asyncio.Queue()  # payloads; None: the connection ended
    await connection.add_listener(channel, lambda _c, _pid, _channel, payload: notices.put_nowait(payload))
    connection.add_termination_listener(lambda _c: notices.put_nowait(None))
    await on_connect()  # what was written while nobody here listened
    while (payload := await notices.get()) is not None:
        await deliver(payload)
