"""The sampling calls as types: sample, and the tokenizer's work for clients that have none (tokenizer, render_chat);
gpu_runtime/engine/sampling_calls.py answers them. `check_weights_source` is the one rule for which weights a call reads."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gpu_runtime.contract.calls import Call, Kind, Lane, Method
from gpu_runtime.contract.checkpoints import check_snapshot_name
from gpu_runtime.contract.checks import check_id, check_request_id
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.results import RenderChatResult, SampleResult, TokenizerResult
from gpu_runtime.contract.runtime_options import RuntimeOptions, check_sample_size
from gpu_runtime.contract.sampling_settings import (
    SAMPLE_DEFAULTS,
    SamplingSettings,
    check_prompt_alt_tokens,
    sampling_prompts,
    sampling_settings,
)
from gpu_runtime.errors import BadInput


@dataclass(frozen=True, kw_only=True)
class Sample(Call[SampleResult]):
    """Sampling from one weights source (gpu_runtime/engine/weights_sources.py): `run_id` alone (the run's current weights,
    in its queue), `run_id` + `snapshot` or `checkpoint` (frozen weights: off the run's queue), or no `run_id` and
    `base_model` + `user_id` (the base alone). `run_id` + `latest`: the run's current weights as they are when the
    call arrives, copied for it (off the run's queue, like a snapshot: gpu_runtime/engine/snapshots.py, `Snapshots.latest`)."""

    method = Method.SAMPLE
    answer = SampleResult
    kind = Kind(Lane.FREE, on_run=True, primitive=True)
    prompts: list[str] | None = None  # exactly one of prompts (text) and prompt_tokens (token ids)
    prompt_tokens: list[list[int]] | None = None
    run_id: str | None = None
    snapshot: str | None = None  # a sampler snapshot's name on the run (save_weights_for_sampler)
    checkpoint: str | None = None  # a training checkpoint's name on the run
    base_model: str | None = None  # with run_id None: the base alone
    user_id: str | None = None  # whose base-model sample it is (billing, fair turns)
    max_tokens: int = SAMPLE_DEFAULTS["max_tokens"]
    temperature: float = SAMPLE_DEFAULTS["temperature"]
    top_p: float = SAMPLE_DEFAULTS["top_p"]
    top_k: int = SAMPLE_DEFAULTS["top_k"]  # 0 or -1: off
    stop: str | list[str] | list[int] | None = None  # None: EOS; []: nothing; strings or token ids (and EOS)
    num_samples: int = SAMPLE_DEFAULTS["num_samples"]
    seed: int | None = None  # None: drawn by the runtime
    prompt_logprobs: bool = SAMPLE_DEFAULTS["prompt_logprobs"]
    topk_prompt_logprobs: int = SAMPLE_DEFAULTS["topk_prompt_logprobs"]
    topk_sample_logprobs: int = SAMPLE_DEFAULTS["topk_sample_logprobs"]
    # k draws, at the call's temperature, from the whole next-token distribution at each prompt position after the
    # first (Tinker's prompt_alt_tokens_k); token-id prompts only, so the answer's size is known before the call runs.
    prompt_alt_tokens_k: int = 0
    request_id: str | None = None
    # True: after each decode chunk, the new settled text and ids of every sequence (a SampleChunk) reach the caller
    # as progress, before the SampleResult; a transport without progress (Modal) sends the result alone.
    stream: bool = False
    # True: no place in the run's order (no ticket): the run's weights as of its last applied optim_step when the
    # call reaches the runtime, copied for it, so later optim_steps do not change what it decodes (/v1 on a run id).
    latest: bool = False
    # Instead of prompts: one conversation, rendered in the runtime as render_chat renders it (with `tools`, `prefill`
    # and the carried history), so a /v1 chat request is one round trip; the result's prompt_tokens are its ids.
    messages: list[JSONObject] | None = None  # OpenAI's chat messages and tool definitions, as the client sent them
    tools: list[JSONObject] | None = None
    prefill: str | None = None
    history_tokens: list[int] | None = None
    history_through: int | None = None
    # True: max_tokens is a ceiling, cut to the room the longest prompt leaves in the context (/v1 without max_tokens).
    fit_context: bool = False
    # Which ids the result also gives as text, one token each (SampleResult.pieces): "stopped" those of sequences cut
    # at a stop string, "all" every id of the prompts, sequences and top-k; None none. /v1 needs no decode call then.
    pieces: str | None = None

    def validate(self) -> None:
        check_weights_source(self)
        check_request_id(self.request_id)
        for name in ("stream", "latest", "fit_context"):
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"{name} must be true or false", field=name)
        if self.latest and (self.run_id is None or self.snapshot is not None or self.checkpoint is not None):
            raise BadInput("latest names a run's current weights: give run_id alone", field="latest")
        if self.pieces not in PIECES:
            raise BadInput("pieces must be null, \"stopped\" or \"all\"", field="pieces")
        if self.messages is not None:
            if self.prompts is not None or self.prompt_tokens is not None:
                raise BadInput("give messages or prompts, not both", field="messages")
        elif self.tools is not None or self.prefill is not None or self.history_tokens is not None:
            raise BadInput("tools, prefill and history go with messages", field="messages")
        check_chat(self.messages, self.tools, self.prefill, self.history_tokens, self.history_through)
        self.settings()
        if self.prompt_alt_tokens_k and self.prompt_tokens is None:
            raise BadInput("prompt_alt_tokens_k takes token-id prompts (prompt_tokens)", field="prompt_alt_tokens_k")

    def check_size(self, options: RuntimeOptions) -> None:
        prompts, settings = self.settings()
        if self.fit_context:  # the tokens it may generate are known once its prompts are (Sampling.prepare)
            settings = replace(settings, max_tokens=1)
        lengths = None if self.prompt_tokens is None else [len(ids) for ids in self.prompt_tokens]
        check_sample_size(len(prompts), settings, options, self.prompts_field, lengths)
        check_prompt_alt_tokens(self.prompt_alt_tokens_k, lengths)

    @property
    def prompts_field(self) -> str:
        return "messages" if self.messages is not None else "prompts" if self.prompt_tokens is None else "prompt_tokens"

    @property
    def frozen(self) -> bool:
        """Whether its weights never change under it (a snapshot, a checkpoint, a base, a copy of the latest): then it
        is off the run's queue."""
        return self.run_id is None or self.snapshot is not None or self.checkpoint is not None or self.latest

    def caller(self) -> str | None:
        return self.user_id

    def settings(self) -> tuple[list[str] | list[list[int]], SamplingSettings]:
        """The prompts (text, or token ids when prompt_tokens is set; messages stand for one prompt, rendered later)
        and the checked settings."""
        prompts = [""] if self.messages is not None else sampling_prompts(self.prompts, self.prompt_tokens)
        return prompts, sampling_settings(self.max_tokens, self.temperature, self.top_p, self.top_k, self.stop,
                                          self.num_samples, self.seed, self.prompt_logprobs,
                                          self.topk_prompt_logprobs, self.topk_sample_logprobs,
                                          self.prompt_alt_tokens_k)


@dataclass(frozen=True, kw_only=True)
class Tokenizer(Call[TokenizerResult]):
    """A base model's tokenizer, as sampling and rendering use it: on `base_model` (a name or path the runtime
    loads), or on the base of run `run_id`. A call on no run's queue: answered at the next tick."""

    method = Method.TOKENIZER
    answer = TokenizerResult
    kind = Kind(Lane.SYSTEM)
    base_model: str | None = None
    quantization: str | None = None
    run_id: str | None = None
    # Also write it with save_pretrained into the runtime's data directory and answer that directory: for a client
    # on the runtime's own machine (the local backend) that cannot reach the Hub (Tinker's get_info tokenizer_id).
    save: bool = False

    def validate(self) -> None:
        if (self.base_model is None) == (self.run_id is None):
            raise BadInput("give exactly one of base_model or run_id", field="base_model")
        if not isinstance(self.save, bool):
            raise BadInput("save must be true or false", field="save")
        if self.run_id is not None:
            check_id(self.run_id, "run_id")
        elif not isinstance(self.base_model, str) or not self.base_model:
            raise BadInput("base_model must be a model name or path", field="base_model")

    @property
    def run(self) -> str | None:
        return None  # reads the run's base, never its state: it waits on no run's calls


PIECES = (None, "stopped", "all")  # Sample.pieces: which ids its result gives as text
MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name"}


@dataclass(frozen=True, kw_only=True)
class RenderChat(Call[RenderChatResult]):
    """The tokenizer's text work for a client that has none (the OpenAI endpoint): `messages` rendered with the
    model's chat template and the generation prompt, as token ids (rendering to text and tokenising again would
    double BOS), `prompts` tokenised as sample would, and the ids in `decode` as text, one token each. On a run's base (`run_id`) or on `base_model`.
    A call on no run's queue, like `tokenizer`."""

    method = Method.RENDER_CHAT
    answer = RenderChatResult
    kind = Kind(Lane.SYSTEM)
    base_model: str | None = None
    run_id: str | None = None
    # [{role, content}], content already text; an assistant's may carry tool_calls, a tool's its tool_call_id and name
    messages: list[JSONObject] | None = None
    tools: list[JSONObject] | None = None  # JSON-schema function definitions, given to the template
    prefill: str | None = None  # text after the generation prompt: the opening of a forced tool call
    # The ids messages[:history_through + 1] were sampled as (an earlier answer's prompt ids + its completion ids):
    # the prompt starts with them where the messages before that turn render as that prompt began (render_messages).
    history_tokens: list[int] | None = None
    history_through: int | None = None
    prompts: list[str] | None = None  # plain text, tokenised as sample tokenises a text prompt (with BOS)
    decode: list[int] | None = None

    def validate(self) -> None:
        if (self.base_model is None) == (self.run_id is None):
            raise BadInput("give exactly one of base_model or run_id", field="base_model")
        if self.run_id is not None:
            check_id(self.run_id, "run_id")
        elif not isinstance(self.base_model, str) or not self.base_model:
            raise BadInput("base_model must be a model name or path", field="base_model")
        check_chat(self.messages, self.tools, self.prefill, self.history_tokens, self.history_through)
        if self.prompts is not None:
            sampling_prompts(self.prompts, None)
        if self.decode is not None and (not isinstance(self.decode, list) or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.decode)):
            raise BadInput("decode must be a list of token ids", field="decode")

    @property
    def run(self) -> str | None:
        return None  # reads the run's base, never its state: it waits on no run's calls


