"""Subscriptions: live training events of one run, over graphql-transport-ws."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import strawberry

from app.rechecked import rechecked
from app.schema.context import Info
from app.schema.runs import TrainingEvent


@strawberry.type
class Subscription:
    @strawberry.subscription(description="Each forward_backward and optim_step result of a run, as it happens. Ends "
                             "with UNAUTHENTICATED within SIGNAL_SESSION_RECHECK_S of its key being revoked, its "
                             "session ending or its user being disabled.")
    async def metrics(self, info: Info, run_id: strawberry.ID) -> AsyncGenerator[TrainingEvent, None]:
        # Checked afresh for each subscription: a socket opened with a key (or session) revoked since must not watch.
        credential, services = info.context.credential, info.context.services
        user = await credential.authenticate(services)
        # The ownership check lives in the service, shared with the dashboard's event stream.
        events = await services.live.events(user, str(run_id))

        async def check() -> None:
            await credential.authenticate(services)  # raises UNAUTHENTICATED once the key or its user is gone

        # And again while it streams, as the dashboard's event streams do: a revoked key must stop watching.
        async for event in rechecked(events, services.settings.session_recheck_s, check):
            yield TrainingEvent.from_event(event)
