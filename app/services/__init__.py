"""The service layer: every rule of the product, shared by the GraphQL API, the CLI and the dashboard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from starlette.requests import HTTPConnection

from app.backends import Backend, make_backend
from app.catalog import Catalog
from app.db import Database
from app.events import EventBroker, MetricFeed
from app.services.admin import AdminService
from app.services.billing import BillingClient
from app.services.dashboard import DashboardService
from app.services.keys import KeyService
from app.services.ledger import Ledger, Rates
from app.services.live import LiveMetrics
from app.services.login_links import LoginLinkService
from app.services.playground_streams import PlaygroundStreams
from app.services.run_form import RunForm
from app.services.runs import RunService
from app.services.sample_shares import SampleShares
from app.services.sessions import SessionService
from app.services.stored_responses import StoredResponses
from app.services.tinker_futures import TinkerFutures
from app.services.tinker_sessions import TinkerSessions
from app.services.usage import UsageService
from app.services.users import UserService
from app.settings import Settings

if TYPE_CHECKING:  # imported when Supabase is configured: supabase_auth and jwt cost start-up 50 ms otherwise
    from app.services.supabase_signin import SupabaseSignIn


@dataclass
class Services:
    settings: Settings
    db: Database
    backend: Backend
    catalog: Catalog
    broker: EventBroker
    feed: MetricFeed  # fills the broker with every process's metric rows; started in the app's lifespan
    users: UserService
    keys: KeyService
    runs: RunService
    login_links: LoginLinkService
    sessions: SessionService  # the dashboard's signed-in browsers
    live: LiveMetrics
    dashboard: DashboardService
    tinker: TinkerFutures  # Tinker's futures (/api/v1, docs/TINKER.md)
    tinker_sessions: TinkerSessions
    usage: UsageService  # per run, day and user, from call_records (issue 18 §6)
    run_form: RunForm  # the dashboard's New run form: its choices, and its fields read into a RunSpec
    admin: AdminService  # every user, key and run, and the runtime's report (issue 18 §7)
    playground: PlaygroundStreams  # the playground's one-time stream ids (issue 18 §4)
    responses: StoredResponses  # /v1/responses' stored conversations, for previous_response_id (issue 35)
    supabase: SupabaseSignIn | None = None  # only when SUPABASE_URL and SUPABASE_ANON_KEY are set
    # Shared by the Supabase client and the JWKS fetches; made only for them (its TLS context costs start-up 0.1 s).
    http: httpx.AsyncClient | None = None
    billing: BillingClient | None = None  # only when FRONTIER_BACKEND_URL is set

    @classmethod
    def build(cls, settings: Settings, backend: Backend | None = None) -> Services:
        db = Database(settings.resolved_database_url, settings.db_lock_timeout_s, settings.db_statement_timeout_s)
        backend = backend or make_backend(settings)
        catalog = Catalog.from_file(settings.models_file)
        broker = EventBroker()
        feed = MetricFeed(db, broker)
        users = UserService(db)
        keys = KeyService(db)
        billing = BillingClient(settings, db) if settings.billing_enabled else None
        runs = RunService(db, backend, catalog, feed, settings.default_model, Ledger(db, Rates.of(settings), billing),
                          settings.runtime_options(), settings.record_retry_s, settings.deadlines_s)
        tinker = TinkerFutures(db, settings.tinker_poll_s, settings.tinker_result_ttl_s, settings.session_recheck_s)
        tinker.chores.append(runs.delete_expired)  # Tinker's ttl_seconds: expired checkpoints, files and rows
        tinker_sessions = TinkerSessions(db, settings.tinker_session_lapse_s)
        tinker.alive = tinker_sessions.alive  # a session's end reaches its pending futures, as a revoked key does
        runs.shares = SampleShares(settings.max_user_samples_in_flight)  # one bound for every wire's samples
        runs.claim = tinker_sessions.claim  # Signal's own calls on a run a live Tinker session drives are refused
        http = supabase = None
        if settings.supabase_enabled:
            from app.services.supabase_signin import SupabaseSignIn
            from app.services.supabase_tokens import SupabaseTokenVerifier

            http = httpx.AsyncClient(timeout=15)
            verifier = SupabaseTokenVerifier(settings.supabase_url, http, settings.supabase_jwt_secret)
            supabase = SupabaseSignIn(db, users, verifier, http, settings.supabase_url, settings.supabase_anon_key,
                                      settings.admin_email_set)
        return cls(
            settings=settings,
            db=db,
            backend=backend,
            catalog=catalog,
            broker=broker,
            feed=feed,
            users=users,
            keys=keys,
            runs=runs,
            login_links=LoginLinkService(db, settings.login_link_ttl_s),
            sessions=SessionService(db, settings.session_ttl_s),
            live=LiveMetrics(db, broker, runs, settings.live_poll_s),
            dashboard=DashboardService(db, backend, broker, runs, settings.data_dir),
            tinker=tinker,
            tinker_sessions=tinker_sessions,
            usage=UsageService(db),
            run_form=RunForm(settings, catalog, runs),
            admin=AdminService(db, backend, users, keys, catalog),
            playground=PlaygroundStreams(db),
            responses=StoredResponses(db, settings.openai_responses_ttl_s),
            supabase=supabase,
            http=http,
            billing=billing,
        )

    async def close(self) -> None:
        await self.tinker.close()
        await self.feed.close()
        if self.billing is not None:
            await self.billing.close()
        if self.http is not None:
            await self.http.aclose()
        await self.backend.close()
        await self.db.dispose()


def services_of(connection: HTTPConnection) -> Services:
    """The server's services from a request or websocket (set by app/server.py's lifespan): Starlette's state is
    untyped, so it is checked here once, for every wire and the dashboard."""
    found = connection.app.state.services
    if not isinstance(found, Services):
        raise RuntimeError("the server's services are not started (app.state.services is set by the lifespan)")
    return found
