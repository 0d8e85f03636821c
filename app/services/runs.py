"""Runs and the four training primitives: the one place their rules live.

GraphQL resolvers and dashboard handlers both call this. Every primitive goes through one skeleton (`_apply`):
ownership first (another user's run is "not found", never data), its arguments checked, the ledger's credit check,
then in the run's order (its ticket: call_order.py) the runtime call, and the call recorded once: its call record, result
and compute seconds in one transaction (call_records.py), which a retry of an applied call completes if it never ran.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import dataclasses
import json
import math
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Text, case, cast, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from strawberry.utils.str_converters import to_camel_case

from app.backends import A, Backend, Progress
from app.catalog import Catalog
from app.db import Database
from app.errors import BadInput, FailedPrecondition, NotFound, RunNotFound, SignalError
from app.events import MetricFeed
from app.services.call_order import CallOrder, Numbered
from app.services.call_records import Caller, CallRecorder
from app.services.deadlines import Deadline, Streamed, answered, waiting
from app.services.ledger import Ledger
from app.services.streams import unless_gone
from app.services.throttle import sent_until_taken
from app.services.users import require_admin
from app.settings import DEADLINES_S, RECORD_RETRY_S
from app.tables import (
    RUN_NAME_LENGTH,
    RUN_NOTE_LENGTH,
    RUN_TAG_LENGTH,
    RUN_TAGS_MOST,
    BaseSample,
    Checkpoint,
    Metric,
    Run,
    Sample,
    User,
    could_be_id,
    new_id,
    utcnow,
)
from gpu_runtime.allocation import PoolKey
from gpu_runtime.contract import (
    ADAM_DEFAULTS,
    LORA_DEFAULTS,
    LORA_SWITCHES,
    MAX_RUN_SEED,
    MAX_SAMPLES,
    MAX_STOP,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_P,
    SAMPLE_DEFAULTS,
    Call,
    Cancel,
    CheckpointRef,
    CreateRun,
    DeleteCheckpoint,
    DeleteRun,
    ExportCheckpoint,
    Forward,
    ForwardBackward,
    ForwardBackwardResult,
    ForwardResult,
    LoadState,
    LoadStateResult,
    OptimStep,
    OptimStepResult,
    Ping,
    RenderChat,
    RenderChatResult,
    RenderDatums,
    RenderDatumsResult,
    RuntimeOptions,
    RuntimeState,
    SampleResult,
    SaveState,
    SaveStateResult,
    SaveWeightsForSampler,
    SaveWeightsForSamplerResult,
    Tokenizer,
    TokenizerResult,
    adam_settings,
    check_sample_size,
    check_seed,
    checkpoint_ref,
    lora_settings,
    sampling_settings,
    target_families,
)
from gpu_runtime.contract import Sample as SampleCall  # app.tables.Sample is a sample's row

T = TypeVar("T")
C = TypeVar("C", bound=Call)
# What a primitive records of its answer `A`, inside the call's one recording transaction (`fresh`: its first).
Record = Callable[[AsyncSession, Run, A, bool], Awaitable[T]]

FAILED = "failed"  # runs.status once the runtime no longer has the run (else "active", the column's default)
MAX_METRICS_LIMIT = 10_000  # most metric rows one read returns (a run's curve; the dashboard asks for 1,000)


@dataclass
class RunSpec:
    """What createRun asks for; defaults and bounds are the engine contract's (gpu_runtime.contract)."""

    base_model: str | None = None  # None: the server's default model (or the checkpoint's)
    lora_r: int | None = None  # None: LORA_DEFAULTS (or the checkpoint's)
    lora_alpha: float | None = None  # None: 2 * lora_r, the usual choice
    lora_dropout: float | None = None
    lora_target_modules: list[str] | None = None  # None: the switches below, else the model's attention projections
    # Tinker's switches, instead of target modules (not both); None: LORA_DEFAULTS (attention only).
    train_attn: bool | None = None
    train_mlp: bool | None = None
    train_unembed: bool | None = None
    learning_rate: float | None = None  # None: ADAM_DEFAULTS
    weight_decay: float | None = None
    grad_clip_norm: float | None = None
    seed: int | None = None  # None: 0 (or the checkpoint's)
    gpu_config: str | None = None
    quantization: str | None = None  # None | "8bit" | "4bit" (bitsandbytes)
    from_checkpoint: str | None = None  # signal://<run_id>/<kind>/<name>: start there (docs/CHECKPOINTS.md)
    with_optimizer: bool = True  # with from_checkpoint: its AdamW state too
    name: str | None = None  # None or blank: default_run_name(base model, now)
    tags: list[str] | None = None
    note: str | None = None

    def labels(self) -> RunLabels:
        """Its name, tags and note; a blank name is no name (the default's)."""
        return RunLabels(name=self.name if (self.name or "").strip() else None, tags=self.tags, note=self.note)

    def lora(self) -> dict[str, Any]:
        """The run's LoRA settings, checked and filled by the contract; errors name createRun's field (`loraR`)."""
        lora = {"r": self.lora_r if self.lora_r is not None else LORA_DEFAULTS["r"], "alpha": self.lora_alpha,
                "dropout": self.lora_dropout if self.lora_dropout is not None else LORA_DEFAULTS["dropout"],
                "target_modules": self.lora_target_modules, "train_attn": self.train_attn,
                "train_mlp": self.train_mlp, "train_unembed": self.train_unembed}
        with _fields_renamed(lambda field: field):  # graphql_field names them: loraR, trainMlp
            return lora_settings(lora)

    def explicit_lora(self) -> dict[str, Any] | None:
        """Only the LoRA settings the caller gave: a run from a checkpoint inherits the rest, and these must agree."""
        given = {"r": self.lora_r, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                 "target_modules": self.lora_target_modules}
        return {key: value for key, value in given.items() if value is not None} or None

    def adam(self) -> dict[str, float]:
        """The run's AdamW defaults for optim_step; errors name createRun's field (`learningRate`)."""
        adam = {"learning_rate": self.learning_rate, "weight_decay": self.weight_decay,
                "grad_clip_norm": self.grad_clip_norm}
        with _fields_renamed(lambda field: field.removeprefix("adam.")):
            return adam_settings(adam)

    def validate(self) -> None:
        if self.base_model is not None and not self.base_model.strip():
            raise BadInput("baseModel is empty; leave it out for the server's default model", field="baseModel")
        if self.from_checkpoint is not None:
            switch = next((name for name in LORA_SWITCHES if getattr(self, name) is not None), None)
            if switch is not None:
                raise BadInput("a run from a checkpoint inherits its LoRA targets; leave the switches out",
                               field=graphql_field(switch))
        self.lora()
        self.adam()
        self.labels().checked()
        if self.seed is not None:
            check_seed(self.seed, MAX_RUN_SEED)


