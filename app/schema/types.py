"""GraphQL output types, each built from a table row or an engine result.

Parameter and byte counts are Floats: GraphQL's Int is 32-bit and a 70B model does not fit.
"""

from __future__ import annotations

from datetime import date, datetime
from enum import Enum
from typing import Any

import strawberry
from strawberry.scalars import JSON

from app import tables
from app.catalog import CatalogModel
from app.schema.context import Info
from app.services import usage
from app.services.ledger import gpu_seconds
from gpu_runtime import contract
from gpu_runtime.contract import CheckpointRef, RenderedDatum


@strawberry.type(name="BaseModel")
class ModelInfo:
    name: str
    family: str
    parameters: float
    gpu: str = strawberry.field(description="GPU allocation the rules pick for it, e.g. L40S:1")
    offline: bool = strawberry.field(description="Ships with Signal; needs no download")
    description: str
    context_length: int | None = strawberry.field(description="Context window in tokens; null when unknown")
    framework: str = strawberry.field(description="What trains it: transformers, or unsloth (CUDA only)")
    quantization_allowed: bool = strawberry.field(description="Whether its base may be loaded in 8 or 4 bits")
    quantized: str | None = strawberry.field(description='"4bit" / "8bit" when its published weights already are')
    available: bool = strawberry.field(description="Whether runs can be created on it on this server")
    unavailable_reason: str | None = strawberry.field(description="Why not, when it is unavailable")
    estimated_memory_gb: float = strawberry.field(
        description="GPU memory a run needs at the default LoRA rank: bf16 weights, LoRA with AdamW state, activations")

    @classmethod
    def from_catalog(cls, model: CatalogModel) -> ModelInfo:
        return cls(name=model.name, family=model.family, parameters=float(model.parameters), gpu=model.gpu,
                   offline=model.offline, description=model.description, context_length=model.context_length,
                   framework=model.framework, quantization_allowed=model.quantization_allowed, quantized=model.quantized,
                   available=model.available, unavailable_reason=model.unavailable,
                   estimated_memory_gb=model.estimated_memory_gb)


@strawberry.type(description="What this server accepts in one call")
class Limits:
    max_batch_size: int = strawberry.field(description="Most items one forwardBackward carries (SIGNAL_MAX_BATCH_SIZE)")


@strawberry.type
class User:
    id: strawberry.ID
    email: str
    name: str
    is_admin: bool
    created_at: datetime

    @classmethod
    def from_row(cls, row: tables.User) -> User:
        return cls(id=strawberry.ID(row.id), email=row.email, name=row.name, is_admin=row.is_admin,
                   created_at=row.created_at)


@strawberry.type
class ApiKey:
    id: strawberry.ID
    name: str
    prefix: str = strawberry.field(description="First characters of the secret, for recognising it")
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @strawberry.field
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_row(cls, row: tables.ApiKey) -> ApiKey:
        return cls(id=strawberry.ID(row.id), name=row.name, prefix=row.prefix, created_at=row.created_at,
                   last_used_at=row.last_used_at, revoked_at=row.revoked_at)


@strawberry.type
class CreatedApiKey:
    secret: str = strawberry.field(description="The key itself; shown this once, never stored")
    api_key: ApiKey


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


@strawberry.type(description="One line of usage: a run's, a day's, or the window's total, from the call records")
class UsageLine:
    key: str = strawberry.field(description="The run id (empty: base models alone), the day (YYYY-MM-DD), or empty")
    label: str = strawberry.field(description="The run's name, the day, or 'total'")
    calls: int
    compute_seconds: float
    gpu_seconds: float
    credits: float = strawberry.field(description="At the rates in force when each call was recorded")
    tokens_trained: int = strawberry.field(description="forwardBackward's weighted target tokens")
    tokens_sampled: int = strawberry.field(description="sample's generated tokens")

    @classmethod
    def of(cls, line: usage.Usage) -> UsageLine:
        return cls(key=line.key, label=line.label, calls=line.calls, compute_seconds=line.compute_seconds,
                   gpu_seconds=line.gpu_seconds, credits=line.credits, tokens_trained=line.tokens_trained,
                   tokens_sampled=line.tokens_sampled)


