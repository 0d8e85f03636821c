"""The runtime's calls as types: a `Method` enum and one frozen request dataclass per method.

The same request crosses the local socket and Modal's `.remote()` as `to_dict()` and is rebuilt with
`from_dict`, which refuses unknown and missing arguments. `validate()` holds every check that needs no
model; the server runs it before a call leaves it and the runtime runs it again on arrival. Checks that
need the model (vocabulary, context, chat template, target modules) run in the runtime only.
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar

from gpu_runtime.contract.settings import (
    DEFAULT_LOSS_FN,
    SAMPLE_DEFAULTS,
    SAVE_MODES,
    SamplingSettings,
    adam_settings,
    check_batch_text,
    check_id,
    check_request_id,
    check_snapshot_name,
    lora_settings,
    sampling_settings,
)
from gpu_runtime.errors import BadInput

# Bumped whenever a request or result changes shape: the runtime says it in its greeting, and a server that
# meets another version refuses to talk to it (a detached runtime outlives its server; a Modal deployment lags).
CONTRACT_VERSION = 3


class Method(enum.StrEnum):
    CREATE_RUN = "create_run"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAMPLE = "sample"
    SAVE_STATE = "save_state"
    LOAD_RUN = "load_run"
    RUN_INFO = "run_info"
    CLOSE_RUN = "close_run"
    DELETE_RUN = "delete_run"
    EXPORT_CHECKPOINT = "export_checkpoint"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    PING = "ping"
    RUNTIME_STATE = "runtime_state"


R = TypeVar("R", bound="Call")


@dataclass(frozen=True, kw_only=True)
class Call:
    """A request to the runtime. Subclasses name their `method`; runs' calls carry `run_id`."""

    method: ClassVar[Method]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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

    @property
    def run(self) -> str | None:
        return getattr(self, "run_id", None)


@dataclass(frozen=True, kw_only=True)
class RunCall(Call):
    run_id: str

    def validate(self) -> None:
        check_id(self.run_id, "run_id")


@dataclass(frozen=True, kw_only=True)
class CreateRun(RunCall):
    method = Method.CREATE_RUN
    user_id: str
    base_model: str
    lora: dict[str, Any] | None = None
    seed: int = 0
    quantization: str | None = None

    def validate(self) -> None:
        super().validate()
        check_id(self.user_id, "user_id")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise BadInput(f"seed must be a non-negative integer, got {self.seed!r}", field="seed")
        if not isinstance(self.base_model, str) or not self.base_model:
            raise BadInput("base_model must be a model name or path", field="base_model")
        lora_settings(self.lora)  # shape only: the targets are checked against the model in the runtime


@dataclass(frozen=True, kw_only=True)
class ForwardBackward(RunCall):
    method = Method.FORWARD_BACKWARD
    batch: list[dict[str, Any]]
    loss_fn: str = DEFAULT_LOSS_FN
    loss_fn_config: dict[str, Any] | None = None
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        if not isinstance(self.batch, list) or not self.batch:
            raise BadInput("batch must be a non-empty list of examples", field="batch")
        check_batch_text(self.batch)


@dataclass(frozen=True, kw_only=True)
class OptimStep(RunCall):
    method = Method.OPTIM_STEP
    adam: dict[str, Any] | None = None
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        adam_settings(self.adam)

    def settings(self) -> dict[str, float]:
        return adam_settings(self.adam)


@dataclass(frozen=True, kw_only=True)
class Sample(Call):
    """Sampling from one weights source (gpu_runtime/weights_sources.py): `run_id` alone (the run's current weights,
    in its queue), `run_id` + `snapshot` or `checkpoint` (frozen weights: off the run's queue), or no `run_id` and
    `base_model` + `user_id` (the base alone)."""

    method = Method.SAMPLE
    prompts: list[str]
    run_id: str | None = None
    snapshot: str | None = None  # a sampler snapshot's name on the run (save_weights_for_sampler)
    checkpoint: str | None = None  # a training checkpoint's name on the run
    base_model: str | None = None  # with run_id None: the base alone
    user_id: str | None = None  # whose base-model sample it is (billing, fair turns)
    max_tokens: int = SAMPLE_DEFAULTS["max_tokens"]
    temperature: float = SAMPLE_DEFAULTS["temperature"]
    top_p: float = SAMPLE_DEFAULTS["top_p"]
    top_k: int = SAMPLE_DEFAULTS["top_k"]
    stop: str | list[str] | None = None
    num_samples: int = SAMPLE_DEFAULTS["num_samples"]
    seed: int | None = None  # None: drawn by the runtime
    request_id: str | None = None

    def validate(self) -> None:
        check_weights_source(self)
        check_request_id(self.request_id)
        self.settings()

    @property
    def frozen(self) -> bool:
        """Whether its weights never change under it (a snapshot, a checkpoint, a base): then it is off the run's queue."""
        return self.run_id is None or self.snapshot is not None or self.checkpoint is not None

    def settings(self) -> tuple[list[str], SamplingSettings]:
        return sampling_settings(self.prompts, self.max_tokens, self.temperature, self.top_p, self.top_k, self.stop,
                                 self.num_samples, self.seed)