# The contract's sampling bounds, for forms (the playground): the browser stops what the server would refuse.
SAMPLE_LIMITS = {"temperature": MAX_TEMPERATURE, "max_tokens": MAX_TOKENS_LIMIT, "num_samples": MAX_SAMPLES,
                 "top_p": MAX_TOP_P, "stop": MAX_STOP}


@dataclass
class RunLabels:
    """What a user calls a run (issue 18 §1): None leaves that label as it is."""

    name: str | None = None
    tags: list[str] | None = None
    note: str | None = None

    def checked(self) -> dict[str, Any]:
        """The labels given, cleaned (names and tags stripped, tags once each in their order) and within bounds."""
        values: dict[str, Any] = {}
        if self.name is not None:
            name = self.name.strip()
            if not name:
                raise BadInput("name is empty", field="name")
            if len(name) > RUN_NAME_LENGTH:
                raise BadInput(f"name is {len(name)} characters; at most {RUN_NAME_LENGTH}", field="name")
            values["name"] = name
        if self.tags is not None:
            tags = list(dict.fromkeys(tag.strip() for tag in self.tags if tag.strip()))
            if len(tags) > RUN_TAGS_MOST:
                raise BadInput(f"{len(tags)} tags; at most {RUN_TAGS_MOST}", field="tags")
            for tag in tags:
                if len(tag) > RUN_TAG_LENGTH:
                    raise BadInput(f"tag {tag[:20]!r}… is {len(tag)} characters; at most {RUN_TAG_LENGTH}",
                                   field="tags")
            values["tags"] = tags
        if self.note is not None:
            if len(self.note) > RUN_NOTE_LENGTH:
                raise BadInput(f"note is {len(self.note)} characters; at most {RUN_NOTE_LENGTH}", field="note")
            values["note"] = self.note
        return values


def default_run_name(base_model: str, when: datetime) -> str:
    """A readable name for a run created without one: its base model's short name and the UTC minute,
    e.g. "SmolLM2-135M 2026-12-04 17:40"."""
    return f"{base_model.rsplit('/', 1)[-1]} {when.astimezone(UTC):%Y-%m-%d %H:%M}"[:RUN_NAME_LENGTH]


SEARCH_LENGTH = RUN_NAME_LENGTH  # the runs list's search text: a whole name at most

# The runs list's orders (GraphQL's RunSort, the dashboard's ?sort=): the first is the default.
RUN_SORTS: dict[str, tuple[Any, ...]] = {
    "newest": (Run.created_at.desc(), Run.id),
    "oldest": (Run.created_at.asc(), Run.id),
    "name": (Run.name.asc(), Run.created_at.desc()),
    "activity": (Run.updated_at.desc(), Run.id),
    "step": (Run.step.desc(), Run.created_at.desc()),
}


def _search_clause(search: str) -> Any:
    """A case-insensitive substring of the name, the base model or a tag (the tags' JSON text)."""
    pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    return or_(Run.name.ilike(pattern, escape="\\"), Run.base_model.ilike(pattern, escape="\\"),
               cast(Run.tags, Text).ilike(pattern, escape="\\"))


@dataclass
class SampleParams:
    """sample's arguments as GraphQL takes them; `engine_params` is the contract's Sample (less run and request)."""

    prompts: list[str] | None = None  # exactly one of prompts and prompt_tokens
    prompt_tokens: list[list[int]] | None = None
    max_tokens: int = SAMPLE_DEFAULTS["max_tokens"]
    temperature: float = SAMPLE_DEFAULTS["temperature"]
    top_p: float = SAMPLE_DEFAULTS["top_p"]
    top_k: int = SAMPLE_DEFAULTS["top_k"]
    stop: list[str] | None = None  # stop strings…
    stop_tokens: list[int] | None = None  # …or stop token ids: GraphQL lists are typed, so two arguments
    num_samples: int = SAMPLE_DEFAULTS["num_samples"]
    seed: int | None = None
    prompt_logprobs: bool = SAMPLE_DEFAULTS["prompt_logprobs"]
    topk_prompt_logprobs: int = SAMPLE_DEFAULTS["topk_prompt_logprobs"]
    topk_sample_logprobs: int = SAMPLE_DEFAULTS["topk_sample_logprobs"]
    store: bool | None = None  # None: stored (the run's current weights); False: no sample rows
    # What the history keeps as each token prompt's text (the playground's chat as typed); None: the ids, as JSON.
    prompt_texts: list[str] | None = None

    def engine_params(self) -> dict[str, Any]:
        if self.stop is not None and self.stop_tokens is not None:
            raise BadInput("give stop (strings) or stopTokens (token ids), not both", field="stop")
        return {
            "prompts": self.prompts,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_tokens if self.stop_tokens is not None else self.stop,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "prompt_logprobs": self.prompt_logprobs,
            "topk_prompt_logprobs": self.topk_prompt_logprobs,
            "topk_sample_logprobs": self.topk_sample_logprobs,
        }

    def check(self, bounds: RuntimeOptions) -> None:
        """The contract's bounds and the per-call size bounds (rows x max_tokens), checked now: a stream that starts
        later must not fail on a bad temperature or on n x max_tokens past SIGNAL_MAX_SAMPLE_TOKENS."""
        params = self.engine_params()
        settings = sampling_settings(**{key: params[key] for key in ("max_tokens", "temperature", "top_p", "top_k",
                                                                    "stop", "num_samples", "seed")})
        prompts = self.prompts if self.prompts is not None else self.prompt_tokens or []
        check_sample_size(len(prompts), settings, bounds, "prompts" if self.prompts is not None else "prompt_tokens")

    def stored_prompts(self) -> list[str]:
        """What a sample row keeps as its prompt: the text, a token-id prompt's given text, or its ids as JSON."""
        if self.prompts is not None:
            return self.prompts
        return self.prompt_texts or [json.dumps(ids) for ids in self.prompt_tokens or []]


