"""Checkpoints (RunCheckpoints): sampler snapshots and saved states, loading one into a run, deleting one, and
exporting one's files (docs/CHECKPOINTS.md)."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.errors import BadInput, NotFound, RunNotFound
from app.services.call_order import Numbered
from app.services.run_calls import RunCalls, pool_of
from app.tables import Checkpoint, Run, User, could_be_id, row_number, utcnow
from gpu_runtime.contract import (
    CheckpointRef,
    DeleteCheckpoint,
    ExportCheckpoint,
    LoadState,
    LoadStateResult,
    SaveState,
    SaveStateResult,
    SaveWeightsForSampler,
    SaveWeightsForSamplerResult,
    checkpoint_ref,
)


class RunCheckpoints:
    def __init__(self, calls: RunCalls) -> None:
        self.calls = calls

    async def save_weights_for_sampler(self, user: User, run_id: str, name: str | None = None,
                                       request_id: str | None = None,
                                       order: Numbered | None = None) -> SaveWeightsForSamplerResult:
        """Freeze the run's weights as they are after its calls before this one (in the run's order). A named
        snapshot gets a `checkpoints` row (mode "sampler"), so it is listed and downloadable; an unnamed one gets a
        row with its expiry, dropped by listing once it is past."""

        async def record(session: AsyncSession, run: Run, result: SaveWeightsForSamplerResult,
                         fresh: bool) -> SaveWeightsForSamplerResult:
            row = await session.scalar(select(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.mode == "sampler", Checkpoint.name == result.name))
            if row is None:
                row = Checkpoint(run_id=run.id, mode="sampler", name=result.name)
                session.add(row)
            row.step, row.path, row.size_bytes = result.step, result.path, result.size_bytes
            expires = result.expires_in_seconds
            row.expires_at = None if expires is None else utcnow() + timedelta(seconds=float(expires))
            return result

        return await self.calls.apply(user, run_id, "save_weights_for_sampler", request_id,
                                 lambda run: SaveWeightsForSampler(run_id=run.id, name=name), record, order=order)

    async def save_state(self, user: User, run_id: str, mode: str = "adapter", push_to_hub: bool = False,
                         hub_model_id: str | None = None, request_id: str | None = None,
                         hf_token: str | None = None, name: str | None = None,
                         with_optimizer: bool | None = None, order: Numbered | None = None,
                         overwrite: bool = False) -> Checkpoint:
        """Export the run; with push_to_hub, the runtime also uploads it (private) with the user's `hf_token`,
        which travels as this one call's argument and is stored nowhere. With billing on and no `hf_token`, the
        token is the user's Hugging Face integration, fetched from the billing service now (docs/BILLING.md). An existing
        name is refused unless `overwrite` (Tinker's save_weights), which replaces it atomically."""
        billing = self.calls.ledger.billing

        def arguments(run: Run) -> SaveState:
            if push_to_hub and not (hub_model_id or "").strip():
                raise BadInput("pushToHub needs hubModelId (e.g. 'your-name/my-adapter')", field="hubModelId")
            return SaveState(run_id=run.id, mode=mode, name=name, with_optimizer=with_optimizer, overwrite=overwrite)

        async def hub() -> dict[str, object]:
            """The push's arguments, once the call is allowed: the user's token is fetched only for a call that runs."""
            token = hf_token
            if not push_to_hub:
                return {}
            if not (token or "").strip() and billing is not None:
                token = await billing.hf_token(user.id)
            if not (token or "").strip():
                integration = "; the billing service has no Hugging Face integration for you" if billing else ""
                raise BadInput(f"pushToHub needs hfToken: a Hugging Face token with write access{integration}",
                               field="hfToken")
            return {"push_to_hub": True, "hub_model_id": hub_model_id, "hf_token": token}

        async def record(session: AsyncSession, run: Run, result: SaveStateResult, fresh: bool) -> Checkpoint:
            # One row per run, kind and name, written on a retry too: saving step-N again at the same step (a new
            # call) rewrites it, and the answer is that row.
            checkpoint = await session.scalar(select(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.mode == result.mode,
                Checkpoint.name == result.name).limit(1))
            if checkpoint is None:
                checkpoint = Checkpoint(run_id=run.id, path=result.checkpoint_path, name=result.name)
                session.add(checkpoint)
            checkpoint.path = result.checkpoint_path
            checkpoint.step, checkpoint.mode = result.step, result.mode
            checkpoint.size_bytes = result.size_bytes
            checkpoint.hub_url = (result.hub["url"] if result.hub else None) or checkpoint.hub_url
            checkpoint.with_optimizer = result.with_optimizer
            checkpoint.pending_excluded = result.pending_excluded
            await session.flush()  # its id, for the answer
            return checkpoint

        return await self.calls.apply(user, run_id, "save_state", request_id, arguments, record, allowed=hub, order=order)

    async def load_state(self, user: User, run_id: str, checkpoint: str, with_optimizer: bool = True,
                         request_id: str | None = None, order: Numbered | None = None) -> LoadStateResult:
        """A checkpoint of this run, or of another run of the same user, into this run (docs/CHECKPOINTS.md): its
        adapter, with_optimizer its AdamW, and its step either way. Another user's checkpoint is NOT_FOUND."""
        run = await self.calls.get(user, run_id)
        ref = checkpoint_ref(checkpoint, "checkpoint", run.id)
        await self.checkpoint_row(user, ref, "checkpoint")

        async def record(session: AsyncSession, run: Run, result: LoadStateResult, fresh: bool) -> LoadStateResult:
            if fresh:  # the step is the checkpoint's: it may go back
                await session.execute(update(Run).where(Run.id == run.id).values(step=result.step))
            return result

        return await self.calls.apply(user, run_id, "load_state", request_id,
                                 lambda run: LoadState(run_id=run.id, checkpoint=ref.path, with_optimizer=with_optimizer),
                                 record, order=order)

    async def delete_checkpoint(self, user: User, run_id: str, checkpoint_id: str) -> None:
        """A checkpoint's (or a sampler snapshot's) files in the runtime, then its row."""
        run = await self.calls.get(user, run_id)
        async with self.calls.db.session() as session:
            number = row_number(str(checkpoint_id))  # 99999999999999999999999 overflows BIGINT: not found, not a 500
            row = await session.get(Checkpoint, number) if number is not None else None
        if row is None or row.run_id != run.id:
            raise NotFound(f"checkpoint {checkpoint_id} of run {run_id!r} not found", field="checkpointId")

        async def work(ticket: int, sent: Callable[[], None]) -> None:
            try:  # after the run's calls before it (a save_state of this checkpoint's name)
                await self.calls.engine(DeleteCheckpoint(run_id=run.id, mode=row.mode, name=row.name), pool=pool_of(run),
                                   ticket=ticket, sent=sent)
            except NotFound:
                pass  # its files are already gone (a delete half done): remove the row anyway
            async with self.calls.db.session() as session:
                await session.execute(delete(Checkpoint).where(Checkpoint.id == row.id))

        await self.calls.in_order(run.id, work)

    async def set_expiry(self, user: User, run_id: str, mode: str, name: str, seconds: float | None) -> datetime | None:
        """A checkpoint's expiry (Tinker's ttl_seconds), from now, or none (None: kept until deleted): once past, it is
        unlisted, and deleted, files and row, by `delete_expired` (the Tinker futures' housekeeping runs it). An
        expired, unknown or another user's checkpoint is NOT_FOUND alike."""
        run = await self.calls.get(user, run_id)
        expires_at = None if seconds is None else utcnow() + timedelta(seconds=seconds)
        async with self.calls.db.session() as session:
            changed = await session.execute(update(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.mode == mode, Checkpoint.name == name,
                or_(Checkpoint.expires_at.is_(None), Checkpoint.expires_at > utcnow())).values(expires_at=expires_at))
        if not getattr(changed, "rowcount", 0):
            raise NotFound(f"checkpoint {mode}/{name} of run {run_id!r} not found", field="checkpoint_id")
        return expires_at

    async def set_public(self, user: User, run_id: str, mode: str, name: str, public: bool) -> None:
        """Publish (or unpublish) the caller's checkpoint: published, any signed-in user may read it by its path
        (RunCalls.readable); only its owner may change that. Idempotent: publishing a public one again is no error
        (Tinker's 409 would be retried by the SDK for minutes). Another user's, or none, is NOT_FOUND alike."""
        run = await self.calls.get(user, run_id)
        async with self.calls.db.session() as session:
            changed = await session.execute(update(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.mode == mode, Checkpoint.name == name,
                or_(Checkpoint.expires_at.is_(None), Checkpoint.expires_at > utcnow())).values(public=public))
        if not getattr(changed, "rowcount", 0):
            raise NotFound(f"checkpoint {mode}/{name} of run {run_id!r} not found", field="checkpoint_id")

    async def storage(self, user: User) -> tuple[int, int]:
        """The user's stored checkpoints (every run, unexpired): how many, and their bytes."""
        async with self.calls.db.session() as session:
            count, total = (await session.execute(
                select(func.count(Checkpoint.id), func.coalesce(func.sum(Checkpoint.size_bytes), 0))
                .join(Run, Run.id == Checkpoint.run_id).where(
                    Run.user_id == user.id, or_(Checkpoint.expires_at.is_(None), Checkpoint.expires_at > utcnow())))).one()
        return int(count), int(total)

    async def delete_expired(self, most: int = 32) -> int:
        """Delete up to `most` checkpoints past their expiry, each as its owner would; returns how many."""
        async with self.calls.db.session() as session:
            rows = (await session.execute(select(Checkpoint.id, Run.id, User).join(Run, Run.id == Checkpoint.run_id)
                                          .join(User, User.id == Run.user_id)
                                          .where(Checkpoint.expires_at < utcnow()).limit(most))).all()
        for checkpoint_id, run_id, owner in rows:
            with contextlib.suppress(NotFound):  # deleted meanwhile (by its owner, or another process's sweep)
                await self.delete_checkpoint(owner, run_id, str(checkpoint_id))
        return len(rows)

    async def checkpoint_row(self, user: User, ref: CheckpointRef, field: str) -> tuple[Run, Checkpoint]:
        """The caller's run and checkpoint a reference names; another user's, or none, is NOT_FOUND alike."""
        async with self.calls.db.session() as session:
            run = await session.get(Run, ref.run_id) if could_be_id(ref.run_id) else None
            row = None if run is None or run.user_id != user.id else await session.scalar(select(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.mode == ref.kind, Checkpoint.name == ref.name).limit(1))
        if run is None or row is None:
            raise NotFound(f"checkpoint {ref.path} not found", field=field)
        return run, row

    async def checkpoint_archive(self, run_id: str, mode: str, step: int, name: str | None = None) -> bytes:
        """A checkpoint's files as .tar.gz bytes, from the runtime that holds them (the caller checked ownership)."""
        async with self.calls.db.session() as session:
            run = await session.get(Run, run_id)
        if run is None:
            raise RunNotFound(f"run {run_id!r} not found", field="runId")
        archive = await self.calls.engine(ExportCheckpoint(run_id=run_id, mode=mode, step=step, name=name), pool=pool_of(run))
        return base64.b64decode(archive.archive_b64)