def check_chat(messages: Any, tools: Any, prefill: Any, history_tokens: Any, history_through: Any) -> None:
    """A conversation to render (render_chat's, or a sample's): messages, tool definitions, prefill, carried history."""
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise BadInput("messages must be a non-empty list", field="messages")
        for i, message in enumerate(messages):
            if (not isinstance(message, dict) or not {"role", "content"} <= set(message) <= MESSAGE_KEYS
                    or not isinstance(message["role"], str) or not isinstance(message["content"], str)
                    or not isinstance(message.get("tool_calls", []), list)):
                raise BadInput(f"messages[{i}] must be {{role, content}} with text values (and tool_calls, "
                               "tool_call_id, name)", field=f"messages[{i}]")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadInput("tools must be a list of function definitions", field="tools")
    if prefill is not None and (not isinstance(prefill, str) or messages is None):
        raise BadInput("prefill is text after rendered messages", field="prefill")
    if (history_tokens is None) != (history_through is None):
        raise BadInput("history_tokens and history_through go together", field="history_tokens")
    if history_tokens is not None:
        check_history(history_tokens, history_through, messages)


def check_history(tokens: Any, through: Any, messages: list[JSONObject] | None) -> None:
    """A render's carried history: token ids, and the index of the assistant message they end with."""
    if not isinstance(tokens, list) or not tokens or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                         for t in tokens):
        raise BadInput("history_tokens must be a non-empty list of token ids", field="history_tokens")
    if (isinstance(through, bool) or not isinstance(through, int) or messages is None
            or not 0 <= through < len(messages) or messages[through].get("role") != "assistant"):
        raise BadInput("history_through must be the index of an assistant message", field="history_through")


def check_weights_source(call: Any) -> None:
    """One weights source (the issue's decision): run_id [+ snapshot | checkpoint], or base_model + user_id alone."""
    if call.run_id is None:
        if call.snapshot is not None or call.checkpoint is not None:
            field = "snapshot" if call.snapshot is not None else "checkpoint"
            raise BadInput(f"{field} names a run's weights: give run_id too", field=field)
        if not isinstance(call.base_model, str) or not call.base_model:
            raise BadInput("give run_id (a run's weights) or base_model and user_id (the base alone)",
                           field="base_model")
        check_id(call.user_id, "user_id")
        return
    check_id(call.run_id, "run_id")
    if call.base_model is not None:
        raise BadInput("base_model is for the base alone, without run_id", field="base_model")
    if call.snapshot is not None and call.checkpoint is not None:
        raise BadInput("give one of snapshot and checkpoint, not both", field="checkpoint")
    for field in ("snapshot", "checkpoint"):
        if getattr(call, field) is not None:
            check_snapshot_name(getattr(call, field), field)