class RunService:
    def __init__(self, db: Database, backend: Backend, catalog: Catalog, feed: MetricFeed,
                 default_model: str, ledger: Ledger, bounds: RuntimeOptions | None = None,
                 record_retry_s: float = RECORD_RETRY_S, deadlines: dict[str, float] | None = None) -> None:
        self.db = db
        self.deadlines = deadlines or DEADLINES_S  # each method's, from arrival (SIGNAL_DEADLINES_S; deadlines.py)
        self.recorder = CallRecorder(db, ledger, record_retry_s)  # each applied call recorded once (issue 19 §5)
        # The per-call size bounds (SIGNAL_MAX_SAMPLE_ROWS…): checked here before a call leaves, by the runtime again.
        self.bounds = bounds or RuntimeOptions()
        self.ledger = ledger  # compute seconds, credits and the billing service (docs/BILLING.md)
        self.default_model = default_model
        self.backend = backend
        self.catalog = catalog
        self.feed = feed
        self._devices: dict[PoolKey, str] = {}  # pool → its runtime's device, for pricing base samples
        # A run's calls in one order across processes: tickets, in the callers' numbers (seq, session).
        self.order = CallOrder(db)
        # A check of another client's claim on the run before each primitive (Tinker's: app/services/tinker_sessions.py
        # refuses Signal's own calls on a run a live Tinker session drives); None: no check.
        self.claim: Callable[[Run, str], Awaitable[None]] | None = None

    # ---- reading -------------------------------------------------------------------------

    async def get(self, user: User, run_id: str) -> Run:
        async with self.db.session() as session:
            run = await session.get(Run, run_id) if could_be_id(run_id) else None
        if run is None or run.user_id != user.id:
            # Not echoed when it cannot be an id: the dashboard would print `/runs/%00` as '\x00'.
            raise RunNotFound(f"run {run_id!r} not found" if could_be_id(run_id) else "no run has that id",
                              field="runId")
        return run

    async def list(self, user: User, limit: int = 50, search: str = "", sort: str = "newest",
                   archived: bool | None = False, offset: int = 0) -> list[Run]:
        """The user's runs in `sort`'s order (RUN_SORTS), those whose name, base model or a tag contain `search`;
        `archived` False: those not archived (the default list), True: the archived ones, None: both. `offset`
        skips that many: the id breaks every tie, so consecutive pages never share or skip a run."""
        if sort not in RUN_SORTS:
            raise BadInput(f"sort must be one of {', '.join(RUN_SORTS)}, got {sort!r}", field="sort")
        query = self._listed(user, search, archived).order_by(*RUN_SORTS[sort], Run.id)
        async with self.db.session() as session:
            rows = await session.scalars(query.offset(max(0, int(offset))).limit(_clamp(limit)))
            return list(rows)

    async def count(self, user: User, search: str = "", archived: bool | None = False) -> int:
        """How many runs `list` pages through with the same filters (the runs list's "of N")."""
        query = select(func.count()).select_from(self._listed(user, search, archived).subquery())
        async with self.db.session() as session:
            return int(await session.scalar(query) or 0)

    def _listed(self, user: User, search: str, archived: bool | None) -> Any:
        query = select(Run).where(Run.user_id == user.id)
        if archived is not None:
            query = query.where(Run.archived_at.is_not(None) if archived else Run.archived_at.is_(None))
        if search.strip():
            query = query.where(_search_clause(search.strip()))
        return query

    async def archive(self, user: User, run_id: str, archived: bool = True) -> Run:
        """Archive a run (or unarchive it): hidden from the default list, its training and sampling refused with
        FAILED_PRECONDITION until unarchived; its files, checkpoints and history are kept."""
        run = await self.get(user, run_id)
        if (run.archived_at is not None) != archived:
            async with self.db.session() as session:
                await session.execute(update(Run).where(Run.id == run.id)
                                      .values(archived_at=utcnow() if archived else None))
        return await self.get(user, run.id)

    async def label(self, user: User, run_id: str, labels: RunLabels) -> Run:
        """Rename a run, set its tags or its note; another user's run is not found."""
        run = await self.get(user, run_id)
        values = labels.checked()
        if values:
            async with self.db.session() as session:
                await session.execute(update(Run).where(Run.id == run.id).values(**values))
        return await self.get(user, run.id)

    async def metrics(self, run: Run, name: str | None = None, limit: int = 1000) -> builtins.list[Metric]:
        if not 1 <= limit <= MAX_METRICS_LIMIT:
            raise BadInput(f"limit must be an integer in 1..{MAX_METRICS_LIMIT}, got {limit}", field="limit")
        query = select(Metric).where(Metric.run_id == run.id)
        if name:
            query = query.where(Metric.name == name)
        async with self.db.session() as session:
            newest = list(await session.scalars(query.order_by(Metric.id.desc()).limit(limit)))
        return newest[::-1]  # the latest `limit` rows, in the order they happened

    async def samples(self, run: Run, limit: int = 100) -> builtins.list[Sample]:
        async with self.db.session() as session:
            query = select(Sample).where(Sample.run_id == run.id).order_by(Sample.id.desc()).limit(_clamp(limit))
            return list(await session.scalars(query))

    async def sample_marks(self, run: Run) -> builtins.list[tuple[int, datetime]]:
        """Each step the run was sampled at, with its first sample's time: the run page's sample markers."""
        async with self.db.session() as session:
            query = (select(Sample.step, func.min(Sample.created_at)).where(Sample.run_id == run.id)
                     .group_by(Sample.step).order_by(Sample.step))
            return [(int(step), _aware(first)) for step, first in await session.execute(query)]

    async def base_samples(self, user: User, limit: int = 100) -> builtins.list[BaseSample]:
        """The user's samples of base models alone (no run), newest first: their history as `samples` is a run's."""
        async with self.db.session() as session:
            query = (select(BaseSample).where(BaseSample.user_id == user.id).order_by(BaseSample.id.desc())
                     .limit(_clamp(limit)))
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
        deadline = Deadline.start(self.deadlines, "create_run")  # a model load included
        spec.validate()
        source = None
        if spec.from_checkpoint is not None:  # inherits the checkpoint's base, seed, step and LoRA settings
            ref = checkpoint_ref(spec.from_checkpoint, "fromCheckpoint")
            source, _ = await self._checkpoint_row(user, ref, "fromCheckpoint")
            if spec.base_model and spec.base_model != source.base_model:
                raise BadInput(f"baseModel: the checkpoint was trained on {source.base_model!r}, not "
                               f"{spec.base_model!r}", field="baseModel")
        model = self.catalog.get(spec.base_model or (source.base_model if source else self.default_model))
        lora, adam = (dict(source.lora_config) if source else spec.lora()), spec.adam()
        requested_quantization = spec.quantization or (source.quantization or None if source else None)
        # Checked to hold the model, quantized or not; then the quantization it was checked with.
        families = {s: lora[s] for s in LORA_SWITCHES} if "train_attn" in lora else target_families(lora["target_modules"])
        gpu_config = self.catalog.resolve_gpu(model, spec.gpu_config, requested_quantization, lora_r=lora["r"],
                                              targets=model.lora_targets(families))
        quantization = self.catalog.resolve_quantization(model, requested_quantization)
        run_id = new_id()
        await self.ledger.allow_create(user, run_id, gpu_config, model.name)
        request = CreateRun(  # from a checkpoint: only the LoRA settings given, which must agree with its own
            run_id=run_id, user_id=user.id, base_model=model.source, quantization=quantization,
            lora=spec.explicit_lora() if source else lora, seed=spec.seed if source else spec.seed or 0,
            from_checkpoint=spec.from_checkpoint if source else None,
            with_optimizer=spec.with_optimizer if source else True)
        pool = PoolKey.of(model.name, gpu_config, quantization)
        # A create_run is named by its run.
        created = await self._answered(deadline, pool, user, run_id, self._engine(request, pool=pool))
        # The runtime resolved the switches against the model: the run keeps the layers they named.
        lora = {key: value for key, value in dict(created.lora or lora).items() if key not in LORA_SWITCHES}
        lora["target_modules"] = created.target_modules
        run = Run(
            id=run_id,
            user_id=user.id,
            base_model=model.name,
            lora_config=lora,
            optimizer_config=adam,
            seed=created.seed,
            step=created.step,
            gpu_config=gpu_config,
            device=created.device,
            quantization=quantization or "",
            trainable_params=created.trainable_params,
            total_params=created.total_params,
            **({"name": default_run_name(model.name, utcnow())} | spec.labels().checked()),
        )
        async with self.db.session() as session:
            session.add(run)
        return run

    async def forward_backward(
        self, user: User, run_id: str, batch: builtins.list[dict[str, Any]], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None, reduction: str = "mean",
        return_outputs: bool = False, order: Numbered | None = None,
    ) -> ForwardBackwardResult:
        """Loss and gradients of a batch. `reduction` is the step's (one per step: another is FAILED_PRECONDITION);
        `return_outputs` asks for per-datum, per-position logprobs and losses (a retried call's answer has none)."""
        def arguments(run: Run) -> ForwardBackward:
            if not isinstance(batch, list) or not batch:
                raise BadInput("batch must be a non-empty list of examples", field="batch")
            return ForwardBackward(run_id=run.id, batch=batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                                   reduction=reduction, return_outputs=return_outputs)

        async def record(session: AsyncSession, run: Run, result: ForwardBackwardResult,
                         fresh: bool) -> ForwardBackwardResult:
            if fresh:
                # Metric names carry their reduction (Tinker's name:reduction): loss:mean, loss:sum.
                await self._metrics(session, run.id, result.step, {
                    loss_metric(result.reduction): result.loss,
                    "num_tokens": result.num_tokens, "num_examples": result.num_examples,
                    **throughput(result),
                })
            return result

        return await self._apply(user, run_id, "forward_backward", request_id, arguments, record, order=order)

    async def forward(self, user: User, batch: builtins.list[dict[str, Any]], run_id: str | None = None,
                      base_model: str | None = None, loss_fn: str = "cross_entropy",
                      loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None,
                      order: Numbered | None = None, snapshot: str | None = None,
                      checkpoint: str | None = None) -> ForwardResult:
        """Losses and per-position logprobs with no backward, changing nothing, on a weights source as sample's:
        the caller's run's current weights (`run_id`, in the run's order), a snapshot of it (`snapshot`: off the
        run's queue), or a catalogue base model alone (`base_model`, no run: only its call record is written)."""
        def on(run: Run) -> Forward:
            return Forward(run_id=run.id, batch=batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                           snapshot=snapshot, checkpoint=checkpoint)

        async def record(session: AsyncSession, run: Run, result: ForwardResult, fresh: bool) -> ForwardResult:
            return result  # nothing changed, so nothing to record beyond the call record

        if run_id is not None:
            if base_model is not None:
                raise BadInput("forward takes runId or baseModel, not both", field="baseModel")
            if snapshot is not None or checkpoint is not None:
                return await self._off_the_queue(user, run_id, "forward", request_id, on, record)
            return await self._apply(user, run_id, "forward", request_id, on, record, order=order)
        if snapshot is not None or checkpoint is not None:
            raise BadInput("snapshot and checkpoint name a run's weights: give runId too",
                           field="snapshot" if snapshot is not None else "checkpoint")
        if not base_model:
            raise BadInput("forward needs runId or baseModel", field="baseModel")
        deadline = Deadline.start(self.deadlines, "forward")
        model = self.catalog.get(base_model)
        request = self._checked(Forward(batch=batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                                        base_model=model.source, user_id=user.id, request_id=request_id))
        gpu_config = self.catalog.resolve_gpu(model, None, None)
        pool = PoolKey.of(model.name, gpu_config, None)
        request = dataclasses.replace(request, request_id=request_id or new_id())
        request_id = str(request.request_id)
        result = await self._answered(deadline, pool, user, request_id, self._engine(request, pool=pool))
        caller = Caller(user.id, None, model.name, await self._device(pool), gpu_config)

        async def answer(session: AsyncSession, fresh: bool) -> ForwardResult:
            return result  # changes nothing: its call record (usage) is all it leaves

        return await self.recorder.record(caller, "forward", request_id, result, answer)

    async def render_datums(self, user: User, run_id: str, batch: builtins.list[dict[str, Any]],
                            loss_fn: str = "cross_entropy") -> RenderDatumsResult:
        """The datums the runtime would build for `batch` on the run's model; nothing is applied or billed."""
        run = await self.get(user, run_id)
        return await self._on_run(run, self._checked(RenderDatums(run_id=run.id, batch=batch, loss_fn=loss_fn)))

    async def optim_step(self, user: User, run_id: str, adam: dict[str, Any] | None = None,
                         request_id: str | None = None, order: Numbered | None = None) -> OptimStepResult:
        def arguments(run: Run) -> OptimStep:
            overrides = {key: value for key, value in (adam or {}).items() if value is not None}
            return OptimStep(run_id=run.id, adam={**ADAM_DEFAULTS, **run.optimizer_config, **overrides})

        async def record(session: AsyncSession, run: Run, result: OptimStepResult, fresh: bool) -> OptimStepResult:
            if not fresh:
                return result  # its step was stored when it was recorded; a later step may have followed
            step = result.step
            # greatest(step, :s), portably: another server's later step may have been written first.
            await session.execute(update(Run).where(Run.id == run.id)
                                  .values(step=case((Run.step < step, step), else_=Run.step)))
            await self._metrics(session, run.id, step, {
                "grad_norm": result.grad_norm, "learning_rate": result.learning_rate,
            })
            return result

        return await self._apply(user, run_id, "optim_step", request_id, arguments, record, order=order)

    async def sample(self, user: User, run_id: str | None, params: SampleParams, request_id: str | None = None,
                     snapshot: str | None = None, checkpoint: str | None = None, base_model: str | None = None,
                     order: Numbered | None = None, progress: Progress | None = None,
                     latest: bool = False) -> SampleResult:
        """Sample a run's current weights (in the run's order: its ticket), a snapshot or checkpoint of it, or a
        base alone. Frozen sources (docs/SNAPSHOTS.md) take no ticket: they wait for nothing
        on the run; so does `latest` (/v1 on a run id): the run's current weights as they are when the call reaches the
        runtime, which copies them for it, so that nothing queued on the run holds it up. Each sequence becomes a
        sample row when `params.store` says so (None: true for current weights, false otherwise: an RL step of 128
        prompts x 16 samples would write 2,048): the run's history on its page, or for a base alone the user's
        (`base_samples`). A frozen source is named in the row's params."""
        # The contract takes stop strings and ids as one `stop`; GraphQL has two arguments: name the one sent.
        stop_field = "stop_tokens" if params.stop_tokens is not None and params.stop is None else "stop"
        with _fields_renamed(lambda field: stop_field if field == "stop" else field):
            return await self._sample(user, run_id, params, request_id, snapshot, checkpoint, base_model, order,
                                      progress, latest)

    async def _sample(self, user: User, run_id: str | None, params: SampleParams, request_id: str | None,
                      snapshot: str | None, checkpoint: str | None, base_model: str | None,
                      order: Numbered | None, progress: Progress | None, latest: bool) -> SampleResult:
        keep = params.store if params.store is not None else (
            run_id is not None and snapshot is None and checkpoint is None)
        source = {key: value for key, value in (("snapshot", snapshot), ("checkpoint", checkpoint)) if value}

        def stored_params() -> dict[str, Any]:
            return {**{k: v for k, v in params.engine_params().items() if k not in ("prompts", "prompt_tokens")},
                    **source}

        async def record(session: AsyncSession, run: Run, result: SampleResult, fresh: bool) -> SampleResult:
            if not fresh or not keep:
                return result
            kept = stored_params()
            for prompt, sequences in zip(params.stored_prompts(), result.sequences):
                for sequence in sequences:
                    session.add(Sample(run_id=run.id, step=result.step, prompt=prompt,
                                       output=sequence["text"], params=cancelled(kept, sequence)))
            return result

        if run_id is None:
            if snapshot is not None or checkpoint is not None:
                raise BadInput("snapshot and checkpoint name a run's weights: give runId too",
                               field="snapshot" if snapshot is not None else "checkpoint")
            return await self._sample_base(user, base_model, params, request_id, stored_params() if keep else None,
                                           progress)
        if base_model is not None:
            raise BadInput("baseModel samples the base alone: leave runId out", field="baseModel")
        def on(run: Run) -> SampleCall:
            return SampleCall(run_id=run.id, **params.engine_params(), stream=progress is not None,
                              snapshot=snapshot, checkpoint=checkpoint,
                              latest=latest and snapshot is None and checkpoint is None)

        if latest and snapshot is None and checkpoint is None:
            return await self._off_the_queue(user, run_id, "sample", request_id, on, record, progress)
        if snapshot is None and checkpoint is None:
            return await self._apply(user, run_id, "sample", request_id, on, record, order=order, progress=progress)
        return await self._off_the_queue(user, run_id, "sample", request_id, on, record, progress)

    async def cancel_sample(self, user: User, request_id: str, run: Run | None, base_model: str | None,
                            withdraw: bool = False) -> None:
        """Stop the caller's streamed sample `request_id` (its client went away): decoding, the runtime answers it with
        what it has, stop_reason "cancelled", which its `sample` call then records as it records any answer; not begun
        yet, or with `withdraw` (a client that saw none of it), it is withdrawn (CANCELLED): never applied, not billed,
        not recorded."""
        pool = pool_of(run) if run is not None else self._base_pool(base_model)[1]
        await self._engine(Cancel(request_id=request_id, user_id=user.id, withdraw=withdraw), pool=pool)

    async def sample_unless_gone(self, user: User, run_id: str | None, params: SampleParams,
                                 gone: asyncio.Future[None], request_id: str | None = None,
                                 snapshot: str | None = None, checkpoint: str | None = None,
                                 base_model: str | None = None, order: Numbered | None = None,
                                 latest: bool = False) -> SampleResult:
        """`sample` for a client that waits for the whole answer: if it goes away first (`gone`), the sample is
        withdrawn wherever it is, queued or decoding (CANCELLED: never applied, not billed, not recorded; its compute
        seconds logged). A training call has no such path: it completes whatever its client does."""
        request_id = request_id or new_id()  # the name its cancel needs

        async def cancel() -> None:
            run = await self.get(user, run_id) if run_id is not None else None
            await self.cancel_sample(user, request_id, run, base_model, withdraw=True)

        return await unless_gone(self.sample(user, run_id, params, request_id=request_id, snapshot=snapshot,
                                             checkpoint=checkpoint, base_model=base_model, order=order,
                                             latest=latest),
                                 gone, cancel, f"sample {request_id} of user {user.id}")

    async def _answered(self, deadline: Deadline, pool: PoolKey, user: User, request_id: str,
                        call: Awaitable[A], streamed: Streamed | None = None) -> A:
        """The runtime's answer to `call`; at its deadline the runtime is asked to withdraw it, or, for a stream whose
        client has read text, to stop it and answer with what it has (deadlines.py)."""
        return await answered(deadline, call, lambda: self._engine(
            Cancel(request_id=request_id, user_id=user.id, deadline=streamed is None or not streamed.sent), pool=pool),
                              f"{deadline.operation} {request_id} of user {user.id}")

    async def _off_the_queue(self, user: User, run_id: str, method: str, request_id: str | None,
                             arguments: Callable[[Run], Call[A]], record: Record[A, A],
                             progress: Progress | None = None) -> A:
        """A call on a run's frozen weights (a snapshot or checkpoint: docs/SNAPSHOTS.md): owned and billed like the
        run's calls, but it takes no ticket, so it waits for nothing queued on the run."""
        deadline = Deadline.start(self.deadlines, method)
        run = await self.get(user, run_id)
        _refuse_archived(run, method)
        request = self._checked(_sent_as(arguments(run), request_id=request_id))
        request_id = await self.ledger.allow(user, run, method, request_id or new_id())
        request = _sent_as(request, request_id=request_id)

        streamed = Streamed.of(progress)

        async def work() -> A:
            result = await self._answered(deadline, pool_of(run), user, request_id,
                                          self._on_run(run, request, streamed), streamed)
            return await self._recorded(run, method, request_id, result, record)

        return await asyncio.shield(asyncio.ensure_future(work()))  # recorded even if the caller goes away

    def _base_pool(self, base_model: str | None) -> tuple[Any, PoolKey, str]:
        """A base model's catalogue entry, pool and GPU configuration (a base alone runs in the pool of its default)."""
        model = self.catalog.get(base_model or self.default_model)
        gpu_config = self.catalog.resolve_gpu(model, None, None)
        return model, PoolKey.of(model.name, gpu_config, None), gpu_config

    async def _sample_base(self, user: User, base_model: str | None, params: SampleParams,
                           request_id: str | None, store: dict[str, Any] | None,
                           progress: Progress | None = None) -> SampleResult:
        """The base alone: no run, so no ticket; billed to the user (Ledger.owe_user). `store` (the
        params to keep with them, or None) writes the sequences to the user's base-model history."""
        deadline = Deadline.start(self.deadlines, "sample")
        model, pool, gpu_config = self._base_pool(base_model)
        request = self._checked(SampleCall(**params.engine_params(), base_model=model.source, user_id=user.id,
                                           stream=progress is not None, request_id=request_id))
        request_id = await self.ledger.allow_user(user, "sample", request_id or new_id(), model.name, gpu_config)
        request = dataclasses.replace(request, request_id=request_id)

        streamed = Streamed.of(progress)

        async def work() -> SampleResult:
            result = await self._answered(deadline, pool, user, request_id, self._engine(
                request, pool=pool, progress=streamed), streamed)
            caller = Caller(user.id, None, model.name, await self._device(pool), gpu_config)

            async def write(session: AsyncSession, fresh: bool) -> SampleResult:
                if fresh and store is not None:
                    for prompt, sequences in zip(params.stored_prompts(), result.sequences):
                        session.add_all(BaseSample(user_id=user.id, base_model=model.name, prompt=prompt,
                                                   output=sequence["text"], params=cancelled(store, sequence))
                                        for sequence in sequences)
                return result

            return await self.recorder.record(caller, "sample", request_id, result, write)

        return await asyncio.shield(asyncio.ensure_future(work()))

    async def base_device(self, base_model: str | None) -> str:
        """The device a run on `base_model` (None: the default) would train on: its pool's runtime's."""
        return await self._device(self._base_pool(base_model)[1])

    async def _device(self, pool: PoolKey) -> str:
        """The device a pool's runtime computes on (its ping), asked once per pool: what a base sample is priced by."""
        if pool not in self._devices:
            self._devices[pool] = (await self.backend.call(Ping(), pool=pool)).device
        return self._devices[pool]

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

        return await self._apply(user, run_id, "save_weights_for_sampler", request_id,
                                 lambda run: SaveWeightsForSampler(run_id=run.id, name=name), record, order=order)

    async def tokenizer(self, user: User, run_id: str | None = None, base_model: str | None = None,
                        save: bool = False) -> TokenizerResult:
        """The tokenizer of a run's base (the caller's run) or of a catalogue model (default: the server's): its id,
        vocabulary size, EOS, BOS and pad ids, and chat template. Reads the base only: no run's queue, no credits.
        `save`: the runtime also writes it to a directory of its own and answers its path (a path on the runtime's
        machine, so the caller checks the backend is local)."""
        if run_id is not None and base_model is not None:
            raise BadInput("give runId or baseModel, not both", field="runId")
        if run_id is not None:
            run = await self.get(user, run_id)
            return await self._engine(Tokenizer(run_id=run.id, save=save), pool=pool_of(run))
        model = self.catalog.get(base_model or self.default_model)
        pool = PoolKey.of(model.name, self.catalog.resolve_gpu(model, None, None), None)
        return await self._engine(Tokenizer(base_model=model.source, save=save), pool=pool)

    async def render_chat(self, run: Run | None, messages: builtins.list[dict[str, str]] | None = None,
                          prompts: builtins.list[str] | None = None, decode: builtins.list[int] | None = None,
                          base_model: str | None = None) -> RenderChatResult:
        """On the caller's run's base (ownership checked by `get`), or a catalogue model's (`base_model`, run None):
        messages through its chat template as token ids, text `prompts` as ids, and `decode`'s ids as text, one
        each: the OpenAI endpoint's tokenizer work. No run queue, no credits."""
        if run is not None:
            request, pool = RenderChat(run_id=run.id, messages=messages, prompts=prompts, decode=decode), pool_of(run)
        else:
            model = self.catalog.get(base_model or self.default_model)
            request = RenderChat(base_model=model.source, messages=messages, prompts=prompts, decode=decode)
            pool = PoolKey.of(model.name, self.catalog.resolve_gpu(model, None, None), None)
        request.validate()
        return await self._engine(request, pool=pool)

    async def save_state(self, user: User, run_id: str, mode: str = "adapter", push_to_hub: bool = False,
                         hub_model_id: str | None = None, request_id: str | None = None,
                         hf_token: str | None = None, name: str | None = None,
                         with_optimizer: bool | None = None, order: Numbered | None = None) -> Checkpoint:
        """Export the run; with push_to_hub, the runtime also uploads it (private) with the user's `hf_token`,
        which travels as this one call's argument and is stored nowhere. With billing on and no `hf_token`, the
        token is the user's Hugging Face integration, fetched from the billing service now (docs/BILLING.md)."""
        billing = self.ledger.billing

        def arguments(run: Run) -> SaveState:
            if push_to_hub and not (hub_model_id or "").strip():
                raise BadInput("pushToHub needs hubModelId (e.g. 'your-name/my-adapter')", field="hubModelId")
            return SaveState(run_id=run.id, mode=mode, name=name, with_optimizer=with_optimizer)

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
            checkpoint.hub_url = (result.hub or {}).get("url") or checkpoint.hub_url
            checkpoint.with_optimizer = result.with_optimizer
            checkpoint.pending_excluded = result.pending_excluded
            await session.flush()  # its id, for the answer
            return checkpoint

        return await self._apply(user, run_id, "save_state", request_id, arguments, record, allowed=hub, order=order)

    async def load_state(self, user: User, run_id: str, checkpoint: str, with_optimizer: bool = True,
                         request_id: str | None = None, order: Numbered | None = None) -> LoadStateResult:
        """A checkpoint of this run, or of another run of the same user, into this run (docs/CHECKPOINTS.md): its
        adapter, with_optimizer its AdamW, and its step either way. Another user's checkpoint is NOT_FOUND."""
        run = await self.get(user, run_id)
        ref = checkpoint_ref(checkpoint, "checkpoint", run.id)
        await self._checkpoint_row(user, ref, "checkpoint")

        async def record(session: AsyncSession, run: Run, result: LoadStateResult, fresh: bool) -> LoadStateResult:
            if fresh:  # the step is the checkpoint's: it may go back
                await session.execute(update(Run).where(Run.id == run.id).values(step=result.step))
            return result

        return await self._apply(user, run_id, "load_state", request_id,
                                 lambda run: LoadState(run_id=run.id, checkpoint=ref.path, with_optimizer=with_optimizer),
                                 record, order=order)

    async def delete_checkpoint(self, user: User, run_id: str, checkpoint_id: str) -> None:
        """A checkpoint's (or a sampler snapshot's) files in the runtime, then its row."""
        run = await self.get(user, run_id)
        async with self.db.session() as session:
            row = await session.get(Checkpoint, int(checkpoint_id)) if str(checkpoint_id).isdigit() else None
        if row is None or row.run_id != run.id:
            raise NotFound(f"checkpoint {checkpoint_id} of run {run_id!r} not found", field="checkpointId")

        async def work(ticket: int, sent: Callable[[], None]) -> None:
            try:  # after the run's calls before it (a save_state of this checkpoint's name)
                await self._engine(DeleteCheckpoint(run_id=run.id, mode=row.mode, name=row.name), pool=pool_of(run),
                                   ticket=ticket, sent=sent)
            except NotFound:
                pass  # its files are already gone (a delete half done): remove the row anyway
            async with self.db.session() as session:
                await session.execute(delete(Checkpoint).where(Checkpoint.id == row.id))

        await self._in_order(run.id, work)

    async def _checkpoint_row(self, user: User, ref: CheckpointRef, field: str) -> tuple[Run, Checkpoint]:
        """The caller's run and checkpoint a reference names; another user's, or none, is NOT_FOUND alike."""
        async with self.db.session() as session:
            run = await session.get(Run, ref.run_id) if could_be_id(ref.run_id) else None
            row = None if run is None or run.user_id != user.id else await session.scalar(select(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.mode == ref.kind, Checkpoint.name == ref.name).limit(1))
        if run is None or row is None:
            raise NotFound(f"checkpoint {ref.path} not found", field=field)
        return run, row

    async def delete(self, user: User, run_id: str) -> None:
        run = await self.get(user, run_id)

        async def work(ticket: int, sent: Callable[[], None]) -> None:
            try:  # after the run's calls before it
                await self._engine(DeleteRun(run_id=run.id), pool=pool_of(run), ticket=ticket, sent=sent)
            except RunNotFound:
                pass  # its files are already gone (an earlier delete half done): remove the rows anyway
            async with self.db.session() as session:
                for table in (Metric, Sample, Checkpoint):
                    await session.execute(delete(table).where(table.run_id == run.id))
                await session.execute(delete(Run).where(Run.id == run.id))

        await self._in_order(run.id, work)
        self.order.forget(run.id)

    # ---- the runtime ---------------------------------------------------------------------

    async def runtime_state(self, user: User) -> dict[str, Any]:
        """What the GPU runtime holds and does (bases, resident and evicted runs, queues, ticks): admins only,
        since it names every user's runs."""
        require_admin(user, "read the runtime's state")
        return (await self.backend.call(RuntimeState())).state

    # ---- one skeleton for the four primitives ----------------------------------------------

    async def _apply(self, user: User, run_id: str, operation: str, request_id: str | None,
                     arguments: Callable[[Run], Call[A]], record: Record[A, T],
                     allowed: Callable[[], Awaitable[dict[str, Any]]] | None = None, order: Numbered | None = None,
                     progress: Progress | None = None) -> T:
        """A primitive on the caller's run: its `arguments` checked (before anyone is asked about credits), the call
        allowed by the ledger, then in the run's order the runtime call, and the call recorded once: `record` writes
        what it records in that transaction (`fresh`: its first recording; call_records.py). A call without a
        request id gets one here, so its retries and its record have a key. `allowed` adds arguments that only a call allowed to run may fetch.
        `order`: the SDK's number for the call, which puts it in the run's order after its session's previous one.
        Its deadline counts from here, its arrival, through the run's queue (deadlines.py)."""
        deadline = Deadline.start(self.deadlines, operation)
        run = await self.get(user, run_id)
        if operation != "save_state":  # an archived run's weights can still be exported
            _refuse_archived(run, operation)
        if self.claim is not None:
            await self.claim(run, operation)
        request = self._checked(_sent_as(arguments(run), request_id=request_id))
        request_id = await self.ledger.allow(user, run, operation, request_id or new_id())
        request = _sent_as(request, request_id=request_id, **(await allowed() if allowed is not None else {}))

        streamed = Streamed.of(progress)

        async def work(ticket: int, sent: Callable[[], None]) -> T:
            result = await self._answered(deadline, pool_of(run), user, request_id,
                                          self._on_run(run, request, streamed, ticket, sent), streamed)
            return await self._recorded(run, operation, request_id, result, record)

        return await self._in_order(run.id, work, order, deadline)

    async def _recorded(self, run: Run, operation: str, request_id: str, result: A, record: Record[A, T]) -> T:
        """The applied call recorded once, with what `record` writes, in one transaction (call_records.py)."""
        return await self.recorder.record(Caller.of(run), operation, request_id, result,
                                          lambda session, fresh: record(session, run, result, fresh),
                                          after=lambda: self.feed.written(run.id))

    def _checked(self, request: C) -> C:
        """The contract's checks and size bounds, here before the call leaves (the runtime runs both again); errors
        name the field as the client sent it."""
        with _fields_renamed(lambda field: field):
            request.validate()
            request.check_size(self.bounds)
        return request

    async def _on_run(self, run: Run, request: Call[A], progress: Progress | None = None,
                      ticket: int | None = None, sent: Callable[[], None] | None = None) -> A:
        """A runtime call on a run the database holds. The runtime answering that it has no such run means its
        files are gone for good: the run is marked failed (runs.status), and the caller gets NOT_FOUND."""
        try:
            return await self._engine(request, pool=pool_of(run), progress=progress, ticket=ticket, sent=sent)
        except RunNotFound:
            async with self.db.session() as session:
                await session.execute(update(Run).where(Run.id == run.id).values(status=FAILED))
            raise

    # ---- bookkeeping ---------------------------------------------------------------------

    async def _in_order(self, run_id: str, call: Callable[[int, Callable[[], None]], Awaitable[T]],
                        order: Numbered | None = None, deadline: Deadline | None = None) -> T:
        """`call(ticket, sent)` in the run's order (call_order.py): its place in line waited for (past `deadline`:
        DEADLINE_EXCEEDED, no ticket taken), its ticket taken, and the run's turn held until the call has left for the
        runtime (`sent`), not until its answer, so a run's calls are pipelined. Run to the end even if the caller goes
        away: a call the runtime has taken is always recorded."""
        async def in_order() -> T:
            turn = await waiting(deadline, self.order.enter(run_id, order))
            try:
                ticket = await self.order.ticket(run_id, order)
                left = asyncio.Event()
                task = asyncio.ensure_future(call(ticket, left.set))
                leaving = asyncio.ensure_future(left.wait())
                await asyncio.wait([task, leaving], return_when=asyncio.FIRST_COMPLETED)
                leaving.cancel()
            finally:
                turn.release()
            return await task

        return await asyncio.shield(asyncio.ensure_future(in_order()))

    async def checkpoint_archive(self, run_id: str, mode: str, step: int, name: str | None = None) -> bytes:
        """A checkpoint's files as .tar.gz bytes, from the runtime that holds them (the caller checked ownership)."""
        async with self.db.session() as session:
            run = await session.get(Run, run_id)
        if run is None:
            raise RunNotFound(f"run {run_id!r} not found", field="runId")
        archive = await self._engine(ExportCheckpoint(run_id=run_id, mode=mode, step=step, name=name), pool=pool_of(run))
        return base64.b64decode(archive.archive_b64)

    async def _engine(self, request: Call[A], pool: PoolKey | None = None, progress: Progress | None = None,
                      ticket: int | None = None, sent: Callable[[], None] | None = None) -> A:
        async def call() -> A:
            return await self.backend.call(request, pool=pool, progress=progress, ticket=ticket, sent=sent)

        try:
            return await sent_until_taken(call)  # a refusal resent here only for callers that cannot (throttle.py)
        except SignalError as error:
            # The engine names fields as its contract does (max_tokens, base_model); clients sent maxTokens.
            if not error.field:
                raise
            raise type(error)(error.message, field=graphql_field(error.field)) from None

    async def _metrics(self, session: AsyncSession, run_id: str, step: int, values: dict[str, float]) -> None:
        """A call's metric rows, in its recording transaction; every server process's subscribers get them as one
        event once it commits (events.MetricFeed)."""
        now = utcnow()
        # NaN is no point on a curve, and SQLite would store it as NULL.
        rows = [Metric(run_id=run_id, step=int(step), name=name, value=float(value), created_at=now)
                for name, value in values.items() if math.isfinite(value)]
        session.add_all(rows)
        await session.flush()  # their ids, for the announcement
        await self.feed.announce(session, run_id, [row.id for row in rows])


