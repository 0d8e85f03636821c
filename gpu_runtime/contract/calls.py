"""The runtime's calls as types: a `Method` enum and one frozen request dataclass per method.

The same request crosses the local socket and Modal's `.remote()` as `to_dict()` and is rebuilt with
`from_dict`, which refuses unknown and missing arguments. `validate()` holds every check that needs no
model; the server runs it before a call leaves it and the runtime runs it again on arrival. Checks that
need the model (vocabulary, context, chat template, target modules) run in the runtime only.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Generic, cast

from typing_extensions import TypeVar  # a TypeVar with a default: a bare `Call` is a call answered by some Result

from gpu_runtime.contract.results import (
    CancelResult,
    CloseRunResult,
    DeleteCheckpointResult,
    DeleteRunResult,
    ExportCheckpointResult,
    ForwardBackwardResult,
    ForwardResult,
    LoadStateResult,
    OptimStepResult,
    PingResult,
    RenderChatResult,
    RenderDatumsResult,
    Result,
    RunDescription,
    RuntimeStateResult,
    SampleResult,
    SaveStateResult,
    SaveWeightsForSamplerResult,
    TokenizerResult,
)
from gpu_runtime.contract.settings import (
    CHECKPOINT_KINDS,
    DEFAULT_LOSS_FN,
    DEFAULT_REDUCTION,
    MAX_RUN_SEED,
    SAMPLE_DEFAULTS,
    SAVE_MODES,
    RuntimeOptions,
    SamplingSettings,
    adam_settings,
    check_batch_size,
    check_batch_text,
    check_checkpoint_name,
    check_id,
    check_request_id,
    check_sample_size,
    check_seed,
    check_snapshot_name,
    checkpoint_ref,
    known_batch_tokens,
    lora_settings,
    loss_settings,
    sampling_prompts,
    sampling_settings,
)
from gpu_runtime.errors import BadInput

# Bumped whenever a request or result changes shape: the runtime says it in its greeting, and a server that
# meets another version refuses to talk to it (a detached runtime outlives its server; a Modal deployment lags).
# 4: RuntimeOptions gained the per-call bounds (max_batch_tokens, max_sample_rows, ...) and ping the version.
# 5: sample gained `stream` (SampleChunk progress lines before its result) and the `cancel` call.
# 6: the tokenizer call's `save` (Tinker's get_info tokenizer directory).
# 7: cancel gained `deadline` (a call withdrawn at its deadline answers DEADLINE_EXCEEDED).
# 8: RuntimeOptions gained export_limit_bytes (the dashboard reads the same bound the runtime enforces).
# 9: sample gained `latest` (a run's current weights as they are when it arrives, off the run's queue).
# 10: cancel gained `withdraw` (a decoding sample whose client saw none of it is withdrawn, not answered in part).
CONTRACT_VERSION = 10


class Method(enum.StrEnum):
    CREATE_RUN = "create_run"
    FORWARD_BACKWARD = "forward_backward"
    FORWARD = "forward"
    RENDER_DATUMS = "render_datums"
    OPTIM_STEP = "optim_step"
    SAMPLE = "sample"
    SAVE_STATE = "save_state"
    LOAD_RUN = "load_run"
    RUN_INFO = "run_info"
    CLOSE_RUN = "close_run"
    DELETE_RUN = "delete_run"
    EXPORT_CHECKPOINT = "export_checkpoint"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    LOAD_STATE = "load_state"
    DELETE_CHECKPOINT = "delete_checkpoint"
    PING = "ping"
    RUNTIME_STATE = "runtime_state"
    TOKENIZER = "tokenizer"
    RENDER_CHAT = "render_chat"
    CANCEL = "cancel"


R = TypeVar("R", bound="Call")
A = TypeVar("A", bound=Result, default=Result, covariant=True)  # what a call is answered with


@dataclass(frozen=True, kw_only=True)
class Call(Generic[A]):
    """A request to the runtime, answered with an `A`. Subclasses name their `method` and their `answer` type (the
    same A); runs' calls carry `run_id`."""

    method: ClassVar[Method]
    answer: ClassVar[type[Result]]

    def to_dict(self) -> dict[str, Any]:
        # Shallow: the fields are plain data already, and a deep copy of a large batch costs milliseconds per call.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def result(self, data: dict[str, Any]) -> A:
        """Its answer as it came over the wire, typed (unknown fields dropped: Result.from_dict)."""
        return cast(A, self.answer.from_dict(data))

    def body_sha256(self) -> str:
        """What a request id stands for: the method and every argument but the id itself and a Hub token (a retry may
        carry a refreshed one, and nothing derived from it is written down). A run remembers it beside each answer,
        so the same id with another body is refused rather than answered with the first call's result."""
        body = {k: v for k, v in self.to_dict().items() if k not in ("request_id", "hf_token")}
        canonical = json.dumps({"method": str(self.method), "body": body}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_dict(cls: type[R], params: Any) -> R:
        if not isinstance(params, dict) or any(not isinstance(k, str) or k.startswith("_") for k in params):
            raise BadInput("params must be an object of the method's arguments", field="params")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - names)
        if unknown:
            raise BadInput(f"{cls.method}: unexpected argument {unknown[0]!r}; it takes {sorted(names)}", field="params")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING and f.name not in params]
        if missing:
            raise BadInput(f"{cls.method}: missing argument {missing[0]!r}", field="params")
        return cls(**params)

    def validate(self) -> None:
        """Every check that needs no model (run again by the runtime)."""

    def check_size(self, options: RuntimeOptions) -> None:
        """The per-call size bounds that need no model, against `options` (the server's settings before the call
        leaves, the runtime's own on arrival); the runtime checks again once it has tokenized."""

    @property
    def run(self) -> str | None:
        return getattr(self, "run_id", None)