@strawberry.type(description="A user's usage over the last `days` days (UTC, today included)")
class UsageReport:
    user_id: strawberry.ID
    days: int
    since: date
    total: UsageLine
    by_day: list[UsageLine] = strawberry.field(description="Newest day first; days without calls are left out")
    by_run: list[UsageLine] = strawberry.field(description="Most compute first")

    @classmethod
    def of(cls, report: usage.UsageReport) -> UsageReport:
        return cls(user_id=strawberry.ID(report.user.id), days=report.days, since=report.since,
                   total=UsageLine.of(report.total), by_day=[UsageLine.of(line) for line in report.by_day],
                   by_run=[UsageLine.of(line) for line in report.by_run])


@strawberry.type(description="What loadState did: the run's step is the checkpoint's now")
class LoadStateResult:
    checkpoint: str
    step: int
    with_optimizer: bool
    pending_dropped: int = strawberry.field(description="forwardBackward calls pending before the load, now gone")


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


@strawberry.type(description="One datum's per-position values, each as long as its modelInput")
class DatumOutput:
    logprobs: list[float] = strawberry.field(description="log p(targetTokens[i]) under the weights that ran, at T=1")
    elementwise_loss: list[float]


def datum_outputs(outputs: list[dict[str, Any]] | None) -> list[DatumOutput] | None:
    if outputs is None:
        return None
    return [DatumOutput(logprobs=o["logprobs"], elementwise_loss=o["elementwise_loss"]) for o in outputs]


@strawberry.type
class ForwardBackwardResult:
    loss: float = strawberry.field(description='reduction "mean": the loss per counted position; "sum": the raw sum')
    num_tokens: int
    num_examples: int
    step: int
    reduction: str
    outputs: list[DatumOutput] | None = strawberry.field(
        default=None, description="Per datum, per position; computed only when selected. A retried call's answer has none")


@strawberry.type
class ForwardResult:
    loss: float = strawberry.field(description="The loss per counted position (a mean)")
    loss_sum: float
    num_tokens: int
    num_examples: int
    step: int | None = strawberry.field(description="The run's step whose weights ran; null for a base model")
    outputs: list[DatumOutput]


@strawberry.type(description="A datum's per-position inputs, as the server renders them")
class DatumInputs:
    target_tokens: list[int]
    weights: list[float] | None = None
    advantages: list[float] | None = None
    logprobs: list[float] | None = None
    clip_low_threshold: list[float] | None = None
    clip_high_threshold: list[float] | None = None


@strawberry.type(description="A datum at token level (Tinker's shape): position i predicts targetTokens[i]")
class Datum:
    model_input: list[int]
    loss_fn_inputs: DatumInputs

    @classmethod
    def from_dict(cls, datum: RenderedDatum) -> Datum:
        return cls(model_input=list(datum["model_input"]), loss_fn_inputs=DatumInputs(**datum["loss_fn_inputs"]))


@strawberry.type
class OptimStepResult:
    step: int
    grad_norm: float
    learning_rate: float


@strawberry.type(description="A token and the model's logprob of it")
class TokenLogprob:
    token: int
    logprob: float

    @classmethod
    def pairs(cls, pairs: list[list[float]] | None) -> list[TokenLogprob] | None:
        return None if pairs is None else [cls(token=int(t), logprob=float(v)) for t, v in pairs]


@strawberry.type
class SampledSequence:
    text: str = strawberry.field(description="The decoded tokens, cut before a stop string, stop token or EOS")
    tokens: list[int] = strawberry.field(description="Sampled token ids, the stop token (or the one completing a "
                                         "stop string) included")
    logprobs: list[float] = strawberry.field(
        description="Each token's logprob under the unmodified model (temperature 1, no top-k/top-p): what a "
        "teacher-forced forward returns, so samples at another temperature are off-policy (docs/SAMPLING.md)")
    stop_reason: str = strawberry.field(description="stop (a stop or EOS) or length (maxTokens)")
    topk_logprobs: list[list[TokenLogprob]] | None = strawberry.field(
        default=None, description="Per token, the topkSampleLogprobs most likely tokens, most likely first")


