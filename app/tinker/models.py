"""Tinker's models, each a Signal run: create_model, load_weights (a new model from a checkpoint, or the deprecated
load into an existing one), get_info."""

from __future__ import annotations

import secrets

from starlette.requests import Request

from app.errors import BadInput
from app.services import Services
from app.services import tinker_paths as paths
from app.services.runs import RunSpec
from app.services.tinker_futures import json_answer
from app.services.tinker_sessions import model_id
from app.tables import Run, User
from app.tinker.endpoint import body, future_answer, services
from app.tinker.fields import boolean, integer, obj, optional_integer, string
from app.tinker.messages import CreateModelResponse, GetInfoResponse, LoadWeightsResponse, UntypedAPIFuture
from app.tinker.training import ordered, submit_training

# Tinker's LoRA alpha is fixed server-side (the SDK sends none); Signal's own default is 2r.
TINKER_LORA_ALPHA = 32.0


async def create_model(request: Request, user: User) -> UntypedAPIFuture:
    data = await body(request)
    svc = services(request)
    session_id = string(data, "session_id", "") or ""
    seq = integer(data.get("model_seq_id"), "model_seq_id")
    base_model = string(data, "base_model")
    if not base_model:
        raise BadInput("base_model is required", field="base_model")
    lora = obj(data, "lora_config")
    optimizer = string(obj(data, "optimizer_config"), "type", "adamw", field="optimizer_config.type")
    if optimizer != "adamw":
        raise BadInput(f"optimizer {optimizer!r} is not supported: Signal trains with AdamW", field="optimizer_config")
    seed = optional_integer(lora, "seed", None, field="lora_config.seed")
    spec = RunSpec(base_model=base_model, lora_r=optional_integer(lora, "rank", 32, field="lora_config.rank"),
                   lora_alpha=TINKER_LORA_ALPHA, seed=seed if seed is not None else secrets.randbelow(2**31),
                   train_attn=boolean(lora, "train_attn", True, field="lora_config.train_attn"),
                   train_mlp=boolean(lora, "train_mlp", True, field="lora_config.train_mlp"),
                   train_unembed=boolean(lora, "train_unembed", True, field="lora_config.train_unembed"))
    await svc.tinker_sessions.open(user, session_id)
    the_id = model_id(session_id, seq)

    async def work(request_id: str) -> tuple[str, bytes]:
        run = await svc.runs.create(user, spec)
        await svc.tinker_sessions.map(user, the_id, session_id, "train", run.id, base_model)
        return json_answer(CreateModelResponse(model_id=the_id, type="create_model"))

    row = await svc.tinker.submit(user, ("model", session_id, seq), "CreateModel", work)
    return future_answer(row, model_id=the_id)


async def load_weights(request: Request, user: User) -> UntypedAPIFuture:
    """Create-via-load (session_id + model_seq_id: a new model from a training checkpoint) or the deprecated
    load into an existing model (model_id + seq_id, in the model's order)."""
    data = await body(request)
    svc = services(request)
    source = paths.parse(data.get("path"))
    optimizer = boolean(data, "optimizer", False)
    if "model_id" in data:  # the deprecated TrainingClient.load_state
        model = await svc.tinker_sessions.model(user, string(data, "model_id", "") or "", live=True)
        seq = integer(data.get("seq_id"), "seq_id", 1)

        async def load(request_id: str) -> tuple[str, bytes]:
            checkpoint = await signal_checkpoint(svc, user, source)
            await ordered(svc, model, seq, lambda order, rid: svc.runs.load_state(
                user, model.run_id or "", checkpoint, with_optimizer=optimizer, request_id=rid, order=order), request_id)
            return json_answer(LoadWeightsResponse(path=source.path, type="load_weights"))

        return future_answer(await submit_training(svc, user, model, seq, "LoadWeights", load))
    session_id = string(data, "session_id", "") or ""
    model_seq = integer(data.get("model_seq_id"), "model_seq_id")
    await svc.tinker_sessions.open(user, session_id)
    the_id = model_id(session_id, model_seq)

    async def create(request_id: str) -> tuple[str, bytes]:
        parent = await svc.tinker_sessions.model(user, source.model_id)
        checkpoint = await signal_checkpoint(svc, user, source)
        run = await svc.runs.create(user, RunSpec(from_checkpoint=checkpoint, with_optimizer=optimizer))
        await svc.tinker_sessions.map(user, the_id, session_id, "train", run.id, parent.base_model)
        return json_answer(LoadWeightsResponse(model_id=the_id, path=source.path, type="load_weights"))

    row = await svc.tinker.submit(user, ("model", session_id, model_seq), "LoadWeights", create)
    return future_answer(row, model_id=the_id)


async def signal_checkpoint(svc: Services, user: User, source: paths.TinkerPath) -> str:
    """The signal:// reference of a tinker:// path (the model's run, the kind's mode, the name)."""
    model = await svc.tinker_sessions.model(user, source.model_id)
    return f"signal://{model.run_id}/{source.mode}/{source.name}"


async def get_info(request: Request, user: User) -> GetInfoResponse:
    data = await body(request)
    svc = services(request)
    model = await svc.tinker_sessions.model(user, string(data, "model_id", "") or "")
    run = await svc.runs.get(user, model.run_id or "")
    return {"model_id": model.id, "type": "get_info", "model_name": model.base_model, "is_lora": True,
            "lora_rank": int(run.lora_config.get("r", 0)),
            "model_data": {"model_name": model.base_model, "tokenizer_id": await tokenizer_id(svc, user, run),
                           "arch": svc.catalog.get(run.base_model).family}}


async def tokenizer_id(svc: Services, user: User, run: Run) -> str:
    """A directory the runtime wrote the tokenizer to, with SIGNAL_TINKER_TOKENIZER_DIR on the local backend (its
    path is on this machine); else the catalogue's `tokenizer`, else the model's name (the SDK cuts a tokenizer id
    at its first ':')."""
    if svc.settings.tinker_tokenizer_dir and svc.settings.backend == "local":
        return str((await svc.runs.tokenizer(user, run_id=run.id, save=True)).directory)
    return (svc.catalog.get(run.base_model).tokenizer or run.base_model).split(":", 1)[0]
