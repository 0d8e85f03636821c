"""Runs and the four training primitives: the one place their rules live.

GraphQL resolvers and dashboard handlers both call this. Every primitive goes through one skeleton (`_apply`):
ownership first (another user's run is "not found", never data), its arguments checked, the ledger's credit check,
then in the run's order (its lock and ticket) the runtime call, its compute seconds accounted, and its result
recorded.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import math
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import case, delete, select, update
from strawberry.utils.str_converters import to_camel_case

from app.backends import Backend
from app.catalog import Catalog
from app.db import Database
from app.errors import BadInput, RunNotFound
from app.events import MetricFeed
from app.services.ledger import Ledger
from app.services.users import require_admin
from app.tables import Checkpoint, Metric, Run, Sample, User, could_be_id, new_id, utcnow
from gpu_runtime.allocation import pool_key
from gpu_runtime.contract import ADAM_DEFAULTS, LORA_DEFAULTS, SAMPLE_DEFAULTS, adam_settings, lora_settings, parse_call

T = TypeVar("T")

FAILED = "failed"  # runs.status once the runtime no longer has the run (else "active", the column's default)


@dataclass
class RunSpec:
    """What createRun asks for; defaults and bounds are the engine contract's (gpu_runtime.contract)."""

    base_model: str | None = None  # None: the server's default model
    lora_r: int = LORA_DEFAULTS["r"]
    lora_alpha: float | None = None  # None: 2 * lora_r, the usual choice
    lora_dropout: float = LORA_DEFAULTS["dropout"]
    lora_target_modules: list[str] | None = None  # None: the model's attention projections
    learning_rate: float | None = None  # None: ADAM_DEFAULTS
    weight_decay: float | None = None
    grad_clip_norm: float | None = None
    seed: int = 0
    gpu_config: str | None = None
    quantization: str | None = None  # None | "8bit" | "4bit" (bitsandbytes)

    def lora(self) -> dict[str, Any]:
        """The run's LoRA settings, checked and filled by the contract; errors name createRun's field (`loraR`)."""
        lora = {"r": self.lora_r, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                "target_modules": self.lora_target_modules}
        with _fields_renamed(lambda field: "lora_" + field.removeprefix("lora.")):
            return lora_settings(lora)

    def adam(self) -> dict[str, float]:
        """The run's AdamW defaults for optim_step; errors name createRun's field (`learningRate`)."""
        adam = {"learning_rate": self.learning_rate, "weight_decay": self.weight_decay,
                "grad_clip_norm": self.grad_clip_norm}
        with _fields_renamed(lambda field: field.removeprefix("adam.")):
            return adam_settings(adam)

    def validate(self) -> None:
        self.lora()
        self.adam()
        if self.seed < 0:
            raise BadInput(f"seed must be >= 0, got {self.seed}", field="seed")


@dataclass
class SampleParams:
    prompts: list[str]
    max_tokens: int = SAMPLE_DEFAULTS["max_tokens"]
    temperature: float = SAMPLE_DEFAULTS["temperature"]
    top_p: float = SAMPLE_DEFAULTS["top_p"]
    top_k: int = SAMPLE_DEFAULTS["top_k"]
    stop: list[str] | None = None
    num_samples: int = SAMPLE_DEFAULTS["num_samples"]
    seed: int | None = None

    def engine_params(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "num_samples": self.num_samples,
            "seed": self.seed,
        }


