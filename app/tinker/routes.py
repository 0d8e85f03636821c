"""Tinker's wire, /api/v1 (docs/TINKER.md): the endpoints the unmodified `tinker==0.38.0` SDK calls, as a thin
adapter over the service layer. Every operation is a future (app/services/tinker_futures.py); the runtime work
is RunService's, the same path GraphQL takes. Request bodies are JSON except forward_backward's protobuf.

Auth is the SDK's `X-API-Key: tml-<Signal key>`, never the dashboard's cookie (so /api/v1 is exempt from CSRF).
Every 4xx is a plain JSON response with a Content-Length: a 400 without a body sends the SDK into a reconnect loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.errors import BadInput, SignalError, Unauthenticated, http_status, retry_after_headers
from app.services import Services
from app.services.call_order import Numbered
from app.services.runs import RunSpec, SampleParams
from app.services.tinker_futures import PROTO_TYPE, json_answer
from app.services.tinker_sessions import SessionFinished, model_id, sampling_session_id, session_of
from app.tables import Run, TinkerModel, User
from app.tinker import paths, proto, rest
from gpu_runtime.contract.settings import MAX_TOKENS_LIMIT
from gpu_runtime.errors import FailedPrecondition

log = logging.getLogger("signal.tinker")
T = TypeVar("T")

PREFIX = "/api/v1"
KEY_PREFIX = "tml-"  # the SDK refuses keys without it: users send tml- + their whole Signal key (tml-sk-…)
# Tinker's LoRA alpha is fixed server-side (the SDK sends none); Signal's own default is 2r.
TINKER_LORA_ALPHA = 32.0
SAMPLE_MAX_CONCURRENT_REQUESTS = 64  # sampling futures one client keeps in flight; each holds a long-poll
Handler = Callable[[Request], Awaitable[Response]]
UserHandler = Callable[[Request, User], Awaitable[Response | dict[str, Any]]]


def error(status: int, message: str, category: str = "user", headers: dict[str, str] | None = None) -> JSONResponse:
    # Never an "error" key the SDK could mistake for a failed future: this is an HTTP error, with `detail`.
    return JSONResponse({"detail": message, "category": category}, status_code=status, headers=headers)


def services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]  # Starlette's state is untyped


async def authenticate(request: Request) -> User:
    """The X-API-Key header with one leading `tml-` stripped, as any Signal key. The session cookie is never read."""
    secret = request.headers.get("x-api-key") or ""
    if secret.startswith(KEY_PREFIX):
        secret = secret.removeprefix(KEY_PREFIX)
    if not secret:
        raise Unauthenticated("missing API key: send X-API-Key: tml-<your Signal key>")
    return await services(request).keys.authenticate(secret)


async def body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise BadInput("Content-Encoding is not supported (the server sets proto_compress_fwdbwd false)", field="body")
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        raise BadInput("the body is not JSON", field="body") from None
    if not isinstance(value, dict):
        raise BadInput("the body must be a JSON object", field="body")
    return value


def endpoint(handler: UserHandler, auth: bool = True) -> Handler:
    """A handler's typed errors as JSON: 401 bad key, 400 unparsable or invalid input, 404 unknown ids."""
    async def wrapped(request: Request) -> Response:
        try:
            user = await authenticate(request) if auth else None
            answer = await handler(request, user)  # type: ignore[arg-type]  # auth=False handlers take no user
        except SessionFinished as exc:
            return error(410, f"session {exc} has finished")
        except SignalError as exc:
            status = http_status(exc)
            if isinstance(exc, (BadInput, FailedPrecondition)):
                status = 400  # the SDK's user error at submit (422 is fatal too; 400 is what the issue names)
            # A 429 (too many calls in flight) carries Retry-After, which the SDK's HTTP layer honours.
            return error(status if status < 500 else 503, exc.message, "user" if status < 500 else "server",
                         retry_after_headers(exc))
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return wrapped


