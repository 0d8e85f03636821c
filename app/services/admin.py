"""The admin's view (issue 18 §7): users with their run and key counts, live keys across users, runs across users
with what the runtime holds of each now, and the runtime's own report per pool (bases, queue depth per user, recent
ticks). Every read and action checks `require_admin` first; a run's metrics and samples stay its owner's (no run
page, no history here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select

from app.backends import Backend
from app.catalog import Catalog
from app.db import Database
from app.services.keys import KeyService
from app.services.runs import FAILED
from app.services.users import UserService, require_admin
from app.tables import ApiKey, Run, User
from gpu_runtime.contract import RuntimeState

ADMIN_RUNS_SHOWN = 200  # the runs table lists the most recently active ones; the count above it says how many exist
RESIDENT, EVICTED = "resident", "evicted"


@dataclass(frozen=True)
class UserLine:
    user: User
    runs: int
    keys: int  # live (unrevoked) API keys


@dataclass(frozen=True)
class KeyLine:
    key: ApiKey
    owner: str  # the owner's email


@dataclass(frozen=True)
class RunLine:
    run: Run
    owner: str  # the owner's email
    residency: str  # RESIDENT, EVICTED, or "" when the runtime holds neither (not loaded since it started)


@dataclass(frozen=True)
class Tick:
    """One recent tick of a pool, as the chart draws it."""

    number: int
    rows: int  # forward_backward rows and decode rows
    passes: int  # base forward+backward passes and decode passes
    seconds: float


@dataclass
class PoolReport:
    """One runtime's answer to runtime_state: the local runtime, or one Modal pool."""

    name: str
    error: str = ""  # the pool did not answer
    device: str = ""
    threads: int | None = None  # torch's CPU threads in the runtime, as it reports them (SIGNAL_THREADS)
    bases: list[dict[str, Any]] = field(default_factory=list)  # the runtime's, each with its catalogue "model" added
    queue: list[tuple[str, int, int]] = field(default_factory=list)  # (owner's email, calls queued, calls refused)
    ticks: list[Tick] = field(default_factory=list)  # oldest first
    totals: dict[str, int] = field(default_factory=dict)
    resident_bytes: int = 0
    budget_bytes: int = 0

    @property
    def tick_series(self) -> dict[str, list[float]]:
        """The ticks as columns, as the chart takes them (x: the tick's number)."""
        return {"number": [t.number for t in self.ticks], "rows": [t.rows for t in self.ticks],
                "passes": [t.passes for t in self.ticks], "seconds": [t.seconds for t in self.ticks]}


@dataclass
class AdminView:
    backend: str
    worker_pid: int | None
    users: list[UserLine]
    keys: list[KeyLine]
    runs: list[RunLine]
    runs_total: int
    runs_failed: int
    resident: int | None = None  # None: the runtime did not answer
    evicted: int | None = None
    pools: list[PoolReport] = field(default_factory=list)
    runtime_error: str = ""