class RunService:
    def __init__(self, db: Database, backend: Backend, catalog: Catalog, feed: MetricFeed,
                 default_model: str, ledger: Ledger) -> None:
        self.db = db
        self.ledger = ledger  # compute seconds, credits and the billing service (docs/BILLING.md)
        self.default_model = default_model
        self.backend = backend
        self.catalog = catalog
        self.feed = feed
        # Still needed beside tickets: a restarted runtime knows no ticket (its journal keeps none) and takes the first
        # it gets as the run's start, and results are recorded in the order calls finish. One call per run per process.
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._devices: dict[str, str] = {}  # pool → its runtime's device, for pricing base samples

    # ---- reading -------------------------------------------------------------------------

    async def get(self, user: User, run_id: str) -> Run:
        async with self.db.session() as session:
            run = await session.get(Run, run_id) if could_be_id(run_id) else None
        if run is None or run.user_id != user.id:
            raise RunNotFound(f"run {run_id!r} not found", field="runId")
        return run

    async def list(self, user: User, limit: int = 50) -> list[Run]:
        async with self.db.session() as session:
            rows = await session.scalars(
                select(Run).where(Run.user_id == user.id).order_by(Run.created_at.desc()).limit(_clamp(limit))
            )
            return list(rows)

    async def metrics(self, run: Run, name: str | None = None, limit: int = 1000) -> builtins.list[Metric]:
        query = select(Metric).where(Metric.run_id == run.id)
        if name:
            query = query.where(Metric.name == name)
        async with self.db.session() as session:
            newest = list(await session.scalars(query.order_by(Metric.id.desc()).limit(_clamp(limit, 10_000))))
        return newest[::-1]  # the latest `limit` rows, in the order they happened

    async def samples(self, run: Run, limit: int = 100) -> builtins.list[Sample]:
        async with self.db.session() as session:
            query = select(Sample).where(Sample.run_id == run.id).order_by(Sample.id.desc()).limit(_clamp(limit))
            return list(await session.scalars(query))

    async def checkpoints(self, run: Run) -> builtins.list[Checkpoint]:
        """The run's checkpoints and sampler snapshots; unnamed snapshots past their expiry are gone from the runtime,
        so they are not listed."""
        async with self.db.session() as session:
            query = select(Checkpoint).where(Checkpoint.run_id == run.id).order_by(Checkpoint.id)
            now = utcnow()
            return [row for row in await session.scalars(query)
                    if row.expires_at is None or _aware(row.expires_at) > now]

    # ---- the primitives ------------------------------------------------------------------

    async def create(self, user: User, spec: RunSpec) -> Run:
        spec.validate()
        model = self.catalog.get(spec.base_model or self.default_model)
        lora, adam = spec.lora(), spec.adam()
        # Checked to hold the model, quantized or not; then the quantization it was checked with.
        gpu_config = self.catalog.resolve_gpu(model, spec.gpu_config, spec.quantization, lora_r=lora["r"])
        quantization = self.catalog.resolve_quantization(model, spec.quantization)
        run_id = new_id()
        await self.ledger.allow_create(user, run_id, gpu_config, model.name)
        created = await self._engine(
            "create_run", pool=pool_key(model.name, gpu_config, quantization), run_id=run_id, user_id=user.id,
            base_model=model.source, lora=lora, seed=spec.seed, quantization=quantization,
        )
        lora["target_modules"] = created.get("target_modules", lora["target_modules"])
        run = Run(
            id=run_id,
            user_id=user.id,
            base_model=model.name,
            lora_config=lora,
            optimizer_config=adam,
            seed=spec.seed,
            gpu_config=gpu_config,
            device=str(created.get("device") or ""),
            quantization=quantization or "",
            trainable_params=int(created.get("trainable_params", 0)),
            total_params=int(created.get("total_params", 0)),
        )
        async with self.db.session() as session:
            session.add(run)
        return run

    async def forward_backward(
        self, user: User, run_id: str, batch: builtins.list[dict[str, Any]], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None,
    ) -> dict[str, Any]:
        def arguments(run: Run) -> dict[str, Any]:
            if not isinstance(batch, list) or not batch:
                raise BadInput("batch must be a non-empty list of examples", field="batch")
            return {"batch": batch, "loss_fn": loss_fn, "loss_fn_config": loss_fn_config}

        async def record(run: Run, result: dict[str, Any]) -> dict[str, Any]:
            if not result.get("replayed"):  # a retry of a call already applied and recorded: record nothing twice
                await self._record(run.id, result["step"], {
                    "loss": result["loss"], "num_tokens": result["num_tokens"], "num_examples": result["num_examples"],
                })
            return result

        return await self._apply(user, run_id, "forward_backward", request_id, arguments, record)

    async def optim_step(self, user: User, run_id: str, adam: dict[str, Any] | None = None,
                         request_id: str | None = None) -> dict[str, Any]:
        def arguments(run: Run) -> dict[str, Any]:
            overrides = {key: value for key, value in (adam or {}).items() if value is not None}
            return {"adam": {**ADAM_DEFAULTS, **run.optimizer_config, **overrides}}

        async def record(run: Run, result: dict[str, Any]) -> dict[str, Any]:
            if result.get("replayed"):
                return result  # its step was stored when it was applied; a later step may have followed
            step = int(result["step"])
            async with self.db.session() as session:
                # greatest(step, :s), portably: another server's later step may have been written first.
                await session.execute(update(Run).where(Run.id == run.id)
                                      .values(step=case((Run.step < step, step), else_=Run.step)))
            await self._record(run.id, result["step"], {
                "grad_norm": result["grad_norm"], "learning_rate": result["learning_rate"],
            })
            return result

        return await self._apply(user, run_id, "optim_step", request_id, arguments, record)

    async def sample(self, user: User, run_id: str | None, params: SampleParams, request_id: str | None = None,
                     snapshot: str | None = None, checkpoint: str | None = None, base_model: str | None = None,
                     store: bool | None = None) -> dict[str, Any]:
        """Sample a run's current weights (in the run's order, under its lock), a snapshot or checkpoint of it, or a
        base alone. Frozen sources (docs/SNAPSHOTS.md) take neither the run's lock nor a ticket: they wait for nothing
        on the run. `store` (None: true for current weights, false otherwise) keeps the samples in the run's history."""
        stored_params = {k: v for k, v in params.engine_params().items() if k != "prompts"}
        keep = store if store is not None else (run_id is not None and snapshot is None and checkpoint is None)

        async def record(run: Run, result: dict[str, Any]) -> dict[str, Any]:
            if result.get("replayed") or not keep:
                return result
            async with self.db.session() as session:
                for prompt, sequences in zip(params.prompts, result["sequences"]):
                    for sequence in sequences:
                        session.add(Sample(run_id=run.id, step=int(result.get("step", run.step)), prompt=prompt,
                                           output=sequence["text"], params=stored_params))
            return result

        if run_id is None:
            if snapshot is not None or checkpoint is not None:
                raise BadInput("snapshot and checkpoint name a run's weights: give runId too",
                               field="snapshot" if snapshot is not None else "checkpoint")
            return await self._sample_base(user, base_model, params, request_id)
        if base_model is not None:
            raise BadInput("baseModel samples the base alone: leave runId out", field="baseModel")
        if snapshot is None and checkpoint is None:
            return await self._apply(user, run_id, "sample", request_id, lambda run: params.engine_params(), record)
        source = {"snapshot": snapshot, "checkpoint": checkpoint}
        run = await self.get(user, run_id)
        with _fields_renamed(lambda field: field):
            parse_call("sample", {"run_id": run.id, **params.engine_params(), **source, "request_id": request_id})
        request_id = await self.ledger.allow(user, run, "sample", request_id)

        async def work() -> dict[str, Any]:
            result = await self._on_run(run, "sample", **params.engine_params(), **source, request_id=request_id)
            await self.ledger.account(run, "sample", request_id, result)
            return await record(run, result)

        return await asyncio.shield(asyncio.ensure_future(work()))  # recorded even if the caller goes away

    async def _sample_base(self, user: User, base_model: str | None, params: SampleParams,
                           request_id: str | None) -> dict[str, Any]:
        """The base alone: no run, so no lock, no ticket and no history; billed to the user (Ledger.account_user)."""
        model = self.catalog.get(base_model or self.default_model)
        gpu_config = self.catalog.resolve_gpu(model, None, None)
        pool = pool_key(model.name, gpu_config, None)
        engine_params = {**params.engine_params(), "base_model": model.source, "user_id": user.id}
        with _fields_renamed(lambda field: field):
            parse_call("sample", {**engine_params, "request_id": request_id})
        request_id = await self.ledger.allow_user(user, "sample", request_id, model.name, gpu_config)

        async def work() -> dict[str, Any]:
            result = await self._engine("sample", pool=pool, **engine_params, request_id=request_id)
            await self.ledger.account_user(user, "sample", request_id, result, await self._device(pool), gpu_config)
            return result

        return await asyncio.shield(asyncio.ensure_future(work()))

    async def _device(self, pool: str) -> str:
        """The device a pool's runtime computes on (its ping), asked once per pool: what a base sample is priced by."""
        if pool not in self._devices:
            self._devices[pool] = str((await self.backend.call("ping", pool=pool)).get("device") or "")
        return self._devices[pool]

    async def save_weights_for_sampler(self, user: User, run_id: str, name: str | None = None,
                                       request_id: str | None = None) -> dict[str, Any]:
        """Freeze the run's weights as they are after its calls before this one (in the run's order). A named
        snapshot gets a `checkpoints` row (mode "sampler"), so it is listed and downloadable; an unnamed one gets a
        row with its expiry, dropped by listing once it is past."""

        async def record(run: Run, result: dict[str, Any]) -> dict[str, Any]:
            async with self.db.session() as session:
                row = await session.scalar(select(Checkpoint).where(
                    Checkpoint.run_id == run.id, Checkpoint.mode == "sampler", Checkpoint.name == result["name"]))
                if row is None:
                    row = Checkpoint(run_id=run.id, mode="sampler", name=result["name"])
                    session.add(row)
                row.step, row.path, row.size_bytes = int(result["step"]), result["path"], int(result["size_bytes"])
                expires = result.get("expires_in_seconds")
                row.expires_at = None if expires is None else utcnow() + timedelta(seconds=float(expires))
            return result

        return await self._apply(user, run_id, "save_weights_for_sampler", request_id, lambda run: {"name": name},
                                 record)

    async def save_state(self, user: User, run_id: str, mode: str = "adapter", push_to_hub: bool = False,
                         hub_model_id: str | None = None, request_id: str | None = None,
                         hf_token: str | None = None) -> Checkpoint:
        """Export the run; with push_to_hub, the runtime also uploads it (private) with the user's `hf_token`,
        which travels as this one call's argument and is stored nowhere. With billing on and no `hf_token`, the
        token is the user's Hugging Face integration, fetched from the billing service now (docs/BILLING.md)."""
        billing = self.ledger.billing

        def arguments(run: Run) -> dict[str, Any]:
            if push_to_hub and not (hub_model_id or "").strip():
                raise BadInput("pushToHub needs hubModelId (e.g. 'your-name/my-adapter')", field="hubModelId")
            return {"mode": mode}

        async def hub() -> dict[str, Any]:
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

        async def record(run: Run, result: dict[str, Any]) -> Checkpoint:
            async with self.db.session() as session:
                # One row per checkpoint directory: saving again at the same step (a retry, say) rewrote it.
                checkpoint = await session.scalar(select(Checkpoint).where(
                    Checkpoint.run_id == run.id, Checkpoint.path == result["checkpoint_path"]).limit(1))
                if checkpoint is None:
                    checkpoint = Checkpoint(run_id=run.id, path=result["checkpoint_path"], name=f"step-{result['step']}")
                    session.add(checkpoint)
                checkpoint.step, checkpoint.mode = int(result["step"]), result["mode"]
                checkpoint.size_bytes = int(result["size_bytes"])
                checkpoint.hub_url = result.get("hub", {}).get("url") or checkpoint.hub_url
            return checkpoint

        return await self._apply(user, run_id, "save_state", request_id, arguments, record, allowed=hub)

    async def delete(self, user: User, run_id: str) -> None:
        run = await self.get(user, run_id)

        async def work() -> None:
            try:
                await self._engine("delete_run", pool=pool_of(run), run_id=run.id)
            except RunNotFound:
                pass  # its files are already gone (an earlier delete half done): remove the rows anyway
            async with self.db.session() as session:
                for table in (Metric, Sample, Checkpoint):
                    await session.execute(delete(table).where(table.run_id == run.id))
                await session.execute(delete(Run).where(Run.id == run.id))

        await self._serialised(run.id, work)
        self._locks.pop(run.id, None)

    # ---- the runtime ---------------------------------------------------------------------

    async def runtime_state(self, user: User) -> dict[str, Any]:
        """What the GPU runtime holds and does (bases, resident and evicted runs, queues, ticks): admins only,
        since it names every user's runs."""
        require_admin(user, "read the runtime's state")
        return await self.backend.call("runtime_state")

    # ---- one skeleton for the four primitives ----------------------------------------------

    async def _apply(self, user: User, run_id: str, operation: str, request_id: str | None,
                     arguments: Callable[[Run], dict[str, Any]], record: Callable[[Run, dict[str, Any]], Awaitable[T]],
                     allowed: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> T:
        """A primitive on the caller's run: its `arguments` checked (before anyone is asked about credits), the call
        allowed by the ledger, then in the run's order the runtime call, its compute seconds accounted once, and
        its result recorded by `record`. `allowed` adds arguments that only a call allowed to run may fetch."""
        run = await self.get(user, run_id)
        params = arguments(run)
        with _fields_renamed(lambda field: field):  # the contract's checks, here before the call leaves, and again there
            parse_call(operation, {"run_id": run.id, **params, "request_id": request_id})
        request_id = await self.ledger.allow(user, run, operation, request_id)
        if allowed is not None:
            params |= await allowed()

        async def work() -> T:
            result = await self._on_run(run, operation, **params, request_id=request_id,
                                        ticket=await self._ticket(run.id))
            await self.ledger.account(run, operation, request_id, result)
            return await record(run, result)

        return await self._serialised(run.id, work)

    async def _on_run(self, run: Run, method: str, **params: Any) -> dict[str, Any]:
        """A runtime call on a run the database holds. The runtime answering that it has no such run means its
        files are gone for good: the run is marked failed (runs.status), and the caller gets NOT_FOUND."""
        try:
            return await self._engine(method, pool=pool_of(run), run_id=run.id, **params)
        except RunNotFound:
            async with self.db.session() as session:
                await session.execute(update(Run).where(Run.id == run.id).values(status=FAILED))
            raise

    # ---- bookkeeping ---------------------------------------------------------------------

    async def _ticket(self, run_id: str) -> int:
        """The call's place in the run's order across server processes; the runtime applies calls in ticket order.
        Taken under the run's lock (this process's arrival order) and committed at once, so every process sees it."""
        async with self.db.session() as session:
            ticket = await session.scalar(update(Run).where(Run.id == run_id).values(call_seq=Run.call_seq + 1)
                                          .returning(Run.call_seq))
        if ticket is None:
            raise RunNotFound(f"run {run_id!r} not found", field="runId")
        return int(ticket)

    async def _serialised(self, run_id: str, work: Callable[[], Awaitable[T]]) -> T:
        """Run `work` under the run's lock (FIFO: arrival order), to the end even if the caller goes away:
        a call the worker has taken is always recorded."""

        async def locked() -> T:
            async with self._locks[run_id]:
                return await work()

        return await asyncio.shield(asyncio.ensure_future(locked()))

    async def checkpoint_archive(self, run_id: str, mode: str, step: int, name: str | None = None) -> bytes:
        """A checkpoint's files as .tar.gz bytes, from the runtime that holds them (the caller checked ownership)."""
        async with self.db.session() as session:
            run = await session.get(Run, run_id)
        if run is None:
            raise RunNotFound(f"run {run_id!r} not found", field="runId")
        named = {"name": name} if mode == "sampler" else {}  # a sampler snapshot is found by its name
        return _decode_archive(await self._engine("export_checkpoint", pool=pool_of(run), run_id=run_id, mode=mode,
                                                  step=step, **named))

    async def _engine(self, method: str, pool: str | None = None, **params: Any) -> dict[str, Any]:
        try:
            return await self.backend.call(method, pool=pool, **params)
        except BadInput as error:
            # The engine names fields as its contract does (max_tokens); clients sent maxTokens.
            raise BadInput(error.message, field=graphql_field(error.field)) from None

    async def _record(self, run_id: str, step: int, values: dict[str, float]) -> None:
        """Store a call's metric rows; every server process's subscribers get them as one event (events.MetricFeed)."""
        now = utcnow()
        async with self.db.session() as session:
            # NaN is no point on a curve, and SQLite would store it as NULL.
            rows = [Metric(run_id=run_id, step=int(step), name=name, value=float(value), created_at=now)
                    for name, value in values.items() if math.isfinite(value)]
            session.add_all(rows)
            await session.flush()  # their ids, for the announcement
            await self.feed.announce(session, run_id, [row.id for row in rows])
        self.feed.written()


def _aware(moment: datetime) -> datetime:
    """SQLite hands datetimes back naive (they were stored as UTC)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _decode_archive(result: dict[str, Any]) -> bytes:
    return base64.b64decode(result["archive_b64"])


def pool_of(run: Run) -> str:
    """The run's pool: on Modal, the warm container its calls go to (base model, GPU configuration, quantization)."""
    return pool_key(run.base_model, run.gpu_config, run.quantization or None)


def graphql_field(field: str | None) -> str | None:
    """The contract's field names in GraphQL's: `max_tokens` → `maxTokens`, `lora.target_modules` →
    `loraTargetModules` (createRun's flat input), `batch[2].output` as is."""
    if not field:
        return field
    if field.startswith("lora."):
        field = "lora_" + field.removeprefix("lora.")
    return to_camel_case(field)  # the same converter the schema applies to every name


@contextmanager
def _fields_renamed(rename: Callable[[str], str]) -> Iterator[None]:
    """Re-raise the contract's BadInput under the field name the client sent, in GraphQL's case."""
    try:
        yield
    except BadInput as error:
        raise BadInput(error.message, field=graphql_field(rename(error.field)) if error.field else None) from None


def _clamp(limit: int, most: int = 1000) -> int:
    return max(1, min(int(limit), most))