@dataclass(frozen=True, kw_only=True)
class RunCall(Call[A]):
    run_id: str

    def validate(self) -> None:
        check_id(self.run_id, "run_id")


@dataclass(frozen=True, kw_only=True)
class CreateRun(RunCall[RunDescription]):
    method = Method.CREATE_RUN
    answer = RunDescription
    user_id: str
    base_model: str
    lora: dict[str, Any] | None = None
    seed: int | None = None  # None: 0, or the checkpoint's
    quantization: str | None = None
    # signal://<run_id>/<kind>/<name>: start from that checkpoint's adapter (and its AdamW with with_optimizer),
    # inheriting its seed, step and LoRA settings; `lora` keys and `seed` given as well must agree with them.
    from_checkpoint: str | None = None
    with_optimizer: bool = True

    def validate(self) -> None:
        super().validate()
        check_id(self.user_id, "user_id")
        if self.seed is not None:
            check_seed(self.seed, MAX_RUN_SEED)
        if not isinstance(self.base_model, str) or not self.base_model:
            raise BadInput("base_model must be a model name or path", field="base_model")
        if not isinstance(self.with_optimizer, bool):
            raise BadInput("with_optimizer must be true or false", field="with_optimizer")
        if self.from_checkpoint is None:
            lora_settings(self.lora)  # shape only: the targets are checked against the model in the runtime
        else:
            checkpoint_ref(self.from_checkpoint, "from_checkpoint")
            if self.lora is not None and not isinstance(self.lora, dict):
                raise BadInput("lora must be an object", field="lora")


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, list) or not batch:
        raise BadInput("batch must be a non-empty list of examples", field="batch")
    check_batch_text(batch)


class _Batched:
    """A call carrying a batch: bounded in items and in the tokens countable before rendering."""

    batch: list[dict[str, Any]]

    def check_size(self, options: RuntimeOptions) -> None:
        check_batch_size(len(self.batch), known_batch_tokens(self.batch), options)


@dataclass(frozen=True, kw_only=True)
class ForwardBackward(_Batched, RunCall[ForwardBackwardResult]):
    method = Method.FORWARD_BACKWARD
    answer = ForwardBackwardResult
    batch: list[dict[str, Any]]
    loss_fn: str = DEFAULT_LOSS_FN
    loss_fn_config: dict[str, Any] | None = None
    reduction: str = DEFAULT_REDUCTION  # every call between two optim_steps uses the same one
    return_outputs: bool = False  # per-datum, per-position logprobs and elementwise_loss in the result
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        _check_batch(self.batch)
        loss_settings(self.loss_fn, self.loss_fn_config, self.reduction)
        if not isinstance(self.return_outputs, bool):
            raise BadInput("return_outputs must be a boolean", field="return_outputs")


