"""Tinker's REST surface (RestClient, the `tinker` CLI): server capabilities, training runs, checkpoint listing,
deletion, publishing and expiry, weights_info. Read-mostly views of the caller's models and their Signal checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC

from starlette.requests import Request

from app import tables
from app.errors import BadInput, NotFound
from app.services import Services
from app.services import tinker_paths as paths
from app.tables import TinkerModel, User
from app.tinker import published
from app.tinker.endpoint import body, services
from app.tinker.messages import (
    Checkpoint,
    CheckpointsListResponse,
    CheckpointType,
    CurrentCheckpointStorageUsageResponse,
    Empty,
    GetServerCapabilitiesResponse,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
)
from app.tinker.training import checkpoint_ttl
from gpu_runtime.contract import target_families

KINDS = {mode: kind for kind, mode in paths.MODES.items()}  # Signal's mode → Tinker's path segment
TYPES: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler"}
PAGE_MOST = 1000


def page(request: Request) -> tuple[int, int]:
    try:
        limit = int(request.query_params.get("limit", 20))
        offset = int(request.query_params.get("offset", 0))
    except ValueError:
        raise BadInput("limit and offset must be integers", field="limit") from None
    return max(1, min(limit, PAGE_MOST)), max(0, offset)


def checkpoint(model: TinkerModel, row: tables.Checkpoint) -> Checkpoint | None:
    kind = KINDS.get(row.mode)
    if kind is None or not paths.NAME.match(row.name):
        return None  # a merged export, or a name Tinker paths cannot carry
    return {"checkpoint_id": f"{kind}/{row.name}", "checkpoint_type": TYPES[kind], "time": row.created_at.isoformat(),
            "tinker_path": f"tinker://{model.id}/{kind}/{row.name}", "size_bytes": int(row.size_bytes),
            "public": bool(row.public), "expires_at": None if row.expires_at is None else row.expires_at.replace(tzinfo=UTC).isoformat()}


async def training_run(svc: Services, user: User, model: TinkerModel) -> TrainingRun:
    run = await svc.runs.get(user, model.run_id or "")
    saved = [c for c in (checkpoint(model, row) for row in await svc.runs.checkpoints(run)) if c is not None]
    last = {t: next((c for c in reversed(saved) if c["checkpoint_type"] == t), None) for t in ("training", "sampler")}
    answer: TrainingRun = {
        "training_run_id": model.id, "base_model": model.base_model, "model_owner": user.email, "is_lora": True,
        "corrupted": run.status == "failed", "lora_rank": int(run.lora_config.get("r", 0)),
        "last_request_time": run.updated_at.isoformat()}
    if last["training"]:
        answer["last_checkpoint"] = last["training"]
    if last["sampler"]:
        answer["last_sampler_checkpoint"] = last["sampler"]
    return answer


async def server_capabilities(request: Request, user: User) -> GetServerCapabilitiesResponse:
    return {"supported_models": [
        {"model_name": m.name, "max_context_length": m.context_length, "trainable": m.available,
         "sampleable": m.available} for m in services(request).catalog.list()]}


async def list_training_runs(request: Request, user: User) -> TrainingRunsResponse:
    svc = services(request)
    limit, offset = page(request)
    models, total = await svc.tinker_sessions.models(user, limit, offset)
    runs = []
    for model in models:
        try:
            runs.append(await training_run(svc, user, model))
        except NotFound:
            continue  # its run was deleted
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


async def get_training_run(request: Request, user: User) -> TrainingRun:
    svc = services(request)
    return await training_run(svc, user, await svc.tinker_sessions.model(user, request.path_params["model_id"]))


async def list_checkpoints(request: Request, user: User) -> CheckpointsListResponse:
    """A model's checkpoints: all of them for its owner; for another user, only its published ones (none published:
    the model is not found, as any other user's is)."""
    svc = services(request)
    model = await svc.tinker_sessions.trained(request.path_params["model_id"])
    if model is not None and model.user_id != user.id and model.run_id:
        shown = [c for c in (checkpoint(model, row) for row in await svc.runs.published(model.run_id)) if c]
        if shown:
            return {"checkpoints": shown}
    model = await svc.tinker_sessions.model(user, request.path_params["model_id"])
    run = await svc.runs.get(user, model.run_id or "")
    rows = [checkpoint(model, row) for row in await svc.runs.checkpoints(run)]
    return {"checkpoints": [c for c in rows if c is not None]}


async def list_user_checkpoints(request: Request, user: User) -> CheckpointsListResponse:
    svc = services(request)
    limit, offset = page(request)
    models, _ = await svc.tinker_sessions.models(user, PAGE_MOST, 0)
    found: list[Checkpoint] = []
    for model in models:
        try:
            run = await svc.runs.get(user, model.run_id or "")
        except NotFound:
            continue
        found += [c for c in (checkpoint(model, row) for row in await svc.runs.checkpoints(run)) if c is not None]
    found.sort(key=lambda c: c["time"], reverse=True)
    return {"checkpoints": found[offset:offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)}}


