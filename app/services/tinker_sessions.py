"""Tinker's sessions and ids (docs/TINKER.md): a ServiceClient's session, and the model ids
(`{session}:train:{n}`) and sampling-session ids (`{session}:sample:{n}`) it names, each mapped to a Signal run.
The ids are the SDK's own scheme (it derives a model id itself to resume), longer than a run id: hence a table."""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Mapping
from datetime import timedelta

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from app.db import Database
from app.errors import BadInput, NotFound
from app.tables import NAME_LENGTH, TINKER_ID_LENGTH, Run, TinkerModel, TinkerSession, User, utcnow
from gpu_runtime.errors import Cancelled, FailedPrecondition

# Set while the Tinker adapter makes a call: its calls on the run are the session's own.
tinker_call: contextvars.ContextVar[bool] = contextvars.ContextVar("tinker_call", default=False)
READS = {"sample", "forward", "save_weights_for_sampler"}  # freezing weights changes nothing either

FINISHED = "finished"


class SessionFinished(Exception):
    """A finished session's heartbeat (410) or operation (refused)."""


class SessionEnded(Cancelled):
    """A pending operation of a session that ended (closed, or its heartbeats lapsed): the future fails with it."""


class TinkerSessions:
    def __init__(self, db: Database, lapse_s: float = 120.0) -> None:
        self.db = db
        # A session drives its runs while it heartbeats and has not finished (SIGNAL_TINKER_SESSION_LAPSE_S).
        self.lapse = timedelta(seconds=lapse_s)

    async def create(self, user: User, display_name: str | None, user_metadata: Mapping[str, object] | None) -> str:
        session_id = uuid.uuid4().hex  # 32 characters: ids built on it stay well under TINKER_ID_LENGTH
        async with self.db.session() as session:
            session.add(TinkerSession(id=session_id, user_id=user.id, display_name=(display_name or "")[:NAME_LENGTH],
                                      user_metadata=dict(user_metadata) if isinstance(user_metadata, Mapping) else {}))
        return session_id

    async def get(self, user: User, session_id: str) -> TinkerSession:
        async with self.db.session() as session:
            row = await session.get(TinkerSession, session_id) if 0 < len(session_id) <= 64 else None
        if row is None or row.user_id != user.id:
            raise NotFound(f"session {session_id!r} not found", field="session_id")
        return row

    async def open(self, user: User, session_id: str) -> TinkerSession:
        """The caller's session, refusing a finished one (its operations are refused, its heartbeats get 410)."""
        row = await self.get(user, session_id)
        if row.finished_at is not None:
            raise SessionFinished(session_id)
        return row

    async def heartbeat(self, user: User, session_id: str) -> None:
        await self.open(user, session_id)
        async with self.db.session() as session:
            await session.execute(update(TinkerSession).where(TinkerSession.id == session_id)
                                  .values(heartbeat_at=utcnow()))

    async def finish(self, user: User, session_id: str) -> None:
        await self.get(user, session_id)
        async with self.db.session() as session:
            await session.execute(update(TinkerSession).where(TinkerSession.id == session_id,
                                                               TinkerSession.finished_at.is_(None))
                                  .values(finished_at=utcnow()))

    async def alive(self, session_id: str) -> None:
        """A pending future's check (TinkerFutures): SessionEnded once its session is closed or its heartbeats have
        lapsed; a session this server does not know (none yet) is left alone."""
        async with self.db.session() as session:
            row = await session.get(TinkerSession, session_id) if 0 < len(session_id) <= 64 else None
        if row is None:
            return
        if row.finished_at is not None:
            raise SessionEnded(f"session {session_id} was closed: this operation was stopped")
        if row.heartbeat_at < utcnow() - self.lapse:
            raise SessionEnded(f"session {session_id} sent no heartbeat for {self.lapse.total_seconds():g} s: "
                               "this operation was stopped")

    async def map(self, user: User, tinker_id: str, session_id: str, kind: str, run_id: str | None,
                  base_model: str, model_path: str | None = None) -> TinkerModel:
        """Record that `tinker_id` names `run_id`; a resubmission finds the first mapping and keeps it."""
        if len(tinker_id) > TINKER_ID_LENGTH:
            raise BadInput(f"id {tinker_id[:40]!r}… is over {TINKER_ID_LENGTH} characters", field="session_id")
        row = TinkerModel(id=tinker_id, session_id=session_id, user_id=user.id, kind=kind, run_id=run_id,
                          base_model=base_model, model_path=model_path)
        try:
            async with self.db.session() as session:
                session.add(row)
        except IntegrityError:
            return await self.model(user, tinker_id, kind)
        return row

    async def model(self, user: User, tinker_id: str, kind: str = "train", live: bool = False) -> TinkerModel:
        """The caller's model (kind "train") or sampling session (kind "sample"); another user's is not found.
        `live`: for an operation, which a finished session refuses (its paths stay readable and loadable)."""
        row, finished = None, None
        if 0 < len(tinker_id) <= TINKER_ID_LENGTH:
            async with self.db.session() as session:
                found = (await session.execute(
                    select(TinkerModel, TinkerSession.finished_at).join(
                        TinkerSession, TinkerSession.id == TinkerModel.session_id, isouter=True)
                    .where(TinkerModel.id == tinker_id))).first()
            if found is not None:
                row, finished = found
        if row is not None and row.user_id == user.id and live and finished is not None:
            raise SessionFinished(row.session_id)
        if row is None or row.user_id != user.id or row.kind != kind:
            what = "model" if kind == "train" else "sampling session"
            raise NotFound(f"{what} {tinker_id!r} not found", field="model_id" if kind == "train" else
                           "sampling_session_id")
        return row

    async def trained(self, tinker_id: str) -> TinkerModel | None:
        """Any user's training model by id, or None: only for reading a published checkpoint of it, whose own check
        (RunCalls.readable) decides; never an answer by itself."""
        if not 0 < len(tinker_id) <= TINKER_ID_LENGTH:
            return None
        async with self.db.session() as session:
            row = await session.get(TinkerModel, tinker_id)
        return row if row is not None and row.kind == "train" else None

    async def claim(self, run: Run, operation: str) -> None:
        """RunService's check before each primitive: Signal's own calls that change a run a live Tinker session drives
        are FAILED_PRECONDITION naming the session (two clients interleaving steps would corrupt each other's).
        Reads (sample, forward) change nothing and go on."""
        if tinker_call.get() or operation in READS:
            return
        async with self.db.session() as session:
            driver = await session.scalar(
                select(TinkerSession.id).join(TinkerModel, TinkerModel.session_id == TinkerSession.id)
                .where(TinkerModel.run_id == run.id, TinkerSession.finished_at.is_(None),
                       TinkerSession.heartbeat_at > utcnow() - self.lapse).limit(1))
        if driver is not None:
            raise FailedPrecondition(f"run {run.id} is driven by Tinker session {driver}; finish that session (or "
                                     "let it stop heartbeating) before calling it from Signal's API", field="runId")

    async def of_run(self, run_id: str) -> tuple[TinkerModel, TinkerSession] | None:
        """The Tinker model and session a run was created for, if it was (the run's page shows them)."""
        async with self.db.session() as session:
            found = (await session.execute(
                select(TinkerModel, TinkerSession).join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
                .where(TinkerModel.run_id == run_id, TinkerModel.kind == "train").limit(1))).first()
        return (found[0], found[1]) if found is not None else None

    async def models(self, user: User, limit: int, offset: int) -> tuple[list[TinkerModel], int]:
        """The caller's training models, newest first, and how many there are."""
        query = select(TinkerModel).where(TinkerModel.user_id == user.id, TinkerModel.kind == "train")
        async with self.db.session() as session:
            total = await session.scalar(select(func.count()).select_from(query.subquery()))
            rows = await session.scalars(query.order_by(TinkerModel.created_at.desc()).limit(limit).offset(offset))
            return list(rows), int(total or 0)


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampling_session_id(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


def session_of(tinker_id: str) -> str:
    """The session a model or sampling-session id belongs to."""
    return tinker_id.split(":", 1)[0]
