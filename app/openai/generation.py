"""One /v1 request's sample: its prompts as token ids (chat rendered with the model's template in the runtime), the
sample through RunService (billed, and kept in the sample history unless `store: false`), and its answer."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass

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


async def prepared(runs: RunService, target: Target, params: CompletionRequest) -> tuple[list[list[int]], SampleParams,
                                                                                          set[int]]:
    """The prompts as token ids (chat rendered with the template), the sample's parameters, and the EOS ids."""
    run, base = target.run, target.base_model
    prompt_param = "messages" if params.chat else "prompt"
    try:
        if params.chat:
            rendered = await tool_answers.render(runs, run, params, base)
            prompt_ids = [rendered.prompt_tokens or []]  # messages given: never None
        elif params.prompts and isinstance(params.prompts[0], str):
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
    sample = SampleParams(
        prompt_tokens=prompt_ids, max_tokens=params.max_tokens or min(room, MAX_TOKENS_LIMIT),
        temperature=params.temperature, top_p=params.top_p, stop=params.stop, num_samples=params.n,
        seed=params.seed, prompt_logprobs=params.echo and params.logprobs is not None,
        topk_prompt_logprobs=(params.logprobs or 0) if params.echo else 0,
        topk_sample_logprobs=params.logprobs or 0, store=params.store)
    return prompt_ids, sample, set(rendered.eos_token_ids)


@dataclass
class Sampling:
    """One /v1 request's sample and its answer in OpenAI's shape."""

    runs: RunService
    user: User
    target: Target
    params: CompletionRequest
    prompt_ids: list[list[int]]
    eos: set[int]

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

    async def answer(self, result: SampleResult) -> tuple[JSONObject, list[answers.Choice]]:
        """The whole answer's body and its choices (with logprobs or echo, the text of every id, prompt and top-k ones
        included, from the runtime's tokenizer; else only that of sequences cut at a stop string)."""
        params, prompt_ids = self.params, self.prompt_ids
        if params.logprobs is None and not params.echo:  # per-token text only to cut a sequence at its stop string
            wanted = {t for seq in result.sequences for s in seq if answers.cut_at_stop(s, self.eos)
                      for t in s.tokens}
        else:
            wanted = {t for seq in result.sequences for s in seq for t in s.tokens}
            wanted |= {t for ids in prompt_ids for t in ids}
            for seq in result.sequences:
                for s in seq:
                    wanted |= {int(pair[0]) for top in s.topk_logprobs or [] for pair in top}
            for tops in result.topk_prompt_logprobs or []:
                wanted |= {int(pair[0]) for top in tops if top for pair in top}
        order = sorted(wanted)
        pieces: dict[int, str] = {}
        if order:  # else no round trip to the runtime for nothing
            decoded = await self.runs.render_chat(self.target.run, decode=order, base_model=self.target.base_model)
            pieces = dict(zip(order, decoded.pieces))
        picked = answers.choices(result, pieces, self.eos)
        return answers.body(result, params, prompt_ids, picked, pieces), picked