def integer(value: Any, field: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadInput(f"{field} must be an integer >= {low}, got {value!r}", field=field)
    return value


def future_answer(row: Any, **extra: Any) -> dict[str, Any]:
    answer = {"request_id": row.request_id, **extra}
    if row.sample_sequence_ids:
        answer["sample_sequence_ids"] = list(row.sample_sequence_ids)
    return answer


# ---- client, sessions, telemetry -------------------------------------------------------------------------------

async def client_config(request: Request, user: User) -> dict[str, Any]:
    settings = services(request).settings
    return {"pjwt_auth_enabled": False, "fwdbwd_max_chunk_len": settings.max_batch_size,
            "fwdbwd_max_chunk_bytes_count": settings.max_request_bytes // 2, "proto_compress_fwdbwd": False,
            "sample_max_concurrent_requests": SAMPLE_MAX_CONCURRENT_REQUESTS}


async def create_session(request: Request, user: User) -> dict[str, Any]:
    data = await body(request)
    session_id = await services(request).tinker_sessions.create(user, data.get("display_name"),
                                                                data.get("user_metadata"))
    return {"session_id": session_id, "type": "create_session"}


async def session_heartbeat(request: Request, user: User) -> dict[str, Any]:
    data = await body(request)
    await services(request).tinker_sessions.heartbeat(user, str(data.get("session_id", "")))
    return {"type": "session_heartbeat"}


async def finish_session(request: Request, user: User) -> dict[str, Any]:
    await services(request).tinker_sessions.finish(user, request.path_params["session_id"])
    return {}


async def telemetry(request: Request, user: User) -> dict[str, Any]:
    return {"status": "accepted"}


async def healthz(request: Request, user: User) -> dict[str, Any]:
    return {"status": "ok"}


# ---- models ------------------------------------------------------------------------------------------------

async def create_model(request: Request, user: User) -> dict[str, Any]:
    data = await body(request)
    svc = services(request)
    session_id = str(data.get("session_id", ""))
    await svc.tinker_sessions.open(user, session_id)
    seq = integer(data.get("model_seq_id"), "model_seq_id")
    base_model = data.get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise BadInput("base_model is required", field="base_model")
    lora = data.get("lora_config") or {}
    optimizer = (data.get("optimizer_config") or {}).get("type", "adamw")
    the_id = model_id(session_id, seq)

    async def work(request_id: str) -> tuple[str, bytes]:
        if optimizer != "adamw":
            raise BadInput(f"optimizer {optimizer!r} is not supported: Signal trains with AdamW",
                           field="optimizer_config")
        seed = lora.get("seed")
        spec = RunSpec(base_model=base_model, lora_r=lora.get("rank", 32), lora_alpha=TINKER_LORA_ALPHA,
                       seed=seed if seed is not None else secrets.randbelow(2**31),
                       train_attn=bool(lora.get("train_attn", True)), train_mlp=bool(lora.get("train_mlp", True)),
                       train_unembed=bool(lora.get("train_unembed", True)))
        run = await svc.runs.create(user, spec)
        await svc.tinker_sessions.map(user, the_id, session_id, "train", run.id, base_model)
        return json_answer({"model_id": the_id, "type": "create_model"})

    row = await svc.tinker.submit(user, ("model", session_id, seq), "CreateModel", work)
    return future_answer(row, model_id=the_id)


async def load_weights(request: Request, user: User) -> dict[str, Any]:
    """Create-via-load (session_id + model_seq_id: a new model from a training checkpoint) or the deprecated
    load into an existing model (model_id + seq_id, in the model's order)."""
    data = await body(request)
    svc = services(request)
    source = paths.parse(data.get("path"))
    optimizer = bool(data.get("optimizer", False))
    if "model_id" in data:  # the deprecated TrainingClient.load_state
        model = await svc.tinker_sessions.model(user, str(data["model_id"]), live=True)
        seq = integer(data.get("seq_id"), "seq_id", 1)

        async def load(request_id: str) -> tuple[str, bytes]:
            checkpoint = await signal_checkpoint(svc, user, source)
            await ordered(svc, model, seq, lambda order, rid: svc.runs.load_state(
                user, model.run_id or "", checkpoint, with_optimizer=optimizer, request_id=rid, order=order), request_id)
            return json_answer({"path": source.path, "type": "load_weights"})

        row = await submit_training(svc, user, model, seq, "LoadWeights", load)
        return future_answer(row)
    session_id = str(data.get("session_id", ""))
    await svc.tinker_sessions.open(user, session_id)
    model_seq = integer(data.get("model_seq_id"), "model_seq_id")
    the_id = model_id(session_id, model_seq)

    async def create(request_id: str) -> tuple[str, bytes]:
        parent = await svc.tinker_sessions.model(user, source.model_id)
        checkpoint = await signal_checkpoint(svc, user, source)
        run = await svc.runs.create(user, RunSpec(from_checkpoint=checkpoint, with_optimizer=optimizer))
        await svc.tinker_sessions.map(user, the_id, session_id, "train", run.id, parent.base_model)
        return json_answer({"model_id": the_id, "path": source.path, "type": "load_weights"})

    row = await svc.tinker.submit(user, ("model", session_id, model_seq), "LoadWeights", create)
    return future_answer(row, model_id=the_id)


async def signal_checkpoint(svc: Services, user: User, source: paths.TinkerPath) -> str:
    """The signal:// reference of a tinker:// path (the model's run, the kind's mode, the name)."""
    model = await svc.tinker_sessions.model(user, source.model_id)
    return f"signal://{model.run_id}/{source.mode}/{source.name}"


async def get_info(request: Request, user: User) -> dict[str, Any]:
    data = await body(request)
    svc = services(request)
    model = await svc.tinker_sessions.model(user, str(data.get("model_id", "")))
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


# ---- training ------------------------------------------------------------------------------------------------

async def ordered(svc: Services, model: TinkerModel, seq: int,
                  call: Callable[[Numbered, str], Awaitable[T]], request_id: str) -> T:
    """A training operation in its model's order: seq_id is its number in the pipeline named by the model id
    (app/services/call_order.py), so chunks 2..k sent before chunk 1 wait in the background, never at submit."""
    return await call(Numbered(model.id, seq), request_id)


async def submit_training(svc: Services, user: User, model: TinkerModel, seq: int, request_type: str,
                          work: Callable[[str], Awaitable[tuple[str, bytes]]]) -> Any:
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


async def forward_backward(request: Request, user: User) -> dict[str, Any]:
    if "protobuf" not in request.headers.get("content-type", ""):
        raise BadInput("forward_backward takes an application/x-protobuf ForwardBackwardRequest", field="body")
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise BadInput("Content-Encoding is not supported (the server sets proto_compress_fwdbwd false)", field="body")
    message = proto.decode_forward_backward(await request.body())
    svc = services(request)
    model = await svc.tinker_sessions.model(user, message["model_id"], live=True)
    seq = integer(message["seq_id"], "seq_id", 1)
    forward_only = message["forward_only"]

    async def work(request_id: str) -> tuple[str, bytes]:
        if forward_only:
            ahead = await ordered(svc, model, seq, lambda order, rid: svc.runs.forward(
                user, message["data"], run_id=model.run_id, loss_fn=message["loss_fn"],
                loss_fn_config=message["loss_fn_config"], request_id=rid, order=order), request_id)
            loss, outputs = ahead.loss_sum, ahead.outputs
        else:
            trained = await ordered(svc, model, seq, lambda order, rid: svc.runs.forward_backward(
                user, model.run_id or "", message["data"], loss_fn=message["loss_fn"],
                loss_fn_config=message["loss_fn_config"], request_id=rid, reduction="sum", return_outputs=True,
                order=order), request_id)
            loss, outputs = trained.loss, trained.outputs or []
        return PROTO_TYPE, proto.encode_forward_backward_output(outputs, {"loss:sum": loss})

    row = await submit_training(svc, user, model, seq, "Forward" if forward_only else "ForwardBackward", work)
    return future_answer(row)


async def optim_step(request: Request, user: User) -> dict[str, Any]:
    data = await body(request)
    svc = services(request)
    model = await svc.tinker_sessions.model(user, str(data.get("model_id", "")), live=True)
    seq = integer(data.get("seq_id"), "seq_id", 1)
    adam = data.get("adam_params") or {}
    if "optimizer_params" in data and (data["optimizer_params"] or {}).get("type", "adamw") != "adamw":
        raise BadInput("only AdamW is supported", field="optimizer_params")

    async def work(request_id: str) -> tuple[str, bytes]:
        known = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        params = {key: adam[key] for key in known if key in adam}  # as sent: Tinker's eps 1e-12, clip 0 (off)
        result = await ordered(svc, model, seq, lambda order, rid: svc.runs.optim_step(
            user, model.run_id or "", params, request_id=rid, order=order), request_id)
        # Namespaced: the cookbook merges these into its own metrics rows, whose `step` is its batch index.
        return json_answer({"type": "optim_step", "metrics": {
            "optim/step": float(result.step), "optim/grad_norm": float(result.grad_norm),
            "optim/learning_rate": float(result.learning_rate)}})

    row = await submit_training(svc, user, model, seq, "OptimStep", work)
    return future_answer(row)


async def save(request: Request, user: User, kind: str) -> dict[str, Any]:
    """save_weights (a resumable training checkpoint) and save_weights_for_sampler (a sampler snapshot: named, or
    unnamed behind a new sampling session)."""
    data = await body(request)
    svc = services(request)
    model = await svc.tinker_sessions.model(user, str(data.get("model_id", "")), live=True)
    seq = integer(data.get("seq_id"), "seq_id", 1)
    ephemeral = kind == "sampler_weights" and data.get("path") is None
    name = None if ephemeral else paths.check_name(data.get("path"))
    overwrite = bool(data.get("overwrite", False))
    request_type = "SaveWeights" if kind == "weights" else "SaveWeightsForSampler"

    async def work(request_id: str) -> tuple[str, bytes]:
        run = await svc.runs.get(user, model.run_id or "")
        if ephemeral:  # an unnamed snapshot (memory only, expiring), sampled through a sampling session
            sampling_seq = integer(data.get("sampling_session_seq_id"), "sampling_session_seq_id")
            the_id = sampling_session_id(session_of(model.id), sampling_seq)
            saved = await ordered(svc, model, seq, lambda order, rid: svc.runs.save_weights_for_sampler(
                user, run.id, name=None, request_id=rid, order=order), request_id)
            await svc.tinker_sessions.map(user, the_id, model.session_id, "sample", run.id, model.base_model,
                                          f"tinker://{model.id}/sampler_weights/{saved.name}")
            return json_answer({"sampling_session_id": the_id, "type": "save_weights_for_sampler"})
        target = paths.TinkerPath(model.id, kind, name or "")
        existing = {(c.mode, c.name) for c in await svc.runs.checkpoints(run)}
        if (target.mode, target.name) in existing and not overwrite:
            raise BadInput(f"checkpoint {target.path} exists; pass overwrite=True to replace it", field="path")
        if kind == "sampler_weights":  # a named snapshot: the weights at this seq_id, kept until deleted
            await ordered(svc, model, seq, lambda order, rid: svc.runs.save_weights_for_sampler(
                user, run.id, name=target.name, request_id=rid, order=order), request_id)
        else:
            await ordered(svc, model, seq, lambda order, rid: svc.runs.save_state(
                user, run.id, mode=target.mode, name=target.name, with_optimizer=True, request_id=rid, order=order),
                request_id)
        return json_answer({"path": target.path, "type": "save_weights" if kind == "weights" else
                            "save_weights_for_sampler"})

    row = await submit_training(svc, user, model, seq, request_type, work)
    return future_answer(row)


async def save_weights(request: Request, user: User) -> dict[str, Any]:
    return await save(request, user, "weights")


async def save_weights_for_sampler(request: Request, user: User) -> dict[str, Any]:
    return await save(request, user, "sampler_weights")


# ---- sampling ------------------------------------------------------------------------------------------------

async def create_sampling_session(request: Request, user: User) -> dict[str, Any]:
    data = await body(request)
    svc = services(request)
    session_id = str(data.get("session_id", ""))
    await svc.tinker_sessions.open(user, session_id)
    seq = integer(data.get("sampling_session_seq_id"), "sampling_session_seq_id")
    the_id = sampling_session_id(session_id, seq)
    if data.get("model_path") is None:  # the base alone
        base_model = data.get("base_model")
        if not isinstance(base_model, str) or not base_model:
            raise BadInput("create_sampling_session needs model_path or base_model", field="base_model")
        svc.catalog.get(base_model)  # an unknown name is the caller's error now, not at the first sample
        await svc.tinker_sessions.map(user, the_id, session_id, "sample", None, base_model)
        return {"sampling_session_id": the_id, "type": "create_sampling_session"}
    source = paths.parse(data["model_path"], "model_path")
    model = await svc.tinker_sessions.model(user, source.model_id)
    run = await svc.runs.get(user, model.run_id or "")
    if (source.mode, source.name) not in {(c.mode, c.name) for c in await svc.runs.checkpoints(run)}:
        raise BadInput(f"model_path: {source.path} not found", field="model_path")
    await svc.tinker_sessions.map(user, the_id, session_id, "sample", run.id, model.base_model, source.path)
    return {"sampling_session_id": the_id, "type": "create_sampling_session"}


async def get_sampler(request: Request, user: User) -> dict[str, Any]:
    sampler = await services(request).tinker_sessions.model(user, request.path_params["sampler_id"], "sample")
    answer = {"sampler_id": sampler.id, "base_model": sampler.base_model}
    return answer | ({"model_path": sampler.model_path} if sampler.model_path else {})


def sample_params(data: dict[str, Any], context_length: int | None) -> SampleParams:
    params = data.get("sampling_params") or {}
    chunks = (data.get("prompt") or {}).get("chunks") or []
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise BadInput(f"prompt.chunks[{i}]: only encoded_text chunks are supported", field=f"prompt.chunks[{i}]")
        tokens += list(chunk.get("tokens") or [])
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    is_ids = isinstance(stop, list) and bool(stop) and all(isinstance(s, int) for s in stop)
    max_tokens = params.get("max_tokens")
    top_k = params.get("top_k", -1)
    return SampleParams(
        prompt_tokens=[tokens],
        max_tokens=room(len(tokens), context_length) if max_tokens is None else max_tokens,
        temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0),
        top_k=0 if top_k == -1 else top_k,  # Tinker's -1 is Signal's 0: off
        stop=None if is_ids else stop, stop_tokens=stop if is_ids else None,
        num_samples=data.get("num_samples", 1), seed=params.get("seed"),
        prompt_logprobs=bool(data.get("prompt_logprobs", False)), store=False)