async def storage_usage(request: Request, user: User) -> CurrentCheckpointStorageUsageResponse:
    """The caller's checkpoint storage, now (Tinker's AdminClient.get_current_checkpoint_storage_usage): one row, the
    user's; Signal has no projects and no storage price, so those fields are null."""
    count, size = await services(request).runs.storage(user)
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [{
        "project_id": None, "org_user_urn": None, "user_email": user.email, "user_name": None,
        "checkpoint_count": count, "size_bytes": size, "size_gigabytes": size / 1e9, "estimated_monthly_cost_usd": None}]}


async def delete_checkpoint(request: Request, user: User) -> Empty:
    svc = services(request)
    model = await svc.tinker_sessions.model(user, request.path_params["model_id"])
    kind, _, name = str(request.path_params["checkpoint_id"]).partition("/")
    if kind not in paths.MODES:
        raise NotFound(f"checkpoint {request.path_params['checkpoint_id']!r} not found", field="checkpoint_id")
    run = await svc.runs.get(user, model.run_id or "")
    row = next((c for c in await svc.runs.checkpoints(run) if c.mode == paths.MODES[kind] and c.name == name), None)
    if row is None:
        raise NotFound(f"checkpoint {kind}/{name} of {model.id} not found", field="checkpoint_id")
    await svc.runs.delete_checkpoint(user, run.id, str(row.id))
    return {}


async def publish(request: Request, user: User) -> Empty:
    return await set_public(request, user, True)


async def unpublish(request: Request, user: User) -> Empty:
    if "/" not in str(request.path_params["checkpoint_id"]):  # DELETE …/weights/publish: a checkpoint so named
        request.path_params["checkpoint_id"] += "/publish"
        return await delete_checkpoint(request, user)
    return await set_public(request, user, False)


async def set_public(request: Request, user: User, public: bool) -> Empty:
    """POST (publish) or DELETE (unpublish) …/checkpoints/{weights|sampler_weights}/{name}/publish: the owner's
    alone; another user's model is not found, published or not."""
    run_id, mode, name = await _own_checkpoint(request, user)
    await services(request).runs.set_public(user, run_id, mode, name, public)
    return {}


async def _own_checkpoint(request: Request, user: User) -> tuple[str, str, str]:
    """The run, mode and name of the path's `{model_id}`/`{weights|sampler_weights}/{name}`: the caller's model only
    (another user's is not found), a malformed checkpoint id not found alike."""
    model = await services(request).tinker_sessions.model(user, request.path_params["model_id"])
    kind, _, name = str(request.path_params["checkpoint_id"]).partition("/")
    if kind not in paths.MODES or not paths.NAME.match(name):
        raise NotFound(f"checkpoint {request.path_params['checkpoint_id']!r} not found", field="checkpoint_id")
    return model.run_id or "", paths.MODES[kind], name


async def set_ttl(request: Request, user: User) -> Empty:
    """PUT …/checkpoints/{weights|sampler_weights}/{name}/ttl `{"ttl_seconds"}` (RestClient's
    set_checkpoint_ttl_from_tinker_path): a new expiry from now, within save's bounds, or none when null. The owner's
    alone; another user's, an expired one or none is not found alike."""
    data = await body(request)
    if "ttl_seconds" not in data:
        raise BadInput("ttl_seconds is required: seconds from now, or null to keep the checkpoint until deleted",
                       field="ttl_seconds")
    svc = services(request)
    ttl = checkpoint_ttl(data["ttl_seconds"], svc.settings.tinker_min_checkpoint_ttl_s)
    run_id, mode, name = await _own_checkpoint(request, user)
    await svc.runs.set_expiry(user, run_id, mode, name, ttl)
    return {}


async def weights_info(request: Request, user: User, data: Mapping[str, object]) -> WeightsInfoResponse:
    """The LoRA a checkpoint loads into, from weights_info's JSON body (as sent)."""
    svc = services(request)
    source = paths.parse(data.get("tinker_path"), "tinker_path")
    model, run = await published.readable(svc, user, source)  # the caller's own, or another user's published one
    if not any(c.mode == source.mode and c.name == source.name for c in await svc.runs.checkpoints(run)):
        raise NotFound(f"checkpoint {source.path} not found", field="tinker_path")
    switches = target_families(run.lora_config.get("target_modules"))
    return {"base_model": model.base_model, "is_lora": True, "lora_rank": int(run.lora_config.get("r", 0)),
            "train_attn": switches["train_attn"], "train_mlp": switches["train_mlp"],
            "train_unembed": switches["train_unembed"], "optimizer_config": {"type": "adamw"}}