@strawberry.type(description="A frozen copy of a run's weights to sample from (docs/SNAPSHOTS.md)")
class SamplerSnapshot:
    run_id: strawberry.ID
    name: str = strawberry.field(description="Pass it as sample's `snapshot` with the run's id")
    step: int = strawberry.field(description="The run's step when it was frozen")
    named: bool = strawberry.field(description="Named: kept on disk, listed and downloadable; unnamed: expires")
    expires_in_seconds: float | None = strawberry.field(description="Unnamed only: seconds until it expires")

    @classmethod
    def from_result(cls, result: contract.SaveWeightsForSamplerResult) -> SamplerSnapshot:
        return cls(run_id=strawberry.ID(result.run_id), name=result.name, step=result.step, named=result.named,
                   expires_in_seconds=result.expires_in_seconds)


@strawberry.type
class SampleResult:
    outputs: list[str] = strawberry.field(description="The first sample of each prompt, in prompt order")
    sequences: list[list[SampledSequence]]
    prompt_tokens: list[list[int]] = strawberry.field(description="Each prompt's token ids, as the model saw them")
    step: int = strawberry.field(description="The run's step (optim_steps applied) whose weights sampled")
    prompt_logprobs: list[list[float | None]] | None = strawberry.field(
        default=None, description="With promptLogprobs: per prompt, each prompt token's logprob (null at position 0)")
    topk_prompt_logprobs: list[list[list[TokenLogprob] | None]] | None = strawberry.field(
        default=None, description="With topkPromptLogprobs: per prompt, per position, the most likely tokens, most "
        "likely first (null at position 0)")

    @classmethod
    def from_result(cls, result: contract.SampleResult) -> SampleResult:
        topk_prompt = result.topk_prompt_logprobs
        return cls(
            outputs=list(result.outputs),
            prompt_tokens=[list(ids) for ids in result.prompt_tokens],
            step=result.step,
            sequences=[
                [SampledSequence(text=s["text"], tokens=list(s["tokens"]), logprobs=[float(x) for x in s["logprobs"]],
                                 stop_reason=s["stop_reason"],
                                 topk_logprobs=None if s.get("topk_logprobs") is None else
                                 [TokenLogprob.pairs(p) or [] for p in s["topk_logprobs"]])
                 for s in per_prompt]
                for per_prompt in result.sequences
            ],
            prompt_logprobs=result.prompt_logprobs,
            topk_prompt_logprobs=None if topk_prompt is None else
            [[TokenLogprob.pairs(p) for p in per_prompt] for per_prompt in topk_prompt],
        )


@strawberry.type(description="A base model's tokenizer: what a client without it needs for token-level calls")
class TokenizerInfo:
    name: str = strawberry.field(description="The name or path the tokenizer loads from")
    vocab_size: int = strawberry.field(description="Token ids are 0..vocabSize-1")
    eos_token_ids: list[int] = strawberry.field(description="The ids that stop sampling when stop is omitted")
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None = strawberry.field(description="Its Jinja chat template, if it has one")

    @classmethod
    def from_result(cls, result: contract.TokenizerResult) -> TokenizerInfo:
        return cls(name=result.name, vocab_size=result.vocab_size, eos_token_ids=list(result.eos_token_ids),
                   bos_token_id=result.bos_token_id, pad_token_id=result.pad_token_id,
                   chat_template=result.chat_template)


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
    def from_event(cls, event: dict[str, Any]) -> TrainingEvent:
        fields = {k: event.get(k) for k in ("loss", "num_tokens", "num_examples", "grad_norm", "learning_rate")}
        return cls(run_id=strawberry.ID(event["run_id"]), kind=event["kind"], step=event["step"],
                   created_at=event.get("created_at"), **fields)


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