def room(prompt_length: int, context_length: int | None) -> int:
    """max_tokens null: the room the prompt leaves in the context (the catalogue's context_length), up to the bound."""
    if context_length is None:
        return MAX_TOKENS_LIMIT
    return max(1, min(MAX_TOKENS_LIMIT, context_length - prompt_length))


async def asample(request: Request, user: User) -> dict[str, Any]:
    data = await body(request)
    svc = services(request)
    sampler = await svc.tinker_sessions.model(user, str(data.get("sampling_session_id", "")), "sample", live=True)
    seq = integer(data.get("seq_id", 0), "seq_id")
    num_samples = integer(data.get("num_samples", 1), "num_samples", 1)
    context_length = None
    if (data.get("sampling_params") or {}).get("max_tokens") is None:
        base = sampler.base_model if sampler.run_id is None else (await svc.runs.get(user, sampler.run_id)).base_model
        context_length = svc.catalog.get(base).context_length
    params = sample_params(data, context_length)
    # The weights: a sampler snapshot (named or the ephemeral one), a training checkpoint, or the base alone.
    snapshot = checkpoint = base_model = None
    if sampler.run_id is None:
        base_model = sampler.base_model
    elif sampler.model_path:
        kind, name = sampler.model_path.rsplit("/", 2)[-2:]
        snapshot, checkpoint = (name, None) if kind == "sampler_weights" else (None, name)

    async def work(request_id: str) -> tuple[str, bytes]:
        result = await svc.runs.sample(user, sampler.run_id, params, request_id=request_id, snapshot=snapshot,
                                       checkpoint=checkpoint, base_model=base_model)
        prompt_logprobs = result.prompt_logprobs[0] if params.prompt_logprobs and result.prompt_logprobs else None
        return PROTO_TYPE, proto.encode_sample_response(result.sequences[0], prompt_logprobs)

    row = await svc.tinker.submit(user, ("sample", sampler.id, seq), "Sample", work, samples=num_samples)
    return future_answer(row)


