"""What a run's journal and snapshot.json hold, as types: written with `to_dict`, read with `from_dict`.

`record_from_dict` is the one reader of a journal record, and the one place that knows older formats: every
record written since the journal existed upgrades here to today's type, so replay reads fields, never keys.
What changed, oldest first:
- forward_backward held `examples` of {tokens, weights, extras} (rendered as they were then: shifted), then `datums`;
- it held no `reduction` (every call was "mean"), no `body_sha256` (such ids take any body on retry);
- optim_step held no `kernel` (AdamW's portable one) and no `body_sha256`;
- snapshot.json's pending gradients held no `reduction` (its calls were "mean"), and no answers' `bodies`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from gpu_runtime.compute.batches import Datum, shifted
from gpu_runtime.compute.optimizer import PORTABLE
from gpu_runtime.contract.training_settings import DEFAULT_REDUCTION

FORWARD_BACKWARD, OPTIM_STEP, LOAD_STATE = "forward_backward", "optim_step", "load_state"  # the records' `type`


@dataclass(frozen=True)
class BatchRecord:
    """One forward_backward's batch as pending gradients and the manifest's step line list it."""

    sha256: str
    num_examples: int
    num_tokens: int
    loss_fn: str | None = None  # the manifest names each batch's loss (None: written before it did)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"sha256": self.sha256, "num_examples": self.num_examples, "num_tokens": self.num_tokens}
        if self.loss_fn is not None:
            data["loss_fn"] = self.loss_fn
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchRecord:
        return cls(data["sha256"], data["num_examples"], data["num_tokens"], data.get("loss_fn"))


@dataclass(frozen=True)
class PendingRecord:
    """Pending gradients' bookkeeping as snapshot.json holds it."""

    normaliser: float
    calls: int
    tokens: int
    batches: list[BatchRecord]
    reduction: str | None  # None: no call since the last step

    def to_dict(self) -> dict[str, Any]:
        return {"normaliser": self.normaliser, "calls": self.calls, "tokens": self.tokens,
                "batches": [b.to_dict() for b in self.batches], "reduction": self.reduction}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PendingRecord:
        # Snapshots from before reductions hold none: their calls were all "mean".
        reduction = data.get("reduction", DEFAULT_REDUCTION if data["calls"] else None)
        return cls(data["normaliser"], data["calls"], data["tokens"],
                   [BatchRecord.from_dict(b) for b in data["batches"]], reduction)


@dataclass(frozen=True, kw_only=True)
class FbRecord:
    """An acknowledged forward_backward: its rendered datums and loss settings, replayed as they ran."""

    type: ClassVar[str] = FORWARD_BACKWARD
    request_id: str | None
    loss_fn: str
    loss_fn_config: dict[str, float]  # the resolved settings (loss_settings), {} for cross-entropy
    reduction: str
    call: int  # which call since the last optim_step: seeds its dropout
    step: int
    batch_sha256: str
    body_sha256: str | None
    datums: list[Datum]
    result: dict[str, Any]  # the answer kept for retries (ForwardBackwardResult.kept())

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "request_id": self.request_id, "loss_fn": self.loss_fn,
                "loss_fn_config": self.loss_fn_config, "reduction": self.reduction, "call": self.call,
                "step": self.step, "batch_sha256": self.batch_sha256, "body_sha256": self.body_sha256,
                "datums": [d.to_dict() for d in self.datums], "result": self.result}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FbRecord:
        if "datums" in data:
            datums = [Datum.from_dict(d) for d in data["datums"]]
        else:  # before datums: {tokens, weights, extras} per example, shifted as the renderer shifts them
            datums = [shifted(e["tokens"], e["weights"], e.get("extras") or {}) for e in data["examples"]]
        return cls(request_id=data.get("request_id"), loss_fn=data["loss_fn"],
                   loss_fn_config=data.get("loss_fn_config") or {}, reduction=data.get("reduction", DEFAULT_REDUCTION),
                   call=data["call"], step=data.get("step", 0), batch_sha256=data.get("batch_sha256", ""),
                   body_sha256=data.get("body_sha256"), datums=datums, result=data["result"])


@dataclass(frozen=True, kw_only=True)
class OptimRecord:
    """An acknowledged optim_step: its AdamW settings and kernel, and its result or the error it answered."""

    type: ClassVar[str] = OPTIM_STEP
    request_id: str | None
    adam: dict[str, float]
    kernel: str
    body_sha256: str | None
    result: dict[str, Any]  # OptimStepResult.to_dict(), or {"error": …}: a failed step dropped the gradients

    @property
    def error(self) -> dict[str, Any] | None:
        error: dict[str, Any] | None = self.result.get("error")
        return error

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "request_id": self.request_id, "adam": self.adam, "kernel": self.kernel,
                "body_sha256": self.body_sha256, "result": self.result}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimRecord:
        return cls(request_id=data.get("request_id"), adam=data["adam"], kernel=data.get("kernel", PORTABLE),
                   body_sha256=data.get("body_sha256"), result=data["result"])


@dataclass(frozen=True, kw_only=True)
class LoadStateRecord:
    """A load_state: the run's own copy of the checkpoint's files (`loads/<staged>/`), kept until a snapshot covers it."""

    type: ClassVar[str] = LOAD_STATE
    request_id: str | None
    staged: str
    with_optimizer: bool
    step: int
    body_sha256: str | None
    result: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "request_id": self.request_id, "staged": self.staged,
                "with_optimizer": self.with_optimizer, "step": self.step, "body_sha256": self.body_sha256,
                "result": self.result}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadStateRecord:
        return cls(request_id=data.get("request_id"), staged=data["staged"], with_optimizer=data["with_optimizer"],
                   step=data["step"], body_sha256=data.get("body_sha256"), result=data["result"])


Record = FbRecord | OptimRecord | LoadStateRecord
RECORDS: dict[str, type[FbRecord] | type[OptimRecord] | type[LoadStateRecord]] = {
    kind.type: kind for kind in (FbRecord, OptimRecord, LoadStateRecord)}


def record_from_dict(data: dict[str, Any]) -> Record:
    """A journal record as read from disk, in today's type whatever format wrote it."""
    return RECORDS[data["type"]].from_dict(data)
