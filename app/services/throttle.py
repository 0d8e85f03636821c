"""Calls the runtime refused for too many in flight (RESOURCE_EXHAUSTED, resource "calls": never applied), sent again
by the server itself for callers whose wire cannot resend one: a Tinker future's work runs after its submit was
answered, so its SDK can only poll. Such a caller sets `throttled` to a hook; the refused call is sent again, same
request id and ticket, after its `retryAfterS`, within RETRY_BUDGET_S, still holding its run's place in order. The
hook hears each pause (seconds) and its end (None): Tinker's polls answer 429 with Retry-After meanwhile.
Other callers (GraphQL, /v1, pages) get the refusal as it is, with its 429; their clients resend.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from app.errors import SignalError, retry_after_s

log = logging.getLogger("signal.throttle")

T = TypeVar("T")
# The Tinker SDK's own budget for retryable errors (its execute_with_retries), so a refusal outlasting it fails alike.
RETRY_BUDGET_S = 300.0

Hook = Callable[[float | None], None]
throttled: contextvars.ContextVar[Hook | None] = contextvars.ContextVar("throttled", default=None)


async def sent_until_taken(call: Callable[[], Awaitable[T]], budget_s: float = RETRY_BUDGET_S) -> T:
    """`call()`, sent again after each refusal's retryAfterS while a `throttled` hook is set and the budget lasts."""
    hook = throttled.get()
    if hook is None:
        return await call()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    while True:
        try:
            return await call()
        except SignalError as error:
            delay = retry_after_s(error)
            if delay is None or loop.time() + delay > deadline:
                raise
            log.info("a call refused for too many in flight: sent again in %.1f s", delay)
            hook(delay)
            try:
                await asyncio.sleep(delay)  # the runtime's own estimate of when a place frees up
            finally:
                hook(None)
