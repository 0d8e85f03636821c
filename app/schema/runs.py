"""GraphQL types of runs and what they keep: metrics, samples, checkpoints, training events; each built from a row.

Parameter and byte counts are Floats: GraphQL's Int is 32-bit and a 70B model does not fit.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Any

import strawberry
from strawberry.scalars import JSON

from app import tables
from app.events import MetricEvent
from app.schema.context import Info
from app.services.ledger import gpu_seconds
from gpu_runtime.contract import CheckpointRef


@strawberry.type
class Metric:
    step: int
    name: str
    value: float
    created_at: datetime

    @classmethod
    def from_row(cls, row: tables.Metric) -> Metric:
        return cls(step=row.step, name=row.name, value=row.value, created_at=row.created_at)


@strawberry.type
class Sample:
    id: strawberry.ID
    step: int
    prompt: str
    output: str
    params: JSON
    created_at: datetime

    @classmethod
    def from_row(cls, row: tables.Sample) -> Sample:
        return cls(id=strawberry.ID(str(row.id)), step=row.step, prompt=row.prompt, output=row.output,
                   params=JSON(row.params), created_at=row.created_at)


@strawberry.type(description="A sample of a base model alone (no run): the caller's own history of them")
class BaseSample:
    id: strawberry.ID
    base_model: str
    prompt: str
    output: str
    params: JSON
    created_at: datetime

    @classmethod
    def from_row(cls, row: tables.BaseSample) -> BaseSample:
        return cls(id=strawberry.ID(str(row.id)), base_model=row.base_model, prompt=row.prompt, output=row.output,
                   params=JSON(row.params), created_at=row.created_at)


@strawberry.type
class Checkpoint:
    id: strawberry.ID
    step: int
    mode: str = strawberry.field(description="Its kind: adapter, merged, state (resumable), or sampler (a snapshot)")
    name: str = strawberry.field(description="Unique per run and mode; step-N when saved without one; a sampler "
                                 "snapshot's name is what sample's `snapshot` takes")
    checkpoint_path: str
    size_bytes: float
    hub_url: str | None = strawberry.field(description="The Hugging Face repo it was pushed to (pushToHub), else null")
    created_at: datetime
    run_id: strawberry.Private[str]
    expires_at: datetime | None = strawberry.field(default=None, description="An unnamed sampler snapshot's expiry")
    with_optimizer: bool = strawberry.field(default=False, description="AdamW's state is in it: loadState with "
                                            "withOptimizer resumes the run exactly")
    pending_excluded: int = strawberry.field(default=0, description="forward_backward calls whose gradients were "
                                             "pending when it was saved: not in it")

    @strawberry.field(description="GET it with the API key (Bearer) or a dashboard session: the checkpoint's "
                      "files as a .tar.gz")
    def download_url(self, info: Info) -> str:
        settings = info.context.services.settings
        request = info.context.request
        # SIGNAL_PUBLIC_URL when set (behind a proxy); otherwise the address this request came in on.
        base = settings.public_url or (str(request.base_url) if request is not None else settings.resolved_public_url)
        return f"{base.rstrip('/')}/runs/{self.run_id}/checkpoints/{self.id}/archive"

    @strawberry.field(description="What loadState and createRun(fromCheckpoint) take: signal://<runId>/<mode>/<name>")
    def path(self) -> str:
        return CheckpointRef(self.run_id, self.mode, self.name).path

    @classmethod
    def from_row(cls, row: tables.Checkpoint) -> Checkpoint:
        return cls(id=strawberry.ID(str(row.id)), step=row.step, mode=row.mode, name=row.name, checkpoint_path=row.path,
                   size_bytes=float(row.size_bytes), hub_url=row.hub_url, created_at=row.created_at, run_id=row.run_id,
                   expires_at=row.expires_at, with_optimizer=row.with_optimizer,
                   pending_excluded=row.pending_excluded)


@strawberry.type
class Run:
    id: strawberry.ID
    name: str = strawberry.field(description="Its owner's name for it (not unique); createRun's default: base model "
                                 "and UTC minute. Empty for runs older than this field")
    tags: list[str]
    note: str
    archived_at: datetime | None = strawberry.field(
        description="When it was archived: hidden from runs' default list, its training and sampling refused "
        "(FAILED_PRECONDITION) until unarchived; null when it is not")
    base_model: str
    status: str = strawberry.field(description="Either active, or failed once its runtime no longer has the run")
    step: int = strawberry.field(description="optim_steps applied and persisted")
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: list[str] | None
    learning_rate: float
    optimizer: JSON = strawberry.field(description="AdamW defaults for optimStep")
    seed: int
    gpu_config: str = strawberry.field(description='The requested allocation, e.g. "L40S:1", and its pool\'s key: '
                                       'what a pool on Modal gets. The local runtime trains on its own device')
    device: str | None = strawberry.field(
        description='What it trains on, as its runtime reported: "cpu", "cuda:0"; null for runs older than this field')
    quantization: str | None = strawberry.field(description='"8bit" / "4bit" when its base is quantized, else null')
    trainable_params: float
    total_params: float
    compute_seconds: float = strawberry.field(
        description="Device seconds its calls took (a co-batched pass shared among its runs by token share)")
    gpu_seconds: float = strawberry.field(
        description="computeSeconds × the GPUs it trains on (gpuConfig's count); 0 on the CPU (device cpu)")
    created_at: datetime
    updated_at: datetime
    row: strawberry.Private[tables.Run]

    @strawberry.field(description="Its cost so far in credits: gpuSeconds × the server's SIGNAL_GPU_SECOND_RATE, "
                      "or on the CPU computeSeconds × SIGNAL_CPU_SECOND_RATE")
    def cost(self, info: Info) -> float:
        return info.context.services.runs.ledger.cost(self.row).credits

    @strawberry.field
    async def metrics(self, info: Info, name: str | None = None, limit: int = 1000) -> list[Metric]:
        rows = await info.context.services.runs.metrics(self.row, name=name, limit=limit)
        return [Metric.from_row(row) for row in rows]

    @strawberry.field
    async def samples(self, info: Info, limit: int = 100) -> list[Sample]:
        return [Sample.from_row(row) for row in await info.context.services.runs.samples(self.row, limit=limit)]

    @strawberry.field
    async def checkpoints(self, info: Info) -> list[Checkpoint]:
        return [Checkpoint.from_row(row) for row in await info.context.services.runs.checkpoints(self.row)]

    @strawberry.field(description="Its sampler snapshots (saveWeightsForSampler): mode sampler, by name")
    async def snapshots(self, info: Info) -> list[Checkpoint]:
        rows = await info.context.services.runs.checkpoints(self.row)
        return [Checkpoint.from_row(row) for row in rows if row.mode == "sampler"]

    @classmethod
    def from_row(cls, row: tables.Run) -> Run:
        lora, adam = row.lora_config, row.optimizer_config
        return cls(
            id=strawberry.ID(row.id), name=row.name, tags=list(row.tags or []), note=row.note,
            archived_at=row.archived_at, base_model=row.base_model, status=row.status, step=row.step,
            lora_r=int(lora["r"]), lora_alpha=float(lora["alpha"]), lora_dropout=float(lora["dropout"]),
            lora_target_modules=lora.get("target_modules"), learning_rate=float(adam["learning_rate"]),
            optimizer=JSON(adam), seed=row.seed, gpu_config=row.gpu_config, device=row.device or None,
            quantization=row.quantization or None,
            trainable_params=float(row.trainable_params), total_params=float(row.total_params),
            compute_seconds=float(row.compute_seconds or 0.0), gpu_seconds=gpu_seconds(row),
            created_at=row.created_at, updated_at=row.updated_at, row=row,
        )


@strawberry.type
class TrainingEvent:
    run_id: strawberry.ID
    kind: str = strawberry.field(description="forward_backward or optim_step")
    step: int
    loss: float | None = None
    num_tokens: int | None = None
    num_examples: int | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    created_at: datetime | None = None

    @classmethod
    def from_event(cls, event: MetricEvent) -> TrainingEvent:
        def number(key: str) -> Any:  # a metric the call wrote (int or float, as recorded), or None
            value = event.get(key)
            return value if isinstance(value, (int, float)) else None

        created = event.get("created_at")
        return cls(run_id=strawberry.ID(str(event["run_id"])), kind=str(event["kind"]), step=number("step"),
                   created_at=created if isinstance(created, datetime) else None, loss=number("loss"),
                   num_tokens=number("num_tokens"), num_examples=number("num_examples"),
                   grad_norm=number("grad_norm"), learning_rate=number("learning_rate"))


@strawberry.enum
class SaveMode(Enum):
    ADAPTER = "adapter"
    MERGED = "merged"
    STATE = "state"


@strawberry.enum(description="The order of the runs list")
class RunSort(Enum):
    NEWEST = "newest"
    OLDEST = "oldest"
    NAME = "name"
    ACTIVITY = "activity"
    STEP = "step"
