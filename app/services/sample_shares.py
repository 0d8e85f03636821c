"""One bound on a user's sample calls in flight, whichever wire sent them (issue 34 #10): GraphQL's `sample`, `/v1`'s
completions, Tinker's `asample` and the playground all take a place here (SIGNAL_MAX_USER_SAMPLES_IN_FLIGHT), so a
flood on one wire cannot fill the decode engine for another user. Past the bound a sample is refused at once with
RESOURCE_EXHAUSTED (resource "calls", retryAfterS): 429 with Retry-After on `/v1` and on Tinker's asample (its SDK
backs off and resubmits), GraphQL's typed error. Each server process counts its own calls; the runtime's
SIGNAL_MAX_USER_CALLS_IN_FLIGHT bounds every process's calls together behind it.

Tinker's asample takes its place at submit (so the 429 answers the submit, where the SDK retries it) and hands it to
the future's work through `held`, so the sample that work makes does not count twice.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager

from app.errors import ResourceExhausted
from app.settings import MAX_USER_SAMPLES_IN_FLIGHT

# When a refused caller may try again: the user's recent sample time, within these (as the runtime's refusals).
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 30.0


class Place:
    """One sample call's place in its user's bound, given back once (`release`)."""

    def __init__(self, shares: SampleShares, user_id: str) -> None:
        self.shares, self.user_id = shares, user_id
        self.taken = time.monotonic()
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.shares._give_back(self)


# A place taken before the sample was made (Tinker's submit): the sample inside it takes no second one.
held: contextvars.ContextVar[Place | None] = contextvars.ContextVar("held", default=None)


class SampleShares:
    def __init__(self, bound: int = MAX_USER_SAMPLES_IN_FLIGHT) -> None:
        self.bound = bound
        self.in_flight: dict[str, int] = {}  # user id → sample calls in flight here
        self._recent_s: dict[str, float] = {}  # user id → a moving average of their samples' seconds
        self.refused: dict[str, int] = {}  # user id → samples refused past the bound (what tests and operators read)

    def take(self, user_id: str) -> Place:
        """A place for one more sample of `user_id`; RESOURCE_EXHAUSTED (429, retryAfterS) past the bound."""
        count = self.in_flight.get(user_id, 0)
        if count >= self.bound:
            self.refused[user_id] = self.refused.get(user_id, 0) + 1
            retry_after = min(max(self._recent_s.get(user_id, RETRY_AFTER_MIN_S), RETRY_AFTER_MIN_S),
                              RETRY_AFTER_MAX_S)
            raise ResourceExhausted(f"too many sample calls in flight: {count} of this user's, at most {self.bound} "
                                    f"(SIGNAL_MAX_USER_SAMPLES_IN_FLIGHT); retry in {retry_after:.0f} s",
                                    resource="calls", retry_after_s=retry_after)
        self.in_flight[user_id] = count + 1
        return Place(self, user_id)

    @contextmanager
    def place(self, user_id: str) -> Iterator[None]:
        """A sample's place for the block, unless one is `held` already (taken at a Tinker submit)."""
        if held.get() is not None:
            yield
            return
        taken = self.take(user_id)
        try:
            yield
        finally:
            taken.release()

    def _give_back(self, place: Place) -> None:
        left = self.in_flight.get(place.user_id, 1) - 1
        if left > 0:
            self.in_flight[place.user_id] = left
        else:
            self.in_flight.pop(place.user_id, None)
        seconds = time.monotonic() - place.taken
        before = self._recent_s.get(place.user_id)
        self._recent_s[place.user_id] = seconds if before is None else (before + seconds) / 2
