"""A sampling client's operations: create_sampling_session (a snapshot, a checkpoint or the base alone), the
sampler's description, and asample, whose answer is a protobuf SampleResponse (app/tinker/proto.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from starlette.requests import Request

from app.errors import BadInput
from app.services import tinker_paths as paths
from app.services.runs import SampleParams
from app.services.sample_shares import held
from app.services.tinker_futures import PROTO_TYPE, ended
from app.services.tinker_sessions import sampling_session_id
from app.tables import User
from app.tinker import prompt_extras, proto, published, stability
from app.tinker.endpoint import body, future_answer, services
from app.tinker.fields import boolean, integer, number, obj, optional_integer, string, token_ids
from app.tinker.messages import CreateSamplingSessionResponse, GetSamplerResponse, UntypedAPIFuture
from gpu_runtime.contract.sampling_settings import MAX_SAMPLES, MAX_TOKENS_LIMIT


async def create_sampling_session(request: Request, user: User) -> CreateSamplingSessionResponse:
    data = await body(request)
    svc = services(request)
    session_id = string(data, "session_id", "") or ""
    seq = integer(data.get("sampling_session_seq_id"), "sampling_session_seq_id")
    await svc.tinker_sessions.open(user, session_id)
    the_id = sampling_session_id(session_id, seq)
    if data.get("model_path") is None:  # the base alone
        base_model = string(data, "base_model")
        if not base_model:
            raise BadInput("create_sampling_session needs model_path or base_model", field="base_model")
        svc.catalog.get(base_model)  # an unknown name is the caller's error now, not at the first sample
        await svc.tinker_sessions.map(user, the_id, session_id, "sample", None, base_model)
        return {"sampling_session_id": the_id, "type": "create_sampling_session"}
    source = paths.parse(data["model_path"], "model_path")
    model, run = await published.readable(svc, user, source)  # the caller's own, or another user's published one
    if (source.mode, source.name) not in {(c.mode, c.name) for c in await svc.runs.checkpoints(run)}:
        raise BadInput(f"model_path: {source.path} not found", field="model_path")
    await svc.tinker_sessions.map(user, the_id, session_id, "sample", run.id, model.base_model, source.path)
    return {"sampling_session_id": the_id, "type": "create_sampling_session"}


async def get_sampler(request: Request, user: User) -> GetSamplerResponse:
    sampler = await services(request).tinker_sessions.model(user, request.path_params["sampler_id"], "sample")
    answer = GetSamplerResponse(sampler_id=sampler.id, base_model=sampler.base_model)
    if sampler.model_path:
        answer["model_path"] = sampler.model_path
    return answer


def prompt_tokens(data: Mapping[str, object]) -> list[int]:
    """A ModelInput's token ids: `{"chunks": [{"type": "encoded_text", "tokens": [...]}, ...]}`."""
    chunks = obj(data, "prompt").get("chunks") or []
    if not isinstance(chunks, list):
        raise BadInput(f"prompt.chunks must be a list, got {type(chunks).__name__}", field="prompt.chunks")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        field = f"prompt.chunks[{i}]"
        if not isinstance(chunk, dict):
            raise BadInput(f"{field} must be an object with type and tokens", field=field)
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise BadInput(f"{field}: only encoded_text chunks are supported", field=field)
        tokens += token_ids(chunk.get("tokens") or [], f"{field}.tokens")
    return tokens


def stops(params: Mapping[str, object]) -> tuple[list[str] | None, list[int] | None]:
    """`stop` as strings or as token ids (a string alone is one stop string)."""
    stop = params.get("stop")
    if stop is None:
        return None, None
    stop = [stop] if isinstance(stop, str) else stop
    if isinstance(stop, list) and stop and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return None, token_ids(stop, "sampling_params.stop")
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop or None, None
    raise BadInput("sampling_params.stop must be a string, a list of strings or a list of token ids",
                   field="sampling_params.stop")


def sample_params(data: Mapping[str, object], context_length: int | None) -> SampleParams:
    """A SampleRequest's JSON body (as sent) as Signal's sampling parameters, each field's type checked here (its
    range by the contract's validators, with the rest of the call)."""
    params = obj(data, "sampling_params")
    tokens = prompt_tokens(data)
    stop, stop_tokens = stops(params)
    max_tokens = optional_integer(params, "max_tokens", None, field="sampling_params.max_tokens")
    top_k = optional_integer(params, "top_k", -1, low=-1, field="sampling_params.top_k") or 0
    return SampleParams(
        prompt_tokens=[tokens],
        max_tokens=room(len(tokens), context_length) if max_tokens is None else max_tokens,
        temperature=number(params, "temperature", 1.0, "sampling_params.temperature"),
        top_p=number(params, "top_p", 1.0, "sampling_params.top_p"),
        top_k=max(top_k, 0),  # Tinker's -1 is Signal's 0: off
        stop=stop, stop_tokens=stop_tokens,
        num_samples=integer(data.get("num_samples", 1), "num_samples", 1, MAX_SAMPLES),
        seed=optional_integer(params, "seed", None, field="sampling_params.seed"),
        prompt_logprobs=boolean(data, "prompt_logprobs", False), store=False,
        # the contract bounds both (0..MAX_TOPK_LOGPROBS) with the rest of the call
        topk_prompt_logprobs=optional_integer(data, "topk_prompt_logprobs", 0) or 0,
        topk_sample_logprobs=optional_integer(data, "topk_sample_logprobs", 0) or 0)