def cancelled(params: dict[str, Any], sequence: dict[str, Any]) -> dict[str, Any]:
    """A sample row's params; a sequence cut short by its client going away says so (finish_reason "cancelled")."""
    return {**params, "finish_reason": "cancelled"} if sequence.get("stop_reason") == "cancelled" else params


def _refuse_archived(run: Run, operation: str) -> None:
    if run.archived_at is not None:
        raise FailedPrecondition(f"run {run.id} is archived: unarchive it to {operation} (unarchiveRun, "
                                 "run.unarchive(), or the run's page)", field="runId")


def _aware(moment: datetime) -> datetime:
    """SQLite hands datetimes back naive (they were stored as UTC)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _sent_as(request: C, **changes: Any) -> C:
    """The request with fields set after its checks: the request id a call gets once allowed, a Hub token."""
    return dataclasses.replace(request, **changes)


def throughput(result: ForwardBackwardResult) -> dict[str, float]:
    """A forward_backward's `throughput` metric: its tokens ÷ its compute seconds (none when it took no time)."""
    seconds = result.compute_seconds
    return {"throughput": float(result.num_tokens) / seconds} if seconds > 0 else {}


def loss_metric(reduction: str) -> str:
    """The metric a forward_backward's loss is recorded as: `loss:mean` or `loss:sum` (Tinker's name:reduction)."""
    return f"loss:{reduction}"


def pool_of(run: Run) -> PoolKey:
    """The run's pool: on Modal, the warm container its calls go to (base model, GPU configuration, quantization)."""
    return PoolKey.of(run.base_model, run.gpu_config, run.quantization or None)


def graphql_field(field: str | None) -> str | None:
    """The contract's field names in GraphQL's: `max_tokens` → `maxTokens`, `lora.target_modules` →
    `loraTargetModules` (createRun's flat input), `lora.train_mlp` → `trainMlp` (Tinker's switch names),
    `batch[2].output` as is."""
    if not field:
        return field
    if field.startswith("lora.train_"):
        field = field.removeprefix("lora.")
    elif field.startswith("lora."):
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
