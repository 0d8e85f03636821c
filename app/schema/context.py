"""Per-request GraphQL context: the services and the caller's credential (an API key, or a dashboard session that
web/graphiql.py admits only with its CSRF token)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from strawberry.types import Info as StrawberryInfo
from strawberry.types.nodes import SelectedField

from app.errors import Unauthenticated
from app.services import Services
from app.services.streams import gone, hold
from app.tables import User


@dataclass(frozen=True)
class Credential:
    """What a caller presents: an API key (`bearer`), else a dashboard session's id. A key always wins."""

    bearer: str | None = None
    session_id: str | None = None

    async def authenticate(self, services: Services) -> User:
        """The caller, checked now; UNAUTHENTICATED when the key or session is missing, unknown, revoked or ended."""
        if self.bearer is None and self.session_id is not None:
            live = await services.sessions.live(self.session_id, touch=False)
            if live is None:
                raise Unauthenticated("your dashboard session has ended; sign in again, or send an API key")
            return live.user
        return await services.keys.authenticate(self.bearer)


@dataclass
class Context:
    services: Services
    credential: Credential
    request: Any = None
    response: Any = None
    connection_params: dict[str, Any] | None = None
    _user: User | None = field(default=None, repr=False)
    _gone: asyncio.Future[None] | None = field(default=None, repr=False)

    async def user(self) -> User:
        """The caller; raises UNAUTHENTICATED when the key is missing, unknown or revoked."""
        if self._user is None:
            self._user = await self.credential.authenticate(self.services)
        return self._user

    def gone(self) -> asyncio.Future[None]:
        """Done once the HTTP client has gone away: one watch of the request's ASGI `receive` (its body already read,
        what comes next is `http.disconnect`, at the latest when the response is sent), shared by its fields. Over a
        websocket, never done."""
        if self._gone is None:
            request = self.request
            self._gone = hold(gone(request.receive)) if isinstance(request, Request) else \
                asyncio.get_running_loop().create_future()
        return self._gone


Info = StrawberryInfo[Context, None]


def selects(info: Info, name: str) -> bool:
    """Whether the client selected `name` under the field being resolved (through fragments, honouring @include
    and @skip): lets a resolver skip work whose result nobody reads (forwardBackward's per-position outputs)."""

    def included(directives: dict[str, Any]) -> bool:
        return bool(directives.get("include", {}).get("if", True)) and not directives.get("skip", {}).get("if", False)

    def walk(selections: list[Any]) -> bool:
        for selection in selections:
            if not included(selection.directives):
                continue
            if isinstance(selection, SelectedField):
                if selection.name == name:
                    return True
            elif walk(selection.selections):  # an inline fragment or a fragment spread
                return True
        return False

    return any(walk(field.selections) for field in info.selected_fields)