@dataclass(frozen=True, kw_only=True)
class Forward(_Batched, Call[ForwardResult]):
    """The loss and per-position logprobs of a batch, with no backward: nothing of the run changes (no gradient,
    no dropout, no counter). Its weights, as a sample's (gpu_runtime/weights_sources.py): `run_id`'s current ones
    (in the run's queue), `run_id` + `snapshot` (frozen: off the queue), or with run_id None the base model alone."""

    method = Method.FORWARD
    answer = ForwardResult
    batch: list[dict[str, Any]]
    run_id: str | None = None
    snapshot: str | None = None  # a sampler snapshot's name on the run (save_weights_for_sampler)
    checkpoint: str | None = None  # a training checkpoint's name on the run (not readable yet: refused)
    base_model: str | None = None  # with run_id None: the base to run (rows reach no adapter)
    user_id: str | None = None  # with run_id None: whose call it is
    loss_fn: str = DEFAULT_LOSS_FN
    loss_fn_config: dict[str, Any] | None = None
    request_id: str | None = None

    def validate(self) -> None:
        check_request_id(self.request_id)
        check_weights_source(self)
        _check_batch(self.batch)
        loss_settings(self.loss_fn, self.loss_fn_config)

    @property
    def frozen(self) -> bool:
        """On a snapshot or checkpoint: off the run's queue, like such a sample (a base alone rides the system lane)."""
        return self.run_id is not None and (self.snapshot is not None or self.checkpoint is not None)


@dataclass(frozen=True, kw_only=True)
class RenderDatums(_Batched, RunCall[RenderDatumsResult]):
    """The datums the runtime would build for a batch of Signal items (renderDatums), changing nothing."""

    method = Method.RENDER_DATUMS
    answer = RenderDatumsResult
    batch: list[dict[str, Any]]
    loss_fn: str = DEFAULT_LOSS_FN

    def validate(self) -> None:
        super().validate()
        _check_batch(self.batch)
        loss_settings(self.loss_fn, None)


@dataclass(frozen=True, kw_only=True)
class OptimStep(RunCall[OptimStepResult]):
    method = Method.OPTIM_STEP
    answer = OptimStepResult
    adam: dict[str, Any] | None = None
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        adam_settings(self.adam)

    def settings(self) -> dict[str, float]:
        return adam_settings(self.adam)


@dataclass(frozen=True, kw_only=True)
class Sample(Call[SampleResult]):
    """Sampling from one weights source (gpu_runtime/weights_sources.py): `run_id` alone (the run's current weights,
    in its queue), `run_id` + `snapshot` or `checkpoint` (frozen weights: off the run's queue), or no `run_id` and
    `base_model` + `user_id` (the base alone). `run_id` + `latest`: the run's current weights as they are when the
    call arrives, copied for it (off the run's queue, like a snapshot: gpu_runtime/snapshots.py, `Snapshots.latest`)."""

    method = Method.SAMPLE
    answer = SampleResult
    prompts: list[str] | None = None  # exactly one of prompts (text) and prompt_tokens (token ids)
    prompt_tokens: list[list[int]] | None = None
    run_id: str | None = None
    snapshot: str | None = None  # a sampler snapshot's name on the run (save_weights_for_sampler)
    checkpoint: str | None = None  # a training checkpoint's name on the run
    base_model: str | None = None  # with run_id None: the base alone
    user_id: str | None = None  # whose base-model sample it is (billing, fair turns)
    max_tokens: int = SAMPLE_DEFAULTS["max_tokens"]
    temperature: float = SAMPLE_DEFAULTS["temperature"]
    top_p: float = SAMPLE_DEFAULTS["top_p"]
    top_k: int = SAMPLE_DEFAULTS["top_k"]  # 0 or -1: off
    stop: str | list[str] | list[int] | None = None  # None: EOS; []: nothing; strings or token ids (and EOS)
    num_samples: int = SAMPLE_DEFAULTS["num_samples"]
    seed: int | None = None  # None: drawn by the runtime
    prompt_logprobs: bool = SAMPLE_DEFAULTS["prompt_logprobs"]
    topk_prompt_logprobs: int = SAMPLE_DEFAULTS["topk_prompt_logprobs"]
    topk_sample_logprobs: int = SAMPLE_DEFAULTS["topk_sample_logprobs"]
    request_id: str | None = None
    # True: after each decode chunk, the new settled text and ids of every sequence (a SampleChunk) reach the caller
    # as progress, before the SampleResult; a transport without progress (Modal) sends the result alone.
    stream: bool = False
    # True: no place in the run's order (no ticket): the run's weights as of its last applied optim_step when the
    # call reaches the runtime, copied for it, so later optim_steps do not change what it decodes (/v1 on a run id).
    latest: bool = False

    def validate(self) -> None:
        check_weights_source(self)
        check_request_id(self.request_id)
        for name in ("stream", "latest"):
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"{name} must be true or false", field=name)
        if self.latest and (self.run_id is None or self.snapshot is not None or self.checkpoint is not None):
            raise BadInput("latest names a run's current weights: give run_id alone", field="latest")
        self.settings()

    def check_size(self, options: RuntimeOptions) -> None:
        prompts, settings = self.settings()
        lengths = None if self.prompt_tokens is None else [len(ids) for ids in self.prompt_tokens]
        check_sample_size(len(prompts), settings, options, self.prompts_field, lengths)

    @property
    def prompts_field(self) -> str:
        return "prompts" if self.prompt_tokens is None else "prompt_tokens"

    @property
    def frozen(self) -> bool:
        """Whether its weights never change under it (a snapshot, a checkpoint, a base, a copy of the latest): then it
        is off the run's queue."""
        return self.run_id is None or self.snapshot is not None or self.checkpoint is not None or self.latest

    def settings(self) -> tuple[list[str] | list[list[int]], SamplingSettings]:
        """The prompts (text, or token ids when prompt_tokens is set) and the checked settings."""
        prompts = sampling_prompts(self.prompts, self.prompt_tokens)
        return prompts, sampling_settings(self.max_tokens, self.temperature, self.top_p, self.top_k, self.stop,
                                          self.num_samples, self.seed, self.prompt_logprobs,
                                          self.topk_prompt_logprobs, self.topk_sample_logprobs)