@dataclass(frozen=True, kw_only=True)
class SaveWeightsForSampler(RunCall):
    """Freeze the run's current adapter as a read-only snapshot (docs/SNAPSHOTS.md); in the run's queue, so it sees
    the weights after every call before it. `name` None: a generated name, and the snapshot expires."""

    method = Method.SAVE_WEIGHTS_FOR_SAMPLER
    name: str | None = None
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        if self.name is not None:
            check_snapshot_name(self.name, "name")


@dataclass(frozen=True, kw_only=True)
class SaveState(RunCall):
    method = Method.SAVE_STATE
    mode: str = SAVE_MODES[0]
    request_id: str | None = None
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hf_token: str | None = None  # the user's: it reaches gpu_runtime.hub and nothing else (no journal, manifest, log)

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        if self.mode not in SAVE_MODES:
            raise BadInput(f"mode must be one of {list(SAVE_MODES)}, got {self.mode!r}", field="mode")

    def __repr__(self) -> str:  # never print the token
        return f"SaveState(run_id={self.run_id!r}, mode={self.mode!r}, push_to_hub={self.push_to_hub!r})"


@dataclass(frozen=True, kw_only=True)
class LoadRun(RunCall):
    method = Method.LOAD_RUN


@dataclass(frozen=True, kw_only=True)
class RunInfo(RunCall):
    method = Method.RUN_INFO


@dataclass(frozen=True, kw_only=True)
class CloseRun(RunCall):
    method = Method.CLOSE_RUN


@dataclass(frozen=True, kw_only=True)
class DeleteRun(RunCall):
    method = Method.DELETE_RUN


@dataclass(frozen=True, kw_only=True)
class ExportCheckpoint(RunCall):
    method = Method.EXPORT_CHECKPOINT
    mode: str
    step: int
    name: str | None = None  # mode "sampler": the named snapshot's name (its step is not its key)

    def validate(self) -> None:
        super().validate()
        if self.mode not in (*SAVE_MODES, "sampler"):
            raise BadInput(f"mode must be one of {[*SAVE_MODES, 'sampler']}, got {self.mode!r}", field="mode")
        if self.mode == "sampler":
            check_snapshot_name(self.name, "name")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise BadInput(f"step must be a non-negative integer, got {self.step!r}", field="step")


@dataclass(frozen=True, kw_only=True)
class Ping(Call):
    method = Method.PING


@dataclass(frozen=True, kw_only=True)
class RuntimeState(Call):
    method = Method.RUNTIME_STATE


CALLS: dict[Method, type[Call]] = {cls.method: cls for cls in (
    CreateRun, ForwardBackward, OptimStep, Sample, SaveState, LoadRun, RunInfo, CloseRun, DeleteRun, ExportCheckpoint,
    SaveWeightsForSampler, Ping, RuntimeState)}
SYSTEM_CALLS = (Ping, RuntimeState)  # calls on no run: answered first, at the next tick


def check_weights_source(call: Any) -> None:
    """One weights source (the issue's decision): run_id [+ snapshot | checkpoint], or base_model + user_id alone."""
    if call.run_id is None:
        if call.snapshot is not None or call.checkpoint is not None:
            field = "snapshot" if call.snapshot is not None else "checkpoint"
            raise BadInput(f"{field} names a run's weights: give run_id too", field=field)
        if not isinstance(call.base_model, str) or not call.base_model:
            raise BadInput("give run_id (a run's weights) or base_model and user_id (the base alone)", field="base_model")
        check_id(call.user_id, "user_id")
        return
    check_id(call.run_id, "run_id")
    if call.base_model is not None:
        raise BadInput("base_model is for sampling the base alone, without run_id", field="base_model")
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
