"""Subscriptions: live training events of one run, over graphql-transport-ws."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import strawberry

from app.schema.context import Info
from app.schema.types import TrainingEvent


@strawberry.type
class Subscription:
    @strawberry.subscription(description="Each forward_backward and optim_step result of a run, as it happens")
    async def metrics(self, info: Info, run_id: strawberry.ID) -> AsyncGenerator[TrainingEvent, None]:
        # Checked afresh for each subscription: a socket opened with a key (or session) revoked since must not watch.
        user = await info.context.credential.authenticate(info.context.services)
        # The ownership check lives in the service, shared with the dashboard's event stream.
        async for event in await info.context.services.live.events(user, str(run_id)):
            yield TrainingEvent.from_event(event)
