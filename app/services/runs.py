"""Runs and the four training primitives: the one place their rules live.

GraphQL resolvers and dashboard handlers both call this. Every primitive goes through one skeleton (`_apply`, run_calls.py):
ownership first (another user's run is "not found", never data), its arguments checked, the ledger's credit check,
then in the run's order (its ticket: call_order.py) the runtime call, and the call recorded once: its call record, result
and compute seconds in one transaction (call_records.py), which a retry of an applied call completes if it never ran.

RunService is cut by job, one module each:
- run_specs.py: what callers hand it, as values (RunSpec, RunLabels, SampleParams, RUN_SORTS), re-exported here.
- run_calls.py: RunCalls, the skeleton every call goes through: ownership, checks, credits, the run's order, record.
- run_reads.py: RunReads, the reads and labels: the runs list, metrics, samples, checkpoints, archive, label.
- run_sampling.py: RunSampling, samples (a run's weights, a snapshot, a base alone), cancelling, tokenizer work.
- run_checkpoints.py: RunCheckpoints, sampler snapshots, save_state, load_state, deleting and exporting checkpoints.
- runs.py (here): RunService, all of them, with creating and deleting runs and the training primitives.
"""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Callable
from typing import Any

from sqlalchemy import case, delete, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.errors import BadInput, RunNotFound
from app.services.call_order import Numbered
from app.services.call_records import Caller
from app.services.deadlines import Deadline
from app.services.run_calls import FAILED, RunCalls, pool_of
from app.services.run_checkpoints import RunCheckpoints
from app.services.run_reads import MAX_METRICS_LIMIT, RunReads
from app.services.run_sampling import RunSampling, cancelled, checkpoint_source
from app.services.run_specs import (
    RUN_SORTS,
    SAMPLE_LIMITS,
    SEARCH_LENGTH,
    RunLabels,
    RunSpec,
    SampleParams,
    default_run_name,
    graphql_field,
)
from app.services.users import require_admin
from app.tables import Checkpoint, Metric, Run, Sample, User, new_id, utcnow
from gpu_runtime.client.allocation import PoolKey
from gpu_runtime.contract import (
    ADAM_DEFAULTS,
    LORA_SWITCHES,
    BatchItem,
    CreateRun,
    DeleteRun,
    Forward,
    ForwardBackward,
    ForwardBackwardResult,
    ForwardResult,
    OptimStep,
    OptimStepResult,
    RenderDatums,
    RenderDatumsResult,
    RuntimeState,
    checkpoint_ref,
    target_families,
)

# What callers import from here (app/, web/, tests/); each now lives in the module of its job.
__all__ = ["FAILED", "MAX_METRICS_LIMIT", "RUN_SORTS", "SAMPLE_LIMITS", "SEARCH_LENGTH", "RunCalls", "RunLabels",
           "RunService", "RunSpec", "SampleParams", "cancelled", "default_run_name", "graphql_field", "loss_metric",
           "pool_of", "throughput"]

class RunService(RunReads, RunSampling, RunCheckpoints):
    """Runs and their calls: the parts above, one object (app.services.Services.runs)."""

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
        self, user: User, run_id: str, batch: builtins.list[BatchItem], loss_fn: str = "cross_entropy",
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

    async def forward(self, user: User, batch: builtins.list[BatchItem], run_id: str | None = None,
                      base_model: str | None = None, loss_fn: str = "cross_entropy",
                      loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None,
                      order: Numbered | None = None, snapshot: str | None = None,
                      checkpoint: str | None = None) -> ForwardResult:
        """Losses and per-position logprobs with no backward, changing nothing, on a weights source as sample's:
        the caller's run's current weights (`run_id`, in the run's order), a snapshot of it (`snapshot`: off the
        run's queue), or a catalogue base model alone (`base_model`, no run: only its call record is written)."""
        run_id, snapshot, checkpoint = checkpoint_source(run_id, snapshot, checkpoint)

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

    async def render_datums(self, user: User, run_id: str, batch: builtins.list[BatchItem],
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


def throughput(result: ForwardBackwardResult) -> dict[str, float]:
    """A forward_backward's `throughput` metric: its tokens ÷ its compute seconds (none when it took no time)."""
    seconds = result.compute_seconds
    return {"throughput": float(result.num_tokens) / seconds} if seconds > 0 else {}


def loss_metric(reduction: str) -> str:
    """The metric a forward_backward's loss is recorded as: `loss:mean` or `loss:sum` (Tinker's name:reduction)."""
    return f"loss:{reduction}"
