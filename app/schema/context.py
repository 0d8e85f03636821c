"""Per-request GraphQL context: the services and the caller, authenticated from the API key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strawberry.types import Info as StrawberryInfo
from strawberry.types.nodes import SelectedField

from app.services import Services
from app.tables import User


@dataclass
class Context:
    services: Services
    bearer: str | None
    request: Any = None
    response: Any = None
    connection_params: dict[str, Any] | None = None
    _user: User | None = field(default=None, repr=False)

    async def user(self) -> User:
        """The caller; raises UNAUTHENTICATED when the key is missing, unknown or revoked."""
        if self._user is None:
            self._user = await self.services.keys.authenticate(self.bearer)
        return self._user


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


def bearer_from_header(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def bearer_from_connection_params(params: dict[str, Any] | None) -> str | None:
    """graphql-transport-ws clients send the key as `Authorization`, `authorization` or `apiKey`."""
    if not isinstance(params, dict):
        return None
    for key in ("Authorization", "authorization"):
        if isinstance(params.get(key), str):
            return bearer_from_header(params[key])
    value = params.get("apiKey") or params.get("api_key")
    return value if isinstance(value, str) and value else None
