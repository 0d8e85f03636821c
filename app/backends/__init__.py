"""GPU runtimes the server can drive. Each speaks the engine contract of DESIGN.md as plain data."""

from __future__ import annotations

from typing import Any, Protocol

from app.settings import Settings


class Backend(Protocol):
    @property
    def ready(self) -> bool: ...  # the runtime answers calls (until then they wait)

    async def start(self) -> None: ...  # begins starting the runtime; returns at once

    async def call(self, method: str, **params: Any) -> dict[str, Any]: ...

    async def close(self) -> None: ...


def make_backend(settings: Settings) -> Backend:
    if settings.backend == "local":
        from app.backends.local import LocalBackend

        return LocalBackend(settings)
    raise ValueError(f"SIGNAL_BACKEND={settings.backend!r} is not available; this server has: local")
