"""What the runtime answers, as types: one frozen result per call that returns more than an acknowledgement.

The runtime builds these and sends `to_dict()`; the server reads them back with `from_dict`, which keeps
the fields it knows, so a runtime one field ahead (same contract version) does not break an older reader.
`replayed` marks the first answer of a call given again (a retry with the same request id).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypeVar

R = TypeVar("R", bound="Result")
OMITTED_UNLESS_SET = ("replayed", "hub")


@dataclass(frozen=True, kw_only=True)
class Result:
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in OMITTED_UNLESS_SET:  # a first answer carries no `replayed`; a save with no upload no `hub`
            if not data.get(name, True):
                del data[name]
        return data

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def replay(self: R) -> R:
        return replace(self, replayed=True)  # type: ignore[call-arg]  # every call's result with an id has `replayed`


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardResult(Result):
    loss: float  # the call's loss sum over its normaliser (its mean per weighted target token)
    num_tokens: int  # target tokens with weight
    num_examples: int
    step: int  # optim_steps applied before this call
    compute_seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class OptimStepResult(Result):
    step: int
    grad_norm: float
    learning_rate: float
    compute_seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class SampleResult(Result):
    outputs: list[str]  # the first sequence's text of each prompt
    sequences: list[list[dict[str, Any]]]  # per prompt, per sample: text, tokens, logprobs, stop_reason
    prompt_tokens: list[list[int]]
    step: int
    compute_seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class SaveStateResult(Result):
    checkpoint_path: str
    mode: str
    step: int
    size_bytes: int
    compute_seconds: float = 0.0
    hub: dict[str, Any] | None = None  # push_to_hub: where the upload went
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class SaveWeightsForSamplerResult(Result):
    """A sampler snapshot: sample from it with run_id + snapshot=name (docs/SNAPSHOTS.md)."""

    run_id: str
    name: str
    step: int  # the run's step when it was frozen
    named: bool  # named: persisted under the run's directory; unnamed: expires after `expires_in_seconds`
    path: str  # named: its directory (a PEFT adapter); unnamed: "" (memory only)
    size_bytes: int
    expires_in_seconds: float | None = None
    compute_seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class RunDescription(Result):
    """create_run, run_info and load_run: a run as the runtime holds it."""

    run_id: str
    user_id: str
    base_model: str
    quantization: str | None
    base_revision: str | None
    lora: dict[str, Any]
    target_modules: list[str]
    seed: int
    step: int
    trainable_params: int
    total_params: int
    pending_forward_backward: int
    pending_tokens: int
    path: str
    device: str = "cpu"  # what the run trains on: cpu, cuda:0, …
