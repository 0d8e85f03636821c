"""The control calls as types: create, describe, close and delete runs; save, load, export and delete checkpoints and
sampler snapshots; cancel a call; ping and the operator's view (gpu_runtime/engine/control_calls.py answers them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_runtime.contract.calls import Call, Kind, Lane, Method, RunCall
from gpu_runtime.contract.checkpoints import CHECKPOINT_KINDS, SAVE_MODES, check_checkpoint_name, check_snapshot_name, checkpoint_ref
from gpu_runtime.contract.checks import MAX_RUN_SEED, check_id, check_request_id, check_seed
from gpu_runtime.contract.results import (
    CancelResult,
    CloseRunResult,
    DeleteCheckpointResult,
    DeleteRunResult,
    ExportCheckpointResult,
    LoadStateResult,
    PingResult,
    RunDescription,
    RuntimeStateResult,
    SaveStateResult,
    SaveWeightsForSamplerResult,
)
from gpu_runtime.contract.training_settings import lora_settings
from gpu_runtime.errors import BadInput


@dataclass(frozen=True, kw_only=True)
class CreateRun(RunCall[RunDescription]):
    method = Method.CREATE_RUN
    answer = RunDescription
    kind = Kind(Lane.RUN, writes=True, primitive=True)
    user_id: str
    base_model: str
    lora: Mapping[str, object] | None = None  # the caller's, checked by lora_settings
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

    def caller(self) -> str | None:
        return self.user_id


@dataclass(frozen=True, kw_only=True)
class SaveWeightsForSampler(RunCall[SaveWeightsForSamplerResult]):
    """Freeze the run's current adapter as a read-only snapshot (docs/SNAPSHOTS.md); in the run's queue, so it sees
    the weights after every call before it. `name` None: a generated name, and the snapshot expires."""

    method = Method.SAVE_WEIGHTS_FOR_SAMPLER
    answer = SaveWeightsForSamplerResult
    kind = Kind(Lane.RUN, writes=True, on_run=True, primitive=True)
    name: str | None = None
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        if self.name is not None:
            check_snapshot_name(self.name, "name")


@dataclass(frozen=True, kw_only=True)
class SaveState(RunCall[SaveStateResult]):
    method = Method.SAVE_STATE
    answer = SaveStateResult
    kind = Kind(Lane.RUN, writes=True, on_run=True, primitive=True)
    mode: str = SAVE_MODES[0]
    name: str | None = None  # None: step-N; unique per run and mode (docs/CHECKPOINTS.md)
    with_optimizer: bool | None = None  # None: the mode's own (state: with AdamW; adapter: without; merged: never)
    request_id: str | None = None
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hf_token: str | None = None  # the user's: it reaches gpu_runtime.engine.hub and nothing else (no journal, manifest, log)
    overwrite: bool = False  # replace a checkpoint of this kind and name (Tinker's save_weights); else it is refused

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        if self.mode not in SAVE_MODES:
            raise BadInput(f"mode must be one of {list(SAVE_MODES)}, got {self.mode!r}", field="mode")
        if self.name is not None:
            check_checkpoint_name(self.name)
        if self.with_optimizer is not None and not isinstance(self.with_optimizer, bool):
            raise BadInput("with_optimizer must be true, false or null", field="with_optimizer")
        if not isinstance(self.overwrite, bool):
            raise BadInput("overwrite must be true or false", field="overwrite")
        if self.with_optimizer and self.mode == "merged":
            raise BadInput("a merged checkpoint holds no optimizer state: save mode state for that",
                           field="with_optimizer")

    @property
    def optimizer_saved(self) -> bool:
        return self.mode == "state" if self.with_optimizer is None else self.with_optimizer

    def __repr__(self) -> str:  # never print the token
        return (f"SaveState(run_id={self.run_id!r}, mode={self.mode!r}, name={self.name!r}, "
                f"push_to_hub={self.push_to_hub!r}, overwrite={self.overwrite!r})")


@dataclass(frozen=True, kw_only=True)
class LoadState(RunCall[LoadStateResult]):
    """Put a checkpoint's adapter (and, with_optimizer, its AdamW and step) into an existing run."""

    method = Method.LOAD_STATE
    answer = LoadStateResult
    kind = Kind(Lane.RUN, on_run=True, primitive=True)
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
    kind = Kind(Lane.RUN)
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
    kind = Kind(Lane.RUN, on_run=True)


@dataclass(frozen=True, kw_only=True)
class RunInfo(RunCall[RunDescription]):
    method = Method.RUN_INFO
    answer = RunDescription
    kind = Kind(Lane.RUN, on_run=True)


@dataclass(frozen=True, kw_only=True)
class CloseRun(RunCall[CloseRunResult]):
    method = Method.CLOSE_RUN
    answer = CloseRunResult
    kind = Kind(Lane.RUN)


@dataclass(frozen=True, kw_only=True)
class DeleteRun(RunCall[DeleteRunResult]):
    method = Method.DELETE_RUN
    answer = DeleteRunResult
    kind = Kind(Lane.RUN)


@dataclass(frozen=True, kw_only=True)
class ExportCheckpoint(RunCall[ExportCheckpointResult]):
    method = Method.EXPORT_CHECKPOINT
    answer = ExportCheckpointResult
    kind = Kind(Lane.RUN)
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
    kind = Kind(Lane.SYSTEM)
    request_id: str
    user_id: str
    deadline: bool = False  # the server's deadline for the call passed (else its client went away)
    withdraw: bool = False  # a decoding sample too is withdrawn, not answered with what it has (nobody saw it)
    # With `deadline`: its length. It counts from when the call could run (its run's calls before it answered), not
    # from its arrival: a call able to run for less than that is withdrawn only once it has been (CancelResult.deferred).
    deadline_s: float | None = None

    def validate(self) -> None:
        if self.request_id is None:
            raise BadInput("request_id names the sample to cancel", field="request_id")
        check_request_id(self.request_id)
        check_id(self.user_id, "user_id")
        if not isinstance(self.deadline, bool):
            raise BadInput(f"deadline must be true or false, got {self.deadline!r}", field="deadline")
        if not isinstance(self.withdraw, bool):
            raise BadInput(f"withdraw must be true or false, got {self.withdraw!r}", field="withdraw")
        if self.deadline_s is not None and (isinstance(self.deadline_s, bool) or not isinstance(self.deadline_s, (int, float))
                                            or not self.deadline_s >= 0):
            raise BadInput(f"deadline_s must be a number of seconds >= 0, got {self.deadline_s!r}", field="deadline_s")


@dataclass(frozen=True, kw_only=True)
class Ping(Call[PingResult]):
    method = Method.PING
    answer = PingResult
    kind = Kind(Lane.SYSTEM)


@dataclass(frozen=True, kw_only=True)
class RuntimeState(Call[RuntimeStateResult]):
    method = Method.RUNTIME_STATE
    answer = RuntimeStateResult
    kind = Kind(Lane.SYSTEM)