@dataclass(frozen=True, kw_only=True)
class Tokenizer(Call[TokenizerResult]):
    """A base model's tokenizer, as sampling and rendering use it: on `base_model` (a name or path the runtime
    loads), or on the base of run `run_id`. A call on no run's queue: answered at the next tick."""

    method = Method.TOKENIZER
    answer = TokenizerResult
    base_model: str | None = None
    quantization: str | None = None
    run_id: str | None = None
    # Also write it with save_pretrained into the runtime's data directory and answer that directory: for a client
    # on the runtime's own machine (the local backend) that cannot reach the Hub (Tinker's get_info tokenizer_id).
    save: bool = False

    def validate(self) -> None:
        if (self.base_model is None) == (self.run_id is None):
            raise BadInput("give exactly one of base_model or run_id", field="base_model")
        if not isinstance(self.save, bool):
            raise BadInput("save must be true or false", field="save")
        if self.run_id is not None:
            check_id(self.run_id, "run_id")
        elif not isinstance(self.base_model, str) or not self.base_model:
            raise BadInput("base_model must be a model name or path", field="base_model")

    @property
    def run(self) -> str | None:
        return None  # reads the run's base, never its state: it waits on no run's calls


@dataclass(frozen=True, kw_only=True)
class SaveWeightsForSampler(RunCall[SaveWeightsForSamplerResult]):
    """Freeze the run's current adapter as a read-only snapshot (docs/SNAPSHOTS.md); in the run's queue, so it sees
    the weights after every call before it. `name` None: a generated name, and the snapshot expires."""

    method = Method.SAVE_WEIGHTS_FOR_SAMPLER
    answer = SaveWeightsForSamplerResult
    name: str | None = None
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        if self.name is not None:
            check_snapshot_name(self.name, "name")


@dataclass(frozen=True, kw_only=True)
class RenderChat(Call[RenderChatResult]):
    """The tokenizer's text work for a client that has none (the OpenAI endpoint): `messages` rendered with the
    model's chat template and the generation prompt, as token ids (rendering to text and tokenising again would
    double BOS), `prompts` tokenised as sample would, and the ids in `decode` as text, one token each. On a run's base (`run_id`) or on `base_model`.
    A call on no run's queue, like `tokenizer`."""

    method = Method.RENDER_CHAT
    answer = RenderChatResult
    base_model: str | None = None
    run_id: str | None = None
    messages: list[dict[str, str]] | None = None  # [{role, content}], content already text
    prompts: list[str] | None = None  # plain text, tokenised as sample tokenises a text prompt (with BOS)
    decode: list[int] | None = None

    def validate(self) -> None:
        if (self.base_model is None) == (self.run_id is None):
            raise BadInput("give exactly one of base_model or run_id", field="base_model")
        if self.run_id is not None:
            check_id(self.run_id, "run_id")
        elif not isinstance(self.base_model, str) or not self.base_model:
            raise BadInput("base_model must be a model name or path", field="base_model")
        if self.messages is not None:
            if not isinstance(self.messages, list) or not self.messages:
                raise BadInput("messages must be a non-empty list", field="messages")
            for i, message in enumerate(self.messages):
                if (not isinstance(message, dict) or set(message) != {"role", "content"}
                        or not all(isinstance(v, str) for v in message.values())):
                    raise BadInput(f"messages[{i}] must be {{role, content}} with text values", field=f"messages[{i}]")
        if self.prompts is not None:
            sampling_prompts(self.prompts, None)
        if self.decode is not None and (not isinstance(self.decode, list) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.decode)):
            raise BadInput("decode must be a list of token ids", field="decode")

    @property
    def run(self) -> str | None:
        return None  # reads the run's base, never its state: it waits on no run's calls


