"""Sampling (RunSampling): a run's current weights in its order, a snapshot or checkpoint off its queue, a base
model alone; withdrawing a sample whose client went away; and the tokenizer work (tokenizer, render_chat)."""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from app.backends import Progress
from app.errors import BadInput
from app.services.call_order import Numbered
from app.services.call_records import Caller
from app.services.deadlines import Deadline, Streamed
from app.services.run_calls import RunCalls, pool_of
from app.services.run_specs import SampleParams, fields_renamed
from app.services.streams import unless_gone
from app.tables import BaseSample, Run, Sample, User, new_id
from gpu_runtime.client.allocation import PoolKey
from gpu_runtime.contract import (
    CHECKPOINT_SCHEME,
    LOADABLE_KINDS,
    Cancel,
    RenderChat,
    RenderChatResult,
    SampledSequence,
    SampleResult,
    Tokenizer,
    TokenizerResult,
    checkpoint_ref,
)
from gpu_runtime.contract import Sample as SampleCall  # app.tables.Sample is a sample's row
from gpu_runtime.contract.json_types import JSON, JSONObject


class RunSampling:
    def __init__(self, calls: RunCalls) -> None:
        self.calls = calls
        self.tool_formats: dict[str, str | None] = {}  # per base model: its template's tool-call format (tool_format)

    async def sample(self, user: User, run_id: str | None, params: SampleParams, request_id: str | None = None,
                     snapshot: str | None = None, checkpoint: str | None = None, base_model: str | None = None,
                     order: Numbered | None = None, progress: Progress | None = None,
                     latest: bool = False) -> SampleResult:
        """Sample a run's current weights (in the run's order: its ticket), a snapshot or checkpoint of it, or a
        base alone. Frozen sources (docs/SNAPSHOTS.md) take no ticket: they wait for nothing
        on the run; so does `latest` (/v1 on a run id): the run's current weights as they are when the call reaches the
        runtime, which copies them for it, so that nothing queued on the run holds it up. Each sequence becomes a
        sample row when `params.store` says so (None: true for current weights, false otherwise: an RL step of 128
        prompts x 16 samples would write 2,048): the run's history on its page, or for a base alone the user's
        (`base_samples`). A frozen source is named in the row's params."""
        # The contract takes stop strings and ids as one `stop`; GraphQL has two arguments: name the one sent.
        stop_field = "stop_tokens" if params.stop_tokens is not None and params.stop is None else "stop"
        run_id, snapshot, checkpoint = checkpoint_source(run_id, snapshot, checkpoint)
        with self.calls.shares.place(user.id), fields_renamed(lambda field: stop_field if field == "stop" else field):
            return await self._sample(user, run_id, params, request_id, snapshot, checkpoint, base_model, order,
                                      progress, latest)

    async def _sample(self, user: User, run_id: str | None, params: SampleParams, request_id: str | None,
                      snapshot: str | None, checkpoint: str | None, base_model: str | None,
                      order: Numbered | None, progress: Progress | None, latest: bool) -> SampleResult:
        keep = params.store if params.store is not None else (
            run_id is not None and snapshot is None and checkpoint is None)
        source = {key: value for key, value in (("snapshot", snapshot), ("checkpoint", checkpoint)) if value}

        def stored_params() -> dict[str, object]:
            return {**{k: v for k, v in params.engine_params().items() if k not in ("prompts", "prompt_tokens")
                       and k not in params.chat_params()}, **source}

        async def record(session: AsyncSession, run: Run, result: SampleResult, fresh: bool) -> SampleResult:
            if not fresh or not keep:
                return result
            kept = stored_params()
            for prompt, sequences in zip(params.stored_prompts(result.prompt_tokens), result.sequences):
                for sequence in sequences:
                    session.add(Sample(run_id=run.id, step=result.step, prompt=prompt,
                                       output=sequence.text, params=cancelled(kept, sequence)))
            return result

        if run_id is None:
            if snapshot is not None or checkpoint is not None:
                raise BadInput("snapshot and checkpoint name a run's weights: give runId too",
                               field="snapshot" if snapshot is not None else "checkpoint")
            return await self._sample_base(user, base_model, params, request_id, stored_params() if keep else None,
                                           progress)
        if base_model is not None:
            raise BadInput("baseModel samples the base alone: leave runId out", field="baseModel")
        def on(run: Run) -> SampleCall:
            return SampleCall(run_id=run.id, **params.engine_params(), stream=progress is not None,
                              snapshot=snapshot, checkpoint=checkpoint,
                              latest=latest and snapshot is None and checkpoint is None)

        if latest and snapshot is None and checkpoint is None:
            return await self.calls.off_the_queue(user, run_id, "sample", request_id, on, record, progress)
        if snapshot is None and checkpoint is None:
            return await self.calls.apply(user, run_id, "sample", request_id, on, record, order=order, progress=progress)
        return await self.calls.off_the_queue(user, run_id, "sample", request_id, on, record, progress,
                                              frozen=(snapshot, checkpoint))

    async def cancel_sample(self, user: User, request_id: str, run: Run | None, base_model: str | None,
                            withdraw: bool = False) -> None:
        """Stop the caller's streamed sample `request_id` (its client went away): decoding, the runtime answers it with
        what it has, stop_reason "cancelled", which its `sample` call then records as it records any answer; not begun
        yet, or with `withdraw` (a client that saw none of it), it is withdrawn (CANCELLED): never applied, not billed,
        not recorded."""
        pool = pool_of(run) if run is not None else self._base_pool(base_model)[1]
        await self.calls.engine(Cancel(request_id=request_id, user_id=user.id, withdraw=withdraw), pool=pool)

    async def sample_unless_gone(self, user: User, run_id: str | None, params: SampleParams,
                                 gone: asyncio.Future[None], request_id: str | None = None,
                                 snapshot: str | None = None, checkpoint: str | None = None,
                                 base_model: str | None = None, order: Numbered | None = None,
                                 latest: bool = False) -> SampleResult:
        """`sample` for a client that waits for the whole answer: if it goes away first (`gone`), the sample is
        withdrawn wherever it is, queued or decoding (CANCELLED: never applied, not billed, not recorded; its compute
        seconds logged). A training call has no such path: it completes whatever its client does."""
        request_id = request_id or new_id()  # the name its cancel needs
        run_id, snapshot, checkpoint = checkpoint_source(run_id, snapshot, checkpoint)

        async def cancel() -> None:
            run = await self.calls.readable(user, run_id, snapshot, checkpoint) if run_id is not None else None
            await self.cancel_sample(user, request_id, run, base_model, withdraw=True)

        return await unless_gone(self.sample(user, run_id, params, request_id=request_id, snapshot=snapshot,
                                             checkpoint=checkpoint, base_model=base_model, order=order,
                                             latest=latest),
                                 gone, cancel, f"sample {request_id} of user {user.id}")

    def _base_pool(self, base_model: str | None) -> tuple[Any, PoolKey, str]:
        """A base model's catalogue entry, pool and GPU configuration (a base alone runs in the pool of its default)."""
        model = self.calls.catalog.get(base_model or self.calls.default_model)
        gpu_config = self.calls.catalog.resolve_gpu(model, None, None)
        return model, PoolKey.of(model.name, gpu_config, None), gpu_config

    async def _sample_base(self, user: User, base_model: str | None, params: SampleParams,
                           request_id: str | None, store: dict[str, object] | None,
                           progress: Progress | None = None) -> SampleResult:
        """The base alone: no run, so no ticket; billed to the user (Ledger.owe_user). `store` (the
        params to keep with them, or None) writes the sequences to the user's base-model history."""
        deadline = Deadline.start(self.calls.deadlines, "sample")
        model, pool, gpu_config = self._base_pool(base_model)
        request = self.calls.checked(SampleCall(**params.engine_params(), base_model=model.source, user_id=user.id,
                                           stream=progress is not None, request_id=request_id))
        request_id = await self.calls.ledger.allow_user(user, "sample", request_id or new_id(), model.name, gpu_config)
        request = dataclasses.replace(request, request_id=request_id)

        streamed = Streamed.of(progress)

        async def work() -> SampleResult:
            result = await self.calls.answered(deadline, pool, user, request_id, self.calls.engine(
                request, pool=pool, progress=streamed), streamed)
            caller = Caller(user.id, None, model.name, await self.calls.device(pool), gpu_config)

            async def write(session: AsyncSession, fresh: bool) -> SampleResult:
                if fresh and store is not None:
                    for prompt, sequences in zip(params.stored_prompts(result.prompt_tokens), result.sequences):
                        session.add_all(BaseSample(user_id=user.id, base_model=model.name, prompt=prompt,
                                                   output=sequence.text, params=cancelled(store, sequence))
                                        for sequence in sequences)
                return result

            return await self.calls.recorder.record(caller, "sample", request_id, result, write)

        return await asyncio.shield(asyncio.ensure_future(work()))

    async def base_device(self, base_model: str | None) -> str:
        """The device a run on `base_model` (None: the default) would train on: its pool's runtime's."""
        return await self.calls.device(self._base_pool(base_model)[1])

    async def tokenizer(self, user: User, run_id: str | None = None, base_model: str | None = None,
                        save: bool = False) -> TokenizerResult:
        """The tokenizer of a run's base (the caller's run) or of a catalogue model (default: the server's): its id,
        vocabulary size, EOS, BOS and pad ids, and chat template. Reads the base only: no run's queue, no credits.
        `save`: the runtime also writes it to a directory of its own and answers its path (a path on the runtime's
        machine, so the caller checks the backend is local)."""
        if run_id is not None and base_model is not None:
            raise BadInput("give runId or baseModel, not both", field="runId")
        if run_id is not None:
            run = await self.calls.get(user, run_id)
            return await self.calls.engine(Tokenizer(run_id=run.id, save=save), pool=pool_of(run))
        model = self.calls.catalog.get(base_model or self.calls.default_model)
        pool = PoolKey.of(model.name, self.calls.catalog.resolve_gpu(model, None, None), None)
        return await self.calls.engine(Tokenizer(base_model=model.source, save=save), pool=pool)

    async def chat_prompts(self, user: User, run_id: str | None, conversations: builtins.list[builtins.list[dict[str, str]]],
                           base_model: str | None = None) -> builtins.list[builtins.list[int]]:
        """`sample`'s chat prompts as token ids: each conversation through the base's chat template, the assistant's
        turn opened, as /v1's chat completions render it (the run's base, or `base_model`'s with no run)."""
        if not conversations or not all(conversations):
            raise BadInput("messages needs at least one conversation, each of at least one message", field="messages")
        run = await self.calls.get(user, run_id) if run_id is not None else None
        rendered = [await self.render_chat(run, messages=messages, base_model=base_model) for messages in conversations]
        return [list(r.prompt_tokens or []) for r in rendered]

    async def tool_format(self, run: Run | None, base_model: str | None, messages: Sequence[Mapping[str, JSON]],
                          tools: builtins.list[JSONObject],
                          history: tuple[builtins.list[int], int] | None) -> str | None:
        """The call format the base's chat template teaches when given tools (hermes, llama3_json, gpt_oss), kept per
        base: a template does not change under its name, and /v1 needs it before its sample (stream or not)."""
        key = run.base_model if run is not None else base_model or self.calls.default_model
        if key not in self.tool_formats:
            rendered = await self.render_chat(run, messages=messages, base_model=base_model, tools=tools,
                                              history=history)
            self.tool_formats[key] = rendered.tool_format
        return self.tool_formats[key]

    async def render_chat(self, run: Run | None, messages: Sequence[Mapping[str, JSON]] | None = None,
                          prompts: builtins.list[str] | None = None, decode: builtins.list[int] | None = None,
                          base_model: str | None = None, tools: builtins.list[JSONObject] | None = None,
                          prefill: str | None = None,
                          history: tuple[builtins.list[int], int] | None = None) -> RenderChatResult:
        """On the caller's run's base (ownership checked by `get`), or a catalogue model's (`base_model`, run None):
        messages through its chat template as token ids (`history`: the ids an earlier turn was sampled as, and that
        turn's index, reused), text `prompts` as ids, and `decode`'s ids as text, one each: the OpenAI endpoint's
        tokenizer work. No run queue, no credits."""
        tokens, through = history if history is not None else (None, None)
        objects = None if messages is None else [dict(message) for message in messages]  # the contract's JSON objects
        if run is not None:
            request, pool = RenderChat(run_id=run.id, messages=objects, prompts=prompts, decode=decode, tools=tools,
                                       prefill=prefill, history_tokens=tokens,
                                       history_through=through), pool_of(run)
        else:
            model = self.calls.catalog.get(base_model or self.calls.default_model)
            request = RenderChat(base_model=model.source, messages=objects, prompts=prompts, decode=decode,
                                 tools=tools, prefill=prefill, history_tokens=tokens, history_through=through)
            pool = PoolKey.of(model.name, self.calls.catalog.resolve_gpu(model, None, None), None)
        request.validate()
        return await self.calls.engine(request, pool=pool)


