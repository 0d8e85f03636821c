"""`rechecked` re-checks while the inner stream is quiet, and a failed check ends the stream and closes it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.errors import Unauthenticated
from app.rechecked import rechecked


async def test_checks_while_quiet_and_ends_with_what_the_check_raises() -> None:
    release, closed = asyncio.Event(), asyncio.Event()
    checks = 0

    async def events() -> AsyncIterator[str]:
        try:
            yield "first"
            await release.wait()  # quiet: no event until the checks have run
            yield "second"
            await asyncio.Event().wait()  # never again
        finally:
            closed.set()

    async def check() -> None:
        nonlocal checks
        checks += 1
        if checks == 3:
            release.set()
        if checks == 5:
            raise Unauthenticated("API key is invalid or revoked")

    seen = []
    with pytest.raises(Unauthenticated):
        async for event in rechecked(events(), 0.001, check):
            seen.append(event)
    assert seen == ["first", "second"]
    assert checks == 5
    assert closed.is_set()


async def test_an_inner_stream_that_ends_ends_it() -> None:
    async def events() -> AsyncIterator[int]:
        for i in range(3):
            yield i

    async def check() -> None:
        raise AssertionError("no check is due before the stream ends")

    assert [event async for event in rechecked(events(), 60, check)] == [0, 1, 2]