@dataclass(frozen=True, kw_only=True)
class SaveState(RunCall[SaveStateResult]):
    method = Method.SAVE_STATE
    answer = SaveStateResult
    mode: str = SAVE_MODES[0]
    name: str | None = None  # None: step-N; unique per run and mode (docs/CHECKPOINTS.md)
    with_optimizer: bool | None = None  # None: the mode's own (state: with AdamW; adapter: without; merged: never)
    request_id: str | None = None
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hf_token: str | None = None  # the user's: it reaches gpu_runtime.hub and nothing else (no journal, manifest, log)

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        if self.mode not in SAVE_MODES:
            raise BadInput(f"mode must be one of {list(SAVE_MODES)}, got {self.mode!r}", field="mode")
        if self.name is not None:
            check_checkpoint_name(self.name)
        if self.with_optimizer is not None and not isinstance(self.with_optimizer, bool):
            raise BadInput("with_optimizer must be true, false or null", field="with_optimizer")
        if self.with_optimizer and self.mode == "merged":
            raise BadInput("a merged checkpoint holds no optimizer state: save mode state for that",
                           field="with_optimizer")

    @property
    def optimizer_saved(self) -> bool:
        return self.mode == "state" if self.with_optimizer is None else self.with_optimizer

    def __repr__(self) -> str:  # never print the token
        return (f"SaveState(run_id={self.run_id!r}, mode={self.mode!r}, name={self.name!r}, "
                f"push_to_hub={self.push_to_hub!r})")


@dataclass(frozen=True, kw_only=True)
class LoadState(RunCall[LoadStateResult]):
    """Put a checkpoint's adapter (and, with_optimizer, its AdamW and step) into an existing run."""

    method = Method.LOAD_STATE
    answer = LoadStateResult
    checkpoint: str  # signal://<run_id>/<kind>/<name>, or a name: this run's state checkpoint
    with_optimizer: bool = True
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        checkpoint_ref(self.checkpoint, "checkpoint", self.run_id)
        if not isinstance(self.with_optimizer, bool):
            raise BadInput("with_optimizer must be true or false", field="with_optimizer")


@dataclass(frozen=True, kw_only=True)
class DeleteCheckpoint(RunCall[DeleteCheckpointResult]):
    """Remove a checkpoint's (or a sampler snapshot's) files from the runtime's disk."""

    method = Method.DELETE_CHECKPOINT
    answer = DeleteCheckpointResult
    mode: str
    name: str

    def validate(self) -> None:
        super().validate()
        if self.mode not in CHECKPOINT_KINDS:
            raise BadInput(f"mode must be one of {list(CHECKPOINT_KINDS)}, got {self.mode!r}", field="mode")
        check_checkpoint_name(self.name)


@dataclass(frozen=True, kw_only=True)
class LoadRun(RunCall[RunDescription]):
    method = Method.LOAD_RUN
    answer = RunDescription


@dataclass(frozen=True, kw_only=True)
class RunInfo(RunCall[RunDescription]):
    method = Method.RUN_INFO
    answer = RunDescription


@dataclass(frozen=True, kw_only=True)
class CloseRun(RunCall[CloseRunResult]):
    method = Method.CLOSE_RUN
    answer = CloseRunResult


@dataclass(frozen=True, kw_only=True)
class DeleteRun(RunCall[DeleteRunResult]):
    method = Method.DELETE_RUN
    answer = DeleteRunResult


