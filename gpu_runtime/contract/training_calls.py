"""The training calls as types: forward_backward, forward, render_datums and optim_step (gpu_runtime/engine/training_calls.py
answers them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpu_runtime.contract.batch_items import BATCH_ITEMS, BatchItem, batch_from_dicts, batch_to_dicts, known_tokens
from gpu_runtime.contract.calls import Call, Kind, Lane, Method, RunCall
from gpu_runtime.contract.checks import check_request_id
from gpu_runtime.contract.custom_loss import CUSTOM_LOSS_FN, CustomLoss, parse_custom_loss
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.results import ForwardBackwardResult, ForwardResult, OptimStepResult, RenderDatumsResult
from gpu_runtime.contract.runtime_options import RuntimeOptions, check_batch_size
from gpu_runtime.contract.sampling_calls import check_weights_source
from gpu_runtime.contract.training_settings import DEFAULT_LOSS_FN, DEFAULT_REDUCTION, adam_settings, loss_settings
from gpu_runtime.errors import BadInput


def check_custom(loss_fn: str, custom_loss: JSONObject | None) -> CustomLoss | None:
    """loss_fn "custom" carries its checked graph (custom_loss); no other loss takes one."""
    if loss_fn != CUSTOM_LOSS_FN:
        if custom_loss is not None:
            raise BadInput(f"custom_loss goes with loss_fn {CUSTOM_LOSS_FN!r}, not {loss_fn!r}", field="custom_loss")
        return None
    if custom_loss is None:
        raise BadInput("loss_fn 'custom' needs its graph (custom_loss)", field="custom_loss")
    return parse_custom_loss(custom_loss)


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, list) or not batch:
        raise BadInput("batch must be a non-empty list of examples", field="batch")
    for i, item in enumerate(batch):
        if not isinstance(item, BATCH_ITEMS):
            raise BadInput(f"batch[{i}] must be a batch item", field=f"batch[{i}]")
        item.check(f"batch[{i}]")


class _Batched:
    """A call carrying a batch of typed items (JSON's are parsed as the call is: `batch_from_dicts`), bounded in
    items and in the tokens countable before rendering."""

    batch: list[BatchItem]

    @classmethod
    def _parsed(cls, params: Mapping[str, object]) -> Mapping[str, object]:
        return {**params, "batch": batch_from_dicts(params["batch"])} if "batch" in params else params

    def to_dict(self) -> JSONObject:
        data: JSONObject = super().to_dict()  # type: ignore[misc]  # a mixin of Call: Call.to_dict is next in the MRO
        data["batch"] = batch_to_dicts(self.batch)
        if data.get("custom_loss", 0) is None:
            del data["custom_loss"]  # absent unless given: a body's hash (request ids) is what it was before custom
        return data

    def check_size(self, options: RuntimeOptions) -> None:
        check_batch_size(len(self.batch), sum(known_tokens(item) for item in self.batch), options)


@dataclass(frozen=True, kw_only=True)
class ForwardBackward(_Batched, RunCall[ForwardBackwardResult]):
    method = Method.FORWARD_BACKWARD
    answer = ForwardBackwardResult
    kind = Kind(Lane.RUN, writes=True, on_run=True, primitive=True)
    batch: list[BatchItem]
    loss_fn: str = DEFAULT_LOSS_FN
    loss_fn_config: dict[str, float] | None = None
    custom_loss: JSONObject | None = None  # loss_fn "custom": its graph (contract/custom_loss.py)
    reduction: str = DEFAULT_REDUCTION  # every call between two optim_steps uses the same one
    return_outputs: bool = False  # per-datum, per-position logprobs and elementwise_loss in the result
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        _check_batch(self.batch)
        loss_settings(self.loss_fn, self.loss_fn_config, self.reduction)
        check_custom(self.loss_fn, self.custom_loss)
        if not isinstance(self.return_outputs, bool):
            raise BadInput("return_outputs must be a boolean", field="return_outputs")


@dataclass(frozen=True, kw_only=True)
class Forward(_Batched, Call[ForwardResult]):
    """The loss and per-position logprobs of a batch, with no backward: nothing of the run changes (no gradient,
    no dropout, no counter). Its weights, as a sample's (gpu_runtime/engine/weights_sources.py): `run_id`'s current ones
    (in the run's queue), `run_id` + `snapshot` (frozen: off the queue), or with run_id None the base model alone."""

    method = Method.FORWARD
    answer = ForwardResult
    kind = Kind(Lane.FREE, on_run=True, primitive=True)
    batch: list[BatchItem]
    run_id: str | None = None
    snapshot: str | None = None  # a sampler snapshot's name on the run (save_weights_for_sampler)
    checkpoint: str | None = None  # a training checkpoint's name on the run (not readable yet: refused)
    base_model: str | None = None  # with run_id None: the base to run (rows reach no adapter)
    user_id: str | None = None  # with run_id None: whose call it is
    loss_fn: str = DEFAULT_LOSS_FN
    loss_fn_config: dict[str, float] | None = None
    custom_loss: JSONObject | None = None  # loss_fn "custom": its graph (contract/custom_loss.py)
    request_id: str | None = None

    def validate(self) -> None:
        check_request_id(self.request_id)
        check_weights_source(self)
        _check_batch(self.batch)
        loss_settings(self.loss_fn, self.loss_fn_config)
        check_custom(self.loss_fn, self.custom_loss)

    @property
    def frozen(self) -> bool:
        """On a snapshot or checkpoint: off the run's queue, like such a sample (a base alone rides the system lane)."""
        return self.run_id is not None and (self.snapshot is not None or self.checkpoint is not None)

    def caller(self) -> str | None:
        return self.user_id


@dataclass(frozen=True, kw_only=True)
class RenderDatums(_Batched, RunCall[RenderDatumsResult]):
    """The datums the runtime would build for a batch of Signal items (renderDatums), changing nothing."""

    method = Method.RENDER_DATUMS
    answer = RenderDatumsResult
    kind = Kind(Lane.RUN, on_run=True)
    batch: list[BatchItem]
    loss_fn: str = DEFAULT_LOSS_FN

    def validate(self) -> None:
        super().validate()
        _check_batch(self.batch)
        loss_settings(self.loss_fn, None)


@dataclass(frozen=True, kw_only=True)
class OptimStep(RunCall[OptimStepResult]):
    method = Method.OPTIM_STEP
    answer = OptimStepResult
    kind = Kind(Lane.RUN, writes=True, on_run=True, primitive=True)
    adam: dict[str, float | None] | None = None  # None (or a setting None): the default
    request_id: str | None = None

    def validate(self) -> None:
        super().validate()
        check_request_id(self.request_id)
        self.settings()

    def settings(self) -> dict[str, float]:
        """The AdamW settings, checked once per call object: its validate and its tick read the same ones."""
        checked: dict[str, float] | None = self.__dict__.get("_settings")
        if checked is None:
            checked = adam_settings(self.adam)
            object.__setattr__(self, "_settings", checked)  # frozen, and a cache: not a field (to_dict leaves it out)
        return dict(checked)