# ---- futures -------------------------------------------------------------------------------------------------

async def retrieve_future(request: Request, user: User) -> Response:
    data = await body(request)
    request_id = str(data.get("request_id", ""))
    answer = await services(request).tinker.retrieve(user, request_id)
    if answer is None:
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    headers = {} if answer.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(answer.retry_after_s)))}
    return Response(answer.body, status_code=answer.status, media_type=answer.media_type, headers=headers)


async def weights_info(request: Request, user: User) -> dict[str, Any]:
    return await rest.weights_info(request, user, await body(request))


async def unsupported(request: Request, user: User | None) -> Response:
    return error(404, f"{request.method} {request.url.path} is not supported by Signal's Tinker endpoint "
                 "(docs/TINKER.md lists what is)")


def routes() -> list[Route]:
    post: dict[str, UserHandler] = {
        "client/config": client_config, "create_session": create_session, "session_heartbeat": session_heartbeat,
        "telemetry": telemetry, "create_model": create_model, "get_info": get_info,
        "forward_backward": forward_backward, "optim_step": optim_step, "save_weights": save_weights,
        "save_weights_for_sampler": save_weights_for_sampler, "load_weights": load_weights,
        "create_sampling_session": create_sampling_session, "asample": asample, "retrieve_future": retrieve_future,
    }
    return [
        *(Route(f"{PREFIX}/{path}", endpoint(handler), methods=["POST"]) for path, handler in post.items()),
        Route(f"{PREFIX}/sessions/{{session_id}}/finish", endpoint(finish_session), methods=["POST"]),
        Route(f"{PREFIX}/samplers/{{sampler_id}}", endpoint(get_sampler), methods=["GET"]),
        Route(f"{PREFIX}/healthz", endpoint(healthz, auth=False), methods=["GET"]),
        # The REST surface (RestClient, the tinker CLI). Checkpoint ids hold a '/': the :path route comes after the
        # fixed ones, and the model id segment cannot hold a '/'.
        Route(f"{PREFIX}/weights_info", endpoint(weights_info), methods=["POST"]),
        Route(f"{PREFIX}/get_server_capabilities", endpoint(rest.server_capabilities), methods=["GET"]),
        Route(f"{PREFIX}/checkpoints", endpoint(rest.list_user_checkpoints), methods=["GET"]),
        Route(f"{PREFIX}/training_runs", endpoint(rest.list_training_runs), methods=["GET"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}", endpoint(rest.get_training_run), methods=["GET"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints", endpoint(rest.list_checkpoints), methods=["GET"]),
        Route(f"{PREFIX}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}",
              endpoint(rest.delete_checkpoint), methods=["DELETE"]),
        # Last: anything else under /api/v1 is 404 JSON naming it (a 404 on client/dynamic_config means defaults).
        Route(PREFIX + "/{rest:path}", endpoint(unsupported, auth=False),
              methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
