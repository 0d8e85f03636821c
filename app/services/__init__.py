"""The service layer: every rule of the product, shared by the GraphQL API, the CLI and the dashboard."""

from __future__ import annotations

from dataclasses import dataclass

from app.backends import Backend, make_backend
from app.catalog import Catalog
from app.db import Database
from app.events import EventBroker
from app.services.keys import KeyService
from app.services.runs import RunService
from app.services.users import UserService
from app.settings import Settings


@dataclass
class Services:
    settings: Settings
    db: Database
    backend: Backend
    catalog: Catalog
    broker: EventBroker
    users: UserService
    keys: KeyService
    runs: RunService

    @classmethod
    def build(cls, settings: Settings, backend: Backend | None = None) -> "Services":
        db = Database(settings.resolved_database_url)
        backend = backend or make_backend(settings)
        catalog = Catalog.from_file(settings.models_file)
        broker = EventBroker()
        return cls(
            settings=settings,
            db=db,
            backend=backend,
            catalog=catalog,
            broker=broker,
            users=UserService(db),
            keys=KeyService(db),
            runs=RunService(db, backend, catalog, broker, settings.default_model),
        )

    async def close(self) -> None:
        await self.backend.close()
        await self.db.dispose()
