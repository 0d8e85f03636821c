"""The training primitives (RunTraining): forward_backward and optim_step in the run's order, forward on a run's
weights, a snapshot or a base alone, and render_datums; each through RunCalls' skeleton, its metrics written with
its call record."""

from __future__ import annotations

import builtins
import dataclasses
from collections.abc import Mapping
from typing import Any

from sqlalchemy import case, update
from sqlalchemy.ext.asyncio import AsyncSession

from app.errors import BadInput
from app.services.call_order import Numbered
from app.services.call_records import Caller
from app.services.deadlines import Deadline
from app.services.run_calls import RunCalls
from app.services.run_sampling import checkpoint_source
from app.tables import Run, User, new_id
from gpu_runtime.client.allocation import PoolKey
from gpu_runtime.contract import (
    ADAM_DEFAULTS,
    BatchItem,
    Forward,
    ForwardBackward,
    ForwardBackwardResult,
    ForwardResult,
    OptimStep,
    OptimStepResult,
    RenderDatums,
    RenderDatumsResult,
)
from gpu_runtime.contract.json_types import JSONObject


class RunTraining:
    def __init__(self, calls: RunCalls) -> None:
        self.calls = calls

    async def forward_backward(
        self, user: User, run_id: str, batch: builtins.list[BatchItem], loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None, reduction: str = "mean",
        return_outputs: bool = False, order: Numbered | None = None, custom_loss: JSONObject | None = None,
    ) -> ForwardBackwardResult:
        """Loss and gradients of a batch. `reduction` is the step's (one per step: another is FAILED_PRECONDITION);
        `return_outputs` asks for per-datum, per-position logprobs and losses (a retried call's answer has none)."""
        def arguments(run: Run) -> ForwardBackward:
            if not isinstance(batch, list) or not batch:
                raise BadInput("batch must be a non-empty list of examples", field="batch")
            return ForwardBackward(run_id=run.id, batch=batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                                   custom_loss=custom_loss, reduction=reduction, return_outputs=return_outputs)

        async def record(session: AsyncSession, run: Run, result: ForwardBackwardResult,
                         fresh: bool) -> ForwardBackwardResult:
            if fresh:
                # Metric names carry their reduction (Tinker's name:reduction): loss:mean, loss:sum.
                await self.calls.metrics(session, run.id, result.step, {
                    loss_metric(result.reduction): result.loss,
                    "num_tokens": result.num_tokens, "num_examples": result.num_examples,
                    **throughput(result),
                })
            return result

        return await self.calls.apply(user, run_id, "forward_backward", request_id, arguments, record, order=order)

    async def forward(self, user: User, batch: builtins.list[BatchItem], run_id: str | None = None,
                      base_model: str | None = None, loss_fn: str = "cross_entropy",
                      loss_fn_config: dict[str, Any] | None = None, request_id: str | None = None,
                      order: Numbered | None = None, snapshot: str | None = None,
                      checkpoint: str | None = None, custom_loss: JSONObject | None = None) -> ForwardResult:
        """Losses and per-position logprobs with no backward, changing nothing, on a weights source as sample's:
        the caller's run's current weights (`run_id`, in the run's order), a snapshot of it (`snapshot`: off the
        run's queue), or a catalogue base model alone (`base_model`, no run: only its call record is written)."""
        run_id, snapshot, checkpoint = checkpoint_source(run_id, snapshot, checkpoint)

        def on(run: Run) -> Forward:
            return Forward(run_id=run.id, batch=batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                           custom_loss=custom_loss, snapshot=snapshot, checkpoint=checkpoint)

        async def record(session: AsyncSession, run: Run, result: ForwardResult, fresh: bool) -> ForwardResult:
            return result  # nothing changed, so nothing to record beyond the call record

        if run_id is not None:
            if base_model is not None:
                raise BadInput("forward takes runId or baseModel, not both", field="baseModel")
            if snapshot is not None or checkpoint is not None:
                return await self.calls.off_the_queue(user, run_id, "forward", request_id, on, record,
                                                      frozen=(snapshot, checkpoint))
            return await self.calls.apply(user, run_id, "forward", request_id, on, record, order=order)
        if snapshot is not None or checkpoint is not None:
            raise BadInput("snapshot and checkpoint name a run's weights: give runId too",
                           field="snapshot" if snapshot is not None else "checkpoint")
        if not base_model:
            raise BadInput("forward needs runId or baseModel", field="baseModel")
        deadline = Deadline.start(self.calls.deadlines, "forward")
        model = self.calls.catalog.get(base_model)
        request = self.calls.checked(Forward(batch=batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config,
                                        custom_loss=custom_loss, base_model=model.source, user_id=user.id, request_id=request_id))
        gpu_config = self.calls.catalog.resolve_gpu(model, None, None)
        pool = PoolKey.of(model.name, gpu_config, None)
        request = dataclasses.replace(request, request_id=request_id or new_id())
        request_id = str(request.request_id)
        result = await self.calls.answered(deadline, pool, user, request_id, self.calls.engine(request, pool=pool))
        caller = Caller(user.id, None, model.name, await self.calls.device(pool), gpu_config)

        async def answer(session: AsyncSession, fresh: bool) -> ForwardResult:
            return result  # changes nothing: its call record (usage) is all it leaves

        return await self.calls.recorder.record(caller, "forward", request_id, result, answer)

    async def render_datums(self, user: User, run_id: str, batch: builtins.list[BatchItem],
                            loss_fn: str = "cross_entropy") -> RenderDatumsResult:
        """The datums the runtime would build for `batch` on the run's model; nothing is applied or billed."""
        run = await self.calls.get(user, run_id)
        return await self.calls.on_run(run, self.calls.checked(RenderDatums(run_id=run.id, batch=batch, loss_fn=loss_fn)))

    async def optim_step(self, user: User, run_id: str, adam: Mapping[str, float | None] | None = None,
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
            await self.calls.metrics(session, run.id, step, {
                "grad_norm": result.grad_norm, "learning_rate": result.learning_rate,
            })
            return result

        return await self.calls.apply(user, run_id, "optim_step", request_id, arguments, record, order=order)


def throughput(result: ForwardBackwardResult) -> dict[str, float]:
    """A forward_backward's `throughput` metric: its tokens ÷ its compute seconds (none when it took no time)."""
    seconds = result.compute_seconds
    return {"throughput": float(result.num_tokens) / seconds} if seconds > 0 else {}


def loss_metric(reduction: str) -> str:
    """The metric a forward_backward's loss is recorded as: `loss:mean` or `loss:sum` (Tinker's name:reduction)."""
    return f"loss:{reduction}"
