"""A call to the runtime as a type: the `Method` enum, the `Call` base every request derives from, and the version
of the contract's shapes.

The same request crosses the local socket and Modal's `.remote()` as `to_dict()` and is rebuilt with
`from_dict`, which refuses unknown and missing arguments. `validate()` holds every check that needs no
model; the server runs it before a call leaves it and the runtime runs it again on arrival. Checks that
need the model (vocabulary, context, chat template, target modules) run in the runtime only. The requests
themselves are in training_calls, sampling_calls and control_calls; registry maps a method name to its type.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Generic, cast

from typing_extensions import TypeVar  # a TypeVar with a default: a bare `Call` is a call answered by some Result

from gpu_runtime.contract.checks import check_id
from gpu_runtime.contract.json_types import CANONICAL, JSONObject
from gpu_runtime.contract.results import Result, field_names
from gpu_runtime.contract.runtime_options import RuntimeOptions
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


class Lane(enum.StrEnum):
    """Where a call waits in the runtime's scheduler (gpu_runtime/engine/scheduler.py)."""

    # on no run's state (ping, a tokenizer, a cancel): answered first, at the next tick; one that names a run only
    # to find its base waits in that run's queue
    SYSTEM = "system"
    RUN = "run"  # its run's queue, in ticket order
    FREE = "free"  # its run's queue, or off every queue when it reads frozen weights (`Call.frozen`)


@dataclass(frozen=True)
class Kind:
    """What the runtime must know of a call before it reads it: one per contract type (`Call.kind`)."""

    lane: Lane
    writes: bool = False  # journal, snapshot or checkpoint: refused while the disk is below its margin
    on_run: bool = False  # its run (when it names one) is restored into memory before it is priced and picked
    primitive: bool = False  # a user's primitive, seconds of device time: GraphQL bounds how many a request carries


R = TypeVar("R", bound="Call")
A = TypeVar("A", bound=Result, default=Result, covariant=True)  # what a call is answered with


@dataclass(frozen=True, kw_only=True)
class Call(Generic[A]):
    """A request to the runtime, answered with an `A`. Subclasses name their `method`, their `answer` type (the
    same A) and their `kind`; runs' calls carry `run_id`. Each concrete type registers itself in `CALLS`."""

    method: ClassVar[Method]
    answer: ClassVar[type[Result]]
    kind: ClassVar[Kind]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "method" in cls.__dict__:  # a concrete call (bases such as RunCall name no method)
            CALLS[cls.method] = cls

    def to_dict(self) -> JSONObject:
        # Shallow: the fields are plain data already, and a deep copy of a large batch costs milliseconds per call.
        return {name: getattr(self, name) for name in field_names(type(self))}

    def result(self, data: Mapping[str, object]) -> A:
        """Its answer as it came over the wire, typed (unknown fields dropped: Result.from_dict)."""
        return cast(A, self.answer.from_dict(data))

    def body_sha256(self) -> str:
        """What a request id stands for: the method and every argument but the id itself and a Hub token (a retry may
        carry a refreshed one, and nothing derived from it is written down). A run remembers it beside each answer,
        so the same id with another body is refused rather than answered with the first call's result."""
        body = {k: v for k, v in self.to_dict().items() if k not in ("request_id", "hf_token")}
        canonical = CANONICAL.encode({"method": str(self.method), "body": body})
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
        return cls(**cls._parsed(params))

    @classmethod
    def _parsed(cls, params: Mapping[str, object]) -> Mapping[str, object]:
        """The arguments as the type's fields hold them (a batch's JSON items become typed ones)."""
        return params

    def validate(self) -> None:
        """Every check that needs no model (run again by the runtime)."""

    def check_size(self, options: RuntimeOptions) -> None:
        """The per-call size bounds that need no model, against `options` (the server's settings before the call
        leaves, the runtime's own on arrival); the runtime checks again once it has tokenized."""

    @property
    def run(self) -> str | None:
        return getattr(self, "run_id", None)

    @property
    def frozen(self) -> bool:
        """Whether it reads frozen weights (a snapshot, a checkpoint, a base): only `Lane.FREE` calls may."""
        return False

    def caller(self) -> str | None:
        """Whose call it is when no run says so: a new run's owner, a base-model sample's or forward's user; None:
        the runtime's own (or its run's owner's)."""
        return None


CALLS: dict[Method, type[Call]] = {}  # every concrete call type by its method, filled as each is defined


@dataclass(frozen=True, kw_only=True)
class RunCall(Call[A]):
    run_id: str

    def validate(self) -> None:
        check_id(self.run_id, "run_id")