def room(prompt_length: int, context_length: int | None) -> int:
    """max_tokens null: the room the prompt leaves in the context (the catalogue's context_length), up to the bound."""
    if context_length is None:
        return MAX_TOKENS_LIMIT
    return max(1, min(MAX_TOKENS_LIMIT, context_length - prompt_length))


async def asample(request: Request, user: User) -> UntypedAPIFuture:
    data = await body(request)
    svc = services(request)
    seq = integer(data.get("seq_id", 0), "seq_id")
    # Bounded before the future's row lists one sequence id per sample (a billion of them took the server down).
    num_samples = integer(data.get("num_samples", 1), "num_samples", 1, MAX_SAMPLES)
    checked = sample_params(data, None)  # every field's type, before the sampler is looked up or a future made
    prompt = checked.prompt_tokens[0] if checked.prompt_tokens else []
    alt_k = prompt_extras.alt_tokens_k(data, len(prompt))
    last_n = prompt_extras.last_n(data, len(prompt), checked.prompt_logprobs)
    targets = prompt_extras.targets(data, len(prompt))
    sampler = await svc.tinker_sessions.model(user, string(data, "sampling_session_id", "") or "", "sample",
                                              live=True)
    # The weights: a sampler snapshot (named or the ephemeral one), a training checkpoint, the base alone, or for an
    # inflight sampler (a run and no path) the run's current weights as the call reaches the runtime (`latest`).
    snapshot = checkpoint = base_model = None
    inflight = sampler.run_id is not None and not sampler.model_path
    if sampler.run_id is None:
        base_model = sampler.base_model
    elif sampler.model_path:
        kind, name = sampler.model_path.rsplit("/", 2)[-2:]
        snapshot, checkpoint = (name, None) if kind == "sampler_weights" else (None, name)
    context_length = None
    if obj(data, "sampling_params").get("max_tokens") is None:
        base = sampler.base_model if sampler.run_id is None else (
            await svc.runs.calls.readable(user, sampler.run_id, snapshot, checkpoint)).base_model
        context_length = svc.catalog.get(base).context_length
    params = dataclasses.replace(sample_params(data, context_length), prompt_alt_tokens_k=alt_k)

    store = stability.store(request) if data.get("record_stability_info") else None
    # Its place in the user's bound taken now, so past it the submit answers 429 (the SDK's backpressure: it waits
    # and resubmits); the future's sample holds it until it ends (sample_shares.py).
    place = svc.runs.shares.take(user.id)

    async def work(request_id: str) -> tuple[str, bytes]:
        held.set(place)  # this task's own context: the sample below takes no second place
        try:
            result = await svc.runs.sample_unless_gone(user, sampler.run_id, params, ended(), request_id=request_id,
                                                       snapshot=snapshot, checkpoint=checkpoint,
                                                       base_model=base_model, latest=inflight)
        finally:
            place.release()
        if store is not None:  # stable_reinforce's record, keyed by the sequence ids the submit answered
            for i, sequence in enumerate(result.sequences[0]):
                store.record(user.id, f"{request_id}:{i}", sequence.tokens, sequence.logprobs,
                             sampler.model_path or (f"{sampler.id}@{result.step}" if inflight else sampler.base_model))
        prompt_logprobs = result.prompt_logprobs[0] if params.prompt_logprobs and result.prompt_logprobs else None
        extras = proto.SampleExtras(sample_k=params.topk_sample_logprobs, prompt_k=params.topk_prompt_logprobs,
                                    topk_prompt=prompt_extras.keep_last(
                                        result.topk_prompt_logprobs[0] if result.topk_prompt_logprobs else None, last_n),
                                    alt_k=alt_k, alt_tokens=result.prompt_alt_tokens[0] if result.prompt_alt_tokens else None)
        if targets is not None:  # scored by a forward on the very weights the sample read
            scored = await svc.runs.forward(user, list(targets.datums(prompt)), run_id=sampler.run_id,
                                            base_model=base_model, snapshot=snapshot, checkpoint=checkpoint)
            extras = dataclasses.replace(extras, target_values=targets.values(scored),
                                         target_shape=(targets.rows, targets.width), target_csr=targets.csr)
        return PROTO_TYPE, proto.encode_sample_response(result.sequences[0], prompt_extras.keep_last(
            prompt_logprobs, last_n), result.prompt_cache_hit_tokens, extras)

    try:
        row = await svc.tinker.submit(user, ("sample", sampler.id, seq), "Sample", work, samples=num_samples,
                                      unsent=place.release)
    except BaseException:
        place.release()
        raise
    return future_answer(row)
