"""What a run's journal and snapshot.json hold, as types: written with `to_dict`, read with `from_dict`.

`record_from_dict` is the one reader of a journal record, and the one place that knows older formats: every
record written since the journal existed upgrades here to today's type, so replay reads fields, never keys.
What changed, oldest first:
- forward_backward held `examples` of {tokens, weights, extras} (rendered as they were then: shifted), then `datums`;
- it held no `reduction` (every call was "mean"), no `body_sha256` (such ids take any body on retry), no
  `lora_kernel` (its passes ran the per-segment LoRA reference, or Triton on CUDA: replayed as `ops.LEGACY`), no
  `join_rows` (its datums were each padded to a row of their own: replayed so);
- optim_step held no `kernel` (AdamW's portable one) and no `body_sha256`;
- snapshot.json's pending gradients held no `reduction` (its calls were "mean"), and no answers' `bodies`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, cast

from gpu_runtime.compute.batches import Datum, shifted
from gpu_runtime.compute.optimizer import PORTABLE
from gpu_runtime.contract.json_types import (
    JSONObject,
    as_json,
    as_json_object,
    as_object,
    get_bool,
    get_float,
    get_int,
    get_list,
    get_numbers,
    get_str,
    opt_object,
    opt_str,
)
from gpu_runtime.contract.training_settings import DEFAULT_REDUCTION

FORWARD_BACKWARD, OPTIM_STEP, LOAD_STATE = "forward_backward", "optim_step", "load_state"  # the records' `type`


@dataclass(frozen=True)
class BatchRecord:
    """One forward_backward's batch as pending gradients and the manifest's step line list it."""

    sha256: str
    num_examples: int
    num_tokens: int
    loss_fn: str | None = None  # the manifest names each batch's loss (None: written before it did)

    def to_dict(self) -> JSONObject:
        data: JSONObject = {"sha256": self.sha256, "num_examples": self.num_examples, "num_tokens": self.num_tokens}
        if self.loss_fn is not None:
            data["loss_fn"] = self.loss_fn
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> BatchRecord:
        return cls(get_str(data, "sha256"), get_int(data, "num_examples"), get_int(data, "num_tokens"),
                   opt_str(data, "loss_fn"))


@dataclass(frozen=True)
class PendingRecord:
    """Pending gradients' bookkeeping as snapshot.json holds it."""

    normaliser: float
    calls: int
    tokens: int
    batches: list[BatchRecord]
    reduction: str | None  # None: no call since the last step

    def to_dict(self) -> JSONObject:
        return {"normaliser": self.normaliser, "calls": self.calls, "tokens": self.tokens,
                "batches": [b.to_dict() for b in self.batches], "reduction": self.reduction}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> PendingRecord:
        calls = get_int(data, "calls")
        # Snapshots from before reductions hold none: their calls were all "mean".
        reduction = opt_str(data, "reduction", DEFAULT_REDUCTION if calls else None)
        return cls(get_float(data, "normaliser"), calls, get_int(data, "tokens"),
                   [BatchRecord.from_dict(as_object(b, "batches")) for b in get_list(data, "batches")], reduction)


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
    result: JSONObject  # the answer kept for retries (ForwardBackwardResult.kept())
    custom_loss: JSONObject | None = None  # loss_fn "custom": its graph, replayed as it ran
    lora_kernel: str | None = None  # the segmented LoRA kernel its passes ran; None: written before kernels were named
    join_rows: bool = False  # its datums shared model rows (compute/joined_rows.py); absent: they did not

    def to_dict(self) -> JSONObject:
        data: JSONObject = {
            "type": self.type, "request_id": self.request_id, "loss_fn": self.loss_fn,
            "loss_fn_config": self.loss_fn_config, "reduction": self.reduction, "call": self.call,
            "step": self.step, "batch_sha256": self.batch_sha256, "body_sha256": self.body_sha256,
            "datums": [as_json(d.to_dict()) for d in self.datums], "result": self.result}
        if self.custom_loss is not None:
            data["custom_loss"] = self.custom_loss
        if self.lora_kernel is not None:
            data["lora_kernel"] = self.lora_kernel
        if self.join_rows:
            data["join_rows"] = True
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> FbRecord:
        if "datums" in data:
            datums = [Datum.from_dict(as_object(d, "datums")) for d in get_list(data, "datums")]
        else:  # before datums: {tokens, weights, extras} per example, shifted as the renderer shifts them
            datums = [_shifted_example(as_object(e, "examples")) for e in get_list(data, "examples")]
        return cls(request_id=opt_str(data, "request_id"), loss_fn=get_str(data, "loss_fn"),
                   loss_fn_config=get_numbers(data, "loss_fn_config"),
                   reduction=opt_str(data, "reduction") or DEFAULT_REDUCTION, call=get_int(data, "call"),
                   step=get_int(data, "step", 0), batch_sha256=opt_str(data, "batch_sha256") or "",
                   body_sha256=opt_str(data, "body_sha256"), datums=datums,
                   result=as_json_object(data["result"], "result"), lora_kernel=opt_str(data, "lora_kernel"),
                   join_rows=get_bool(data, "join_rows", False),
                   custom_loss=as_json_object(data["custom_loss"], "custom_loss") if "custom_loss" in data else None)