def cancelled(params: dict[str, object], sequence: SampledSequence) -> dict[str, object]:
    """A sample row's params; a sequence cut short by its client going away says so (finish_reason "cancelled")."""
    return {**params, "finish_reason": "cancelled"} if sequence.stop_reason == "cancelled" else params


def checkpoint_source(run_id: str | None, snapshot: str | None,
                      checkpoint: str | None) -> tuple[str | None, str | None, str | None]:
    """`checkpoint` as a name on `run_id`, or as the `signal://<run_id>/<kind>/<name>` path docs/CHECKPOINTS.md gives
    (and load_state takes): a state or adapter checkpoint by its name, a sampler one as the snapshot it is. The path's
    run is the call's (a `runId` given must be the same). Returns (run_id, snapshot, checkpoint)."""
    if checkpoint is None or not checkpoint.startswith(CHECKPOINT_SCHEME):
        return run_id, snapshot, checkpoint
    ref = checkpoint_ref(checkpoint, "checkpoint", kinds=(*LOADABLE_KINDS, "sampler"))
    if run_id is not None and ref.run_id != run_id:
        raise BadInput(f"checkpoint: {checkpoint!r} is a checkpoint of run {ref.run_id!r}, not of runId {run_id!r}",
                       field="checkpoint")
    if snapshot is not None:
        raise BadInput("give one of snapshot and checkpoint, not both", field="checkpoint")
    if ref.kind == "sampler":
        return ref.run_id, ref.name, None
    return ref.run_id, None, ref.name
