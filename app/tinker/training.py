"""A training client's operations, each in its model's order: forward_backward (and forward), optim_step,
save_weights and save_weights_for_sampler. forward_backward's body and answer are protobuf (app/tinker/proto.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from starlette.requests import Request

from app.errors import BadInput
from app.services import Services
from app.services import tinker_paths as paths
from app.services.call_order import Numbered
from app.services.tinker_futures import PROTO_TYPE, json_answer
from app.services.tinker_sessions import sampling_session_id, session_of
from app.tables import TinkerFuture, TinkerModel, User
from app.tinker import compression, custom_losses, proto, stability
from app.tinker.endpoint import body, future_answer, services
from app.tinker.fields import boolean, integer, number, obj, string
from app.tinker.messages import (
    OptimStepResponse,
    SaveWeightsForSamplerResponseInternal,
    SaveWeightsResponse,
    UntypedAPIFuture,
)
from gpu_runtime.contract import batch_from_dicts
from gpu_runtime.contract.training_settings import LOSS_CONFIG_DEFAULTS
from gpu_runtime.errors import FailedPrecondition

T = TypeVar("T")
STABLE_REINFORCE_CAP = LOSS_CONFIG_DEFAULTS["stable_reinforce"]["clip_high_threshold"]
MAX_CHECKPOINT_TTL_S = 3653 * 24 * 3600  # Tinker's bound: ten years (None: never expires)
ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")  # AdamParams' fields


async def ordered(svc: Services, model: TinkerModel, seq: int,
                  call: Callable[[Numbered, str], Awaitable[T]], request_id: str) -> T:
    """A training operation in its model's order: seq_id is its number in the pipeline named by the model id
    (app/services/call_order.py), so chunks 2..k sent before chunk 1 wait in the background, never at submit."""
    return await call(Numbered(model.id, seq), request_id)


async def submit_training(svc: Services, user: User, model: TinkerModel, seq: int, request_type: str,
                          work: Callable[[str], Awaitable[tuple[str, bytes]]]) -> TinkerFuture:
    """A training operation's future, keyed (model_id, seq_id). One refused before it joined the run's queue (a bad
    datum, an existing name) still releases its number, so the operation after it does not wait for it."""
    async def released(request_id: str) -> tuple[str, bytes]:
        try:
            return await work(request_id)
        except FailedPrecondition as exc:
            if exc.field != "seq":  # a gap in the numbers: this one never joined, and nothing can release it
                await release(svc, model, seq)
            raise
        except Exception:
            await release(svc, model, seq)
            raise

    return await svc.tinker.submit(user, ("train", model.id, seq), request_type, released)


async def release(svc: Services, model: TinkerModel, seq: int) -> None:
    # Already admitted: changes nothing. Else it waits (bounded) for seq - 1, then counts this number as admitted.
    with contextlib.suppress(FailedPrecondition):
        await svc.runs.order.skip(model.run_id or "", Numbered(model.id, seq))


async def forward_backward(request: Request, user: User) -> UntypedAPIFuture:
    if "protobuf" not in request.headers.get("content-type", ""):
        raise BadInput("forward_backward takes an application/x-protobuf ForwardBackwardRequest", field="body")
    svc = services(request)
    message = proto.decode_forward_backward(await compression.request_body(request, svc.settings.max_request_bytes))
    model = await svc.tinker_sessions.model(user, message.model_id, live=True)
    seq = integer(message.seq_id, "seq_id", 1)
    forward_only = message.forward_only
    store = stability.store(request)

    async def work(request_id: str) -> tuple[str, bytes]:
        # Provenance names recorded sequences: their sampler logprobs replace the datum's (a user error if unknown).
        stability.resolve(store, user.id, message.data, message.loss_fn)
        # loss_fn "custom": the graph its loss_id names travels with the call (its loss_fn_config is only that id)
        graph = custom_losses.graph_for(request, user, model.id, message.loss_fn, message.loss_fn_config)
        config = None if graph is not None else message.loss_fn_config
        batch = batch_from_dicts([datum.to_dict() for datum in message.data])  # Tinker's datums as the contract's items; an error answers the future
        if forward_only:
            ahead = await ordered(svc, model, seq, lambda order, rid: svc.runs.forward(
                user, batch, run_id=model.run_id, loss_fn=message.loss_fn, custom_loss=graph,
                loss_fn_config=config, request_id=rid, order=order), request_id)
            loss, outputs, own = ahead.loss_sum, ahead.outputs, ahead.metrics
        else:
            trained = await ordered(svc, model, seq, lambda order, rid: svc.runs.forward_backward(
                user, model.run_id or "", batch, loss_fn=message.loss_fn, custom_loss=graph,
                loss_fn_config=config, request_id=rid, reduction="sum", return_outputs=True,
                order=order), request_id)
            loss, outputs, own = trained.loss, trained.outputs or [], trained.metrics
        metrics = {"loss:sum": loss, **(own or {})}
        if message.loss_fn == "stable_reinforce":
            cap = (message.loss_fn_config or {}).get("clip_high_threshold", STABLE_REINFORCE_CAP)
            metrics |= stability.ratio_metrics(message.data, outputs, float(cap))
        return PROTO_TYPE, proto.encode_forward_backward_output(outputs, metrics)

    row = await submit_training(svc, user, model, seq, "Forward" if forward_only else "ForwardBackward", work)
    return future_answer(row)


async def optim_step(request: Request, user: User) -> UntypedAPIFuture:
    data = await body(request)
    svc = services(request)
    seq = integer(data.get("seq_id"), "seq_id", 1)
    adam = obj(data, "adam_params")
    # As sent (Tinker's eps 1e-12, clip 0: off), each a number; the contract's validators check their ranges.
    params = {key: number(adam, key, 0.0, field=f"adam_params.{key}") for key in ADAM_KEYS if adam.get(key) is not None}
    if string(obj(data, "optimizer_params"), "type", "adamw", field="optimizer_params.type") != "adamw":
        raise BadInput("only AdamW is supported", field="optimizer_params")
    model = await svc.tinker_sessions.model(user, string(data, "model_id", "") or "", live=True)

    async def work(request_id: str) -> tuple[str, bytes]:
        result = await ordered(svc, model, seq, lambda order, rid: svc.runs.optim_step(
            user, model.run_id or "", params, request_id=rid, order=order), request_id)
        # Namespaced: the cookbook merges these into its own metrics rows, whose `step` is its batch index.
        return json_answer(OptimStepResponse(type="optim_step", metrics={
            "optim/step": float(result.step), "optim/grad_norm": float(result.grad_norm),
            "optim/learning_rate": float(result.learning_rate)}))

    row = await submit_training(svc, user, model, seq, "OptimStep", work)
    return future_answer(row)


async def save(request: Request, user: User, kind: str) -> UntypedAPIFuture:
    """save_weights (a resumable training checkpoint) and save_weights_for_sampler (a sampler snapshot: named, or
    unnamed behind a new sampling session)."""
    data = await body(request)
    svc = services(request)
    seq = integer(data.get("seq_id"), "seq_id", 1)
    ephemeral = kind == "sampler_weights" and data.get("path") is None
    name = None if ephemeral else paths.check_name(data.get("path"))
    overwrite = boolean(data, "overwrite", False)
    ttl = checkpoint_ttl(data.get("ttl_seconds"), svc.settings.tinker_min_checkpoint_ttl_s)
    sampling_seq = integer(data.get("sampling_session_seq_id"), "sampling_session_seq_id") if ephemeral else 0
    inflight = sampler_kind(data, ephemeral)
    model = await svc.tinker_sessions.model(user, string(data, "model_id", "") or "", live=True)
    request_type = "SaveWeights" if kind == "weights" else "SaveWeightsForSampler"

    async def work(request_id: str) -> tuple[str, bytes]:
        run = await svc.runs.get(user, model.run_id or "")
        if ephemeral:  # an unnamed snapshot (memory only, expiring), sampled through a sampling session
            the_id = sampling_session_id(session_of(model.id), sampling_seq)
            saved = await ordered(svc, model, seq, lambda order, rid: svc.runs.save_weights_for_sampler(
                user, run.id, name=None, request_id=rid, order=order), request_id)
            # An inflight sampler has no path: it samples the run's current weights (app/tinker/sampling.py), newer
            # than or equal to those this save froze once its calls before it were applied.
            await svc.tinker_sessions.map(user, the_id, model.session_id, "sample", run.id, model.base_model,
                                          None if inflight else f"tinker://{model.id}/sampler_weights/{saved.name}")
            return json_answer(SaveWeightsForSamplerResponseInternal(sampling_session_id=the_id,
                                                                     type="save_weights_for_sampler"))
        target = paths.TinkerPath(model.id, kind, name or "")
        existing = {(c.mode, c.name) for c in await svc.runs.checkpoints(run)}
        if (target.mode, target.name) in existing and not overwrite:
            raise BadInput(f"checkpoint {target.path} exists; pass overwrite=True to replace it", field="path")
        if kind == "sampler_weights":  # a named snapshot: the weights at this seq_id, kept until deleted
            await ordered(svc, model, seq, lambda order, rid: svc.runs.save_weights_for_sampler(
                user, run.id, name=target.name, request_id=rid, order=order), request_id)
            if ttl is not None:
                await svc.runs.set_expiry(user, run.id, target.mode, target.name, ttl)
            return json_answer(SaveWeightsForSamplerResponseInternal(path=target.path, type="save_weights_for_sampler"))
        await ordered(svc, model, seq, lambda order, rid: svc.runs.save_state(
            user, run.id, mode=target.mode, name=target.name, with_optimizer=True, request_id=rid, order=order,
            overwrite=overwrite),
            request_id)
        if ttl is not None:
            await svc.runs.set_expiry(user, run.id, target.mode, target.name, ttl)
        return json_answer(SaveWeightsResponse(path=target.path, type="save_weights"))

    row = await submit_training(svc, user, model, seq, request_type, work)
    return future_answer(row)


def sampler_kind(data: Mapping[str, object], ephemeral: bool) -> bool:
    """Tinker's SamplingClientKind: True for `inflight` (the model's mutable latest weights), False for `snapshot`.
    The SDK sends inflight only for an unnamed save: a named checkpoint is frozen by definition."""
    kind = string(data, "kind", "snapshot")
    if kind not in ("snapshot", "inflight") or (kind == "inflight" and not ephemeral):
        raise BadInput(f"kind must be 'snapshot', or 'inflight' for an unnamed save, got {kind!r}", field="kind")
    return kind == "inflight"


def checkpoint_ttl(value: object, shortest: int) -> float | None:
    """Tinker's ttl_seconds: None keeps the checkpoint until deleted; else whole seconds from the save, an hour
    (SIGNAL_TINKER_MIN_CHECKPOINT_TTL_S) to ten years, as Tinker bounds it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not shortest <= value <= MAX_CHECKPOINT_TTL_S:
        raise BadInput(f"ttl_seconds must be an integer in {shortest}..{MAX_CHECKPOINT_TTL_S}, got {value!r}",
                       field="ttl_seconds")
    return float(value)


async def save_weights(request: Request, user: User) -> UntypedAPIFuture:
    return await save(request, user, "weights")


async def save_weights_for_sampler(request: Request, user: User) -> UntypedAPIFuture:
    return await save(request, user, "sampler_weights")