class AdminService:
    def __init__(self, db: Database, backend: Backend, users: UserService, keys: KeyService,
                 catalog: Catalog) -> None:
        self.db = db
        self.backend = backend
        self.catalog = catalog
        self.users = users
        self.keys = keys

    async def view(self, actor: User, with_runtime: bool = True) -> AdminView:
        """Users, keys and runs from the database; with `with_runtime`, the runtime's report and where each run is."""
        require_admin(actor, "see every user and run")
        async with self.db.session() as session:
            users = list(await session.scalars(select(User).order_by(User.created_at)))
            runs_of = dict((await session.execute(select(Run.user_id, func.count()).group_by(Run.user_id))).all())
            live = select(ApiKey).where(ApiKey.revoked_at.is_(None))
            keys = list(await session.scalars(live.order_by(ApiKey.created_at.desc())))
            by_status = dict((await session.execute(select(Run.status, func.count()).group_by(Run.status))).all())
            runs = list(await session.scalars(select(Run).order_by(Run.updated_at.desc(), Run.id)
                                              .limit(ADMIN_RUNS_SHOWN)))
        email = {user.id: user.email for user in users}
        keys_of: dict[str, int] = {}
        for key in keys:
            keys_of[key.user_id] = keys_of.get(key.user_id, 0) + 1
        view = AdminView(
            backend=self.backend.label,
            worker_pid=getattr(getattr(self.backend, "client", None), "pid", None),
            users=[UserLine(user, int(runs_of.get(user.id, 0)), keys_of.get(user.id, 0)) for user in users],
            keys=[KeyLine(key, email.get(key.user_id, key.user_id)) for key in keys],
            runs=[], runs_total=sum(by_status.values()), runs_failed=int(by_status.get(FAILED, 0)))
        where: dict[str, str] = {}
        state = await self._runtime_state(view) if with_runtime else None
        if state is not None:
            view.pools = [_pool(name, answer, email, self._model_names()) for name, answer in _pools(state)]
            for _, answer in _pools(state):
                for resident in answer.get("resident_runs", []):
                    where[resident["run_id"]] = RESIDENT
                for run_id in answer.get("evicted_runs", []):
                    where.setdefault(run_id, EVICTED)
            view.resident = sum(1 for held in where.values() if held == RESIDENT)
            view.evicted = sum(1 for held in where.values() if held == EVICTED)
        view.runs = [RunLine(run, email.get(run.user_id, run.user_id), where.get(run.id, "")) for run in runs]
        return view

    async def _runtime_state(self, view: AdminView) -> dict[str, Any] | None:
        if not self.backend.ready:
            view.runtime_error = "the runtime is still starting"
            return None
        try:
            return (await self.backend.call(RuntimeState())).state
        except Exception as error:  # noqa: BLE001 - the admin page must render even when the runtime is down
            view.runtime_error = f"{type(error).__name__}: {error}"
            return None

    def _model_names(self) -> dict[str, str]:
        """What the runtime loaded (a model's local path, or its hub id) -> the catalogue's name for it."""
        return {model.source: model.name for model in self.catalog.list()}

    async def revoke_key(self, actor: User, key_id: str) -> ApiKey:
        """Any user's key, at once: its next request is UNAUTHENTICATED."""
        return await self.keys.revoke_any(actor, key_id)

    async def set_disabled(self, actor: User, user_id: str, disabled: bool) -> User:
        """Disabling signs the user out everywhere and stops their keys (UserService.set_disabled)."""
        return await self.users.set_disabled(actor, user_id, disabled)


def _pools(state: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Each runtime in a runtime_state answer: Modal's pools (an answer each), or the one local runtime."""
    if "pools" in state:
        return [(name, answer if isinstance(answer, dict) else {"message": str(answer)})
                for name, answer in sorted(state["pools"].items())]
    return [("local", state)]


def _base(base: dict[str, Any], models: dict[str, str]) -> dict[str, Any]:
    """A base as the runtime reports it, plus the model's catalogue name: the runtime's key is what it loaded (a
    path, for a local model) with "#<quantization>" for a quantized copy. A model no longer catalogued keeps it."""
    loaded = str(base["name"]).split("#", 1)[0]
    return {**base, "model": models.get(loaded, loaded)}


def _pool(name: str, answer: dict[str, Any], email: dict[str, str], models: dict[str, str]) -> PoolReport:
    if "bases" not in answer:  # an error in place of a state
        return PoolReport(name, error=str(answer.get("message") or answer))
    ticks = answer.get("ticks", {})
    refused = answer.get("calls_refused", {})
    queued = answer.get("queue_depth", {})
    return PoolReport(
        name, device=str(answer.get("device", "")), threads=answer.get("threads"), bases=[_base(base, models) for base in answer["bases"]],
        queue=[(email.get(user, user), int(queued.get(user, 0)), int(refused.get(user, 0)))
               for user in sorted({*queued, *refused}, key=lambda u: email.get(u, u))],
        ticks=[Tick(int(t["number"]), int(t["fb_rows"]) + int(t["decode_rows"]),
                    int(t["base_passes"]) + int(t["decode_passes"]), float(t["seconds"]))
               for t in ticks.get("recent", [])],
        totals={"ticks": int(ticks.get("count", 0)), "base passes": int(ticks.get("base_passes", 0)),
                "forward_backward rows": int(ticks.get("fb_rows", 0)),
                "decode passes": int(ticks.get("decode_passes", 0)),
                "evictions": int(answer.get("evictions", 0)), "snapshots": int(answer.get("snapshots", 0))},
        resident_bytes=int(answer.get("resident_bytes", 0)),
        budget_bytes=int(answer.get("budget", {}).get("bytes", 0)))