@dataclass(frozen=True, kw_only=True)
class ExportCheckpoint(RunCall[ExportCheckpointResult]):
    method = Method.EXPORT_CHECKPOINT
    answer = ExportCheckpointResult
    mode: str
    step: int
    name: str | None = None  # None: step-N (what checkpoints saved before names are called)

    def validate(self) -> None:
        super().validate()
        if self.name is not None:
            check_checkpoint_name(self.name)
        if self.mode not in CHECKPOINT_KINDS:  # a sampler snapshot downloads like a checkpoint
            raise BadInput(f"mode must be one of {list(CHECKPOINT_KINDS)}, got {self.mode!r}", field="mode")
        if self.mode == "sampler" and self.name is None:  # a snapshot's key is its name, never its step
            raise BadInput("a sampler snapshot is exported by its name", field="name")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise BadInput(f"step must be a non-negative integer, got {self.step!r}", field="step")


@dataclass(frozen=True, kw_only=True)
class Cancel(Call[CancelResult]):
    """Stop the call `request_id` of `user_id` (its owner: ids are the clients', so one user's cannot reach
    another's). A call not yet begun (queued, past its user's bound, parked, picked this tick, or between the parts
    of a split forward_backward, whose gradients are put back) is withdrawn, never applied, and its ticket counted
    done: answered CANCELLED, or DEADLINE_EXCEEDED with `deadline`. A decoding sample stops between chunks: answered
    with what it has (stop_reason "cancelled": a stream's client saw it), or withdrawn with `withdraw` (CANCELLED: a
    client that saw none of it) or with `deadline` (DEADLINE_EXCEEDED). A call in a pass, or applied,
    completes as usual. One not here yet is answered so when it arrives. Answered at the next tick. A create_run,
    which has no request id, is named by its run id."""

    method = Method.CANCEL
    answer = CancelResult
    request_id: str
    user_id: str
    deadline: bool = False  # the server's deadline for the call passed (else its client went away)
    withdraw: bool = False  # a decoding sample too is withdrawn, not answered with what it has (nobody saw it)

    def validate(self) -> None:
        if self.request_id is None:
            raise BadInput("request_id names the sample to cancel", field="request_id")
        check_request_id(self.request_id)
        check_id(self.user_id, "user_id")
        if not isinstance(self.deadline, bool):
            raise BadInput(f"deadline must be true or false, got {self.deadline!r}", field="deadline")
        if not isinstance(self.withdraw, bool):
            raise BadInput(f"withdraw must be true or false, got {self.withdraw!r}", field="withdraw")


@dataclass(frozen=True, kw_only=True)
class Ping(Call[PingResult]):
    method = Method.PING
    answer = PingResult


@dataclass(frozen=True, kw_only=True)
class RuntimeState(Call[RuntimeStateResult]):
    method = Method.RUNTIME_STATE
    answer = RuntimeStateResult


CALLS: dict[Method, type[Call]] = {cls.method: cls for cls in (
    CreateRun, ForwardBackward, Forward, RenderDatums, OptimStep, Sample, SaveState, LoadRun, RunInfo, CloseRun,
    DeleteRun, ExportCheckpoint, LoadState, DeleteCheckpoint, SaveWeightsForSampler, Ping, RuntimeState, Tokenizer,
    RenderChat, Cancel)}
SYSTEM_CALLS = (Ping, RuntimeState, Tokenizer, RenderChat, Cancel)  # calls on no run: answered first, at the next tick


def check_weights_source(call: Any) -> None:
    """One weights source (the issue's decision): run_id [+ snapshot | checkpoint], or base_model + user_id alone."""
    if call.run_id is None:
        if call.snapshot is not None or call.checkpoint is not None:
            field = "snapshot" if call.snapshot is not None else "checkpoint"
            raise BadInput(f"{field} names a run's weights: give run_id too", field=field)
        if not isinstance(call.base_model, str) or not call.base_model:
            raise BadInput("give run_id (a run's weights) or base_model and user_id (the base alone)",
                           field="base_model")
        check_id(call.user_id, "user_id")
        return
    check_id(call.run_id, "run_id")
    if call.base_model is not None:
        raise BadInput("base_model is for the base alone, without run_id", field="base_model")
    if call.snapshot is not None and call.checkpoint is not None:
        raise BadInput("give one of snapshot and checkpoint, not both", field="checkpoint")
    for field in ("snapshot", "checkpoint"):
        if getattr(call, field) is not None:
            check_snapshot_name(getattr(call, field), field)


def parse_call(method: Any, params: Any) -> Call:
    """The typed, validated request for a method name and its arguments (what crosses the wire)."""
    try:
        kind = CALLS[Method(method)]
    except (ValueError, KeyError):
        raise BadInput(f"unknown method {method!r}; the runtime answers {[m.value for m in Method]}",
                       field="method") from None
    call = kind.from_dict(params)
    call.validate()
    return call
