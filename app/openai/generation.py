"""One /v1 request's sample: its prompts as token ids (chat rendered with the model's template in the runtime), the
sample through RunService (billed, and kept in the sample history unless `store: false`), and its answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypedDict

from app.backends import Progress
from app.errors import SignalError
from app.openai import answers, tool_answers
from app.openai.errors import bad, from_signal
from app.openai.params import CompletionRequest
from app.openai.targets import Target
from app.services.runs import RunService, SampleParams
from app.tables import User
from gpu_runtime.contract import MAX_TOKENS_LIMIT, SampleResult
from gpu_runtime.contract.json_types import JSONObject


async def prepared(runs: RunService, target: Target, params: CompletionRequest
                   ) -> tuple[list[list[int]] | None, SampleParams, set[int] | None]:
    """The prompts as token ids, the sample's parameters, and the EOS ids. A chat's prompt ids and EOS ids are None:
    the runtime renders its messages in the sample call itself, and its result says both (one round trip)."""
    run, base = target.run, target.base_model
    prompt_param = "messages" if params.chat else "prompt"
    pieces = "stopped" if params.logprobs is None and not params.echo else "all"
    if params.chat:
        try:
            prefill = await tool_answers.forced_opening(runs, run, params, base)
        except SignalError as error:
            raise from_signal(error, prompt_param) from None
        return None, SampleParams(
            messages=params.messages, tools=params.tools.definitions or None, prefill=prefill, history=params.history,
            max_tokens=params.max_tokens or MAX_TOKENS_LIMIT, fit_context=not params.max_tokens,
            pieces=pieces, **_settings(params)), None
    try:
        if params.prompts and isinstance(params.prompts[0], str):
            rendered = await runs.render_chat(run, prompts=[str(p) for p in params.prompts], base_model=base)
            prompt_ids = rendered.prompts_tokens or []  # prompts given: never None
        else:
            rendered = await runs.render_chat(run, base_model=base)
            prompt_ids = [list(p) for p in params.prompts or [] if isinstance(p, list)]  # token-id prompts
    except SignalError as error:
        raise from_signal(error, prompt_param) from None
    room = rendered.context_length - max(len(ids) for ids in prompt_ids)
    if room < 1:
        raise bad(prompt_param, f"the prompt is {max(len(ids) for ids in prompt_ids)} tokens; the model's context "
                                f"is {rendered.context_length}")
    sample = SampleParams(prompt_tokens=prompt_ids, max_tokens=params.max_tokens or min(room, MAX_TOKENS_LIMIT),
                          pieces=pieces, **_settings(params))
    return prompt_ids, sample, set(rendered.eos_token_ids)


class _Settings(TypedDict):
    """SampleParams' fields /v1 sets from its own (SampleParams(**settings, …) is checked key by key)."""

    temperature: float
    top_p: float
    stop: list[str] | None
    num_samples: int
    seed: int | None
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    store: bool


def _settings(params: CompletionRequest) -> _Settings:
    """The sample's settings /v1 takes as they are (the prompts and max_tokens apart)."""
    return _Settings(temperature=params.temperature, top_p=params.top_p, stop=params.stop, num_samples=params.n,
                seed=params.seed, prompt_logprobs=params.echo and params.logprobs is not None,
                topk_prompt_logprobs=(params.logprobs or 0) if params.echo else 0,
                topk_sample_logprobs=params.logprobs or 0, store=params.store)


@dataclass
class Sampling:
    """One /v1 request's sample and its answer in OpenAI's shape."""

    runs: RunService
    user: User
    target: Target
    params: CompletionRequest
    prompt_ids: list[list[int]] | None  # None until the runtime says (a chat: its first chunk, or its result)
    eos: set[int] | None

    @property
    def chat(self) -> bool:
        return self.params.chat

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def sample(self, sample: SampleParams, request_id: str | None = None,
               progress: Progress | None = None) -> Awaitable[SampleResult]:
        run = self.target.run
        return self.runs.sample(self.user, run.id if run else None, sample, request_id=request_id,
                                snapshot=self.target.snapshot, base_model=self.target.base_model, progress=progress,
                                latest=run is not None and self.target.snapshot is None)  # no ticket: off the run's order

    def sample_unless_gone(self, sample: SampleParams, gone: asyncio.Future[None]) -> Awaitable[SampleResult]:
        """`sample` for a client that waits for the whole answer: withdrawn wherever it is if the client leaves first
        (RunService.sample_unless_gone, as a GraphQL sample)."""
        run = self.target.run
        return self.runs.sample_unless_gone(self.user, run.id if run else None, sample, gone,
                                            request_id=f"v1-{uuid.uuid4().hex}", snapshot=self.target.snapshot,
                                            base_model=self.target.base_model,
                                            latest=run is not None and self.target.snapshot is None)

    def cancel(self, request_id: str) -> Awaitable[None]:
        return self.runs.cancel_sample(self.user, request_id, self.target.run, self.target.base_model)

    def rendered(self, prompt_tokens: list[list[int]] | None, result: SampleResult | None = None) -> list[list[int]]:
        """The prompts' ids, once the runtime has said them (a chat's: rendered in its sample call)."""
        if self.prompt_ids is None and prompt_tokens is not None:
            self.prompt_ids = [list(ids) for ids in prompt_tokens]
        if self.eos is None and result is not None and result.eos_token_ids is not None:
            self.eos = set(result.eos_token_ids)
        assert self.prompt_ids is not None, "a sample's first chunk or result names its prompts"
        return self.prompt_ids

    async def answer(self, result: SampleResult) -> tuple[JSONObject, list[answers.Choice]]:
        """The whole answer's body and its choices. The text of the ids it needs (with logprobs or echo every id,
        prompt and top-k ones included; else only those of sequences cut at a stop string) came with the result,
        from the runtime's tokenizer (Sample.pieces)."""
        prompt_ids = self.rendered(result.prompt_tokens, result)
        if self.chat and self.params.tools.family is None:
            self.params.tools.family = result.tool_format
        pieces = dict(zip(result.piece_ids or [], result.pieces or []))
        picked = answers.choices(result, pieces, self.eos or set())
        return answers.body(result, self.params, prompt_ids, picked, pieces), picked