def _shifted_example(example: Mapping[str, object]) -> Datum:
    # The journal's lists were written from typed lists: their items are what the types say.
    extras = {k: cast(list[float], v) for k, v in opt_object(example, "extras").items()}
    return shifted(cast(list[int], get_list(example, "tokens")), cast(list[float], get_list(example, "weights")),
                   extras)


@dataclass(frozen=True, kw_only=True)
class OptimRecord:
    """An acknowledged optim_step: its AdamW settings and kernel, and its result or the error it answered."""

    type: ClassVar[str] = OPTIM_STEP
    request_id: str | None
    adam: dict[str, float]
    kernel: str
    body_sha256: str | None
    result: JSONObject  # OptimStepResult.to_dict(), or {"error": …}: a failed step dropped the gradients

    @property
    def error(self) -> Mapping[str, object] | None:
        error = self.result.get("error")
        return None if error is None else as_object(error, "result.error")

    def to_dict(self) -> JSONObject:
        return {"type": self.type, "request_id": self.request_id, "adam": self.adam, "kernel": self.kernel,
                "body_sha256": self.body_sha256, "result": self.result}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> OptimRecord:
        return cls(request_id=opt_str(data, "request_id"), adam=get_numbers(data, "adam"),
                   kernel=opt_str(data, "kernel") or PORTABLE, body_sha256=opt_str(data, "body_sha256"),
                   result=as_json_object(data["result"], "result"))


@dataclass(frozen=True, kw_only=True)
class LoadStateRecord:
    """A load_state: the run's own copy of the checkpoint's files (`loads/<staged>/`), kept until a snapshot covers it."""

    type: ClassVar[str] = LOAD_STATE
    request_id: str | None
    staged: str
    with_optimizer: bool
    step: int
    body_sha256: str | None
    result: JSONObject = field(default_factory=dict)

    def to_dict(self) -> JSONObject:
        return {"type": self.type, "request_id": self.request_id, "staged": self.staged,
                "with_optimizer": self.with_optimizer, "step": self.step, "body_sha256": self.body_sha256,
                "result": self.result}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LoadStateRecord:
        return cls(request_id=opt_str(data, "request_id"), staged=get_str(data, "staged"),
                   with_optimizer=get_bool(data, "with_optimizer"), step=get_int(data, "step"),
                   body_sha256=opt_str(data, "body_sha256"), result=as_json_object(data["result"], "result"))


Record = FbRecord | OptimRecord | LoadStateRecord
RECORDS: dict[str, type[FbRecord] | type[OptimRecord] | type[LoadStateRecord]] = {
    kind.type: kind for kind in (FbRecord, OptimRecord, LoadStateRecord)}


def record_from_dict(data: Mapping[str, object]) -> Record:
    """A journal record as read from disk, in today's type whatever format wrote it."""
    return RECORDS[get_str(data, "type")].from_dict(data)
