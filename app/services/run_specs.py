"""What callers hand RunService, as values: createRun's spec, a run's labels, sample's params, the runs list's
orders and search, and the contract's field names in GraphQL's case. app.services.runs re-exports them."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypedDict

from sqlalchemy import Text, cast, or_
from strawberry.utils.str_converters import to_camel_case

from app.errors import BadInput
from app.tables import RUN_NAME_LENGTH, RUN_NOTE_LENGTH, RUN_TAG_LENGTH, RUN_TAGS_MOST, Run
from gpu_runtime.contract import (
    LORA_DEFAULTS,
    LORA_SWITCHES,
    MAX_RUN_SEED,
    MAX_SAMPLES,
    MAX_STOP,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_P,
    SAMPLE_DEFAULTS,
    RuntimeOptions,
    adam_settings,
    check_sample_size,
    check_seed,
    lora_settings,
    sampling_settings,
)
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.training_settings import LoraAsked, LoraGiven, LoraSettings


@dataclass
class RunSpec:
    """What createRun asks for; defaults and bounds are the engine contract's (gpu_runtime.contract)."""

    base_model: str | None = None  # None: the server's default model (or the checkpoint's)
    lora_r: int | None = None  # None: LORA_DEFAULTS (or the checkpoint's)
    lora_alpha: float | None = None  # None: 2 * lora_r, the usual choice
    lora_dropout: float | None = None
    lora_target_modules: list[str] | None = None  # None: the switches below, else the model's attention projections
    # Tinker's switches, instead of target modules (not both); None: LORA_DEFAULTS (attention only).
    train_attn: bool | None = None
    train_mlp: bool | None = None
    train_unembed: bool | None = None
    learning_rate: float | None = None  # None: ADAM_DEFAULTS
    weight_decay: float | None = None
    grad_clip_norm: float | None = None
    seed: int | None = None  # None: 0 (or the checkpoint's)
    gpu_config: str | None = None
    quantization: str | None = None  # None | "8bit" | "4bit" (bitsandbytes)
    from_checkpoint: str | None = None  # signal://<run_id>/<kind>/<name>: start there (docs/CHECKPOINTS.md)
    with_optimizer: bool = True  # with from_checkpoint: its AdamW state too
    name: str | None = None  # None or blank: default_run_name(base model, now)
    tags: list[str] | None = None
    note: str | None = None

    def labels(self) -> RunLabels:
        """Its name, tags and note; a blank name is no name (the default's)."""
        return RunLabels(name=self.name if (self.name or "").strip() else None, tags=self.tags, note=self.note)

    def lora(self) -> LoraSettings | LoraAsked:
        """The run's LoRA settings, checked and filled by the contract; errors name createRun's field (`loraR`)."""
        lora = {"r": self.lora_r if self.lora_r is not None else LORA_DEFAULTS["r"], "alpha": self.lora_alpha,
                "dropout": self.lora_dropout if self.lora_dropout is not None else LORA_DEFAULTS["dropout"],
                "target_modules": self.lora_target_modules, "train_attn": self.train_attn,
                "train_mlp": self.train_mlp, "train_unembed": self.train_unembed}
        with fields_renamed(lambda field: field):  # graphql_field names them: loraR, trainMlp
            return lora_settings(lora)

    def explicit_lora(self) -> LoraGiven | None:
        """Only the LoRA settings the caller gave: a run from a checkpoint inherits the rest, and these must agree."""
        given: LoraGiven = {}
        if self.lora_r is not None:
            given["r"] = self.lora_r
        if self.lora_alpha is not None:
            given["alpha"] = self.lora_alpha
        if self.lora_dropout is not None:
            given["dropout"] = self.lora_dropout
        if self.lora_target_modules is not None:
            given["target_modules"] = self.lora_target_modules
        return given or None

    def adam(self) -> dict[str, float]:
        """The run's AdamW defaults for optim_step; errors name createRun's field (`learningRate`)."""
        adam = {"learning_rate": self.learning_rate, "weight_decay": self.weight_decay,
                "grad_clip_norm": self.grad_clip_norm}
        with fields_renamed(lambda field: field.removeprefix("adam.")):
            return adam_settings(adam)

    def validate(self) -> None:
        if self.base_model is not None and not self.base_model.strip():
            raise BadInput("baseModel is empty; leave it out for the server's default model", field="baseModel")
        if self.from_checkpoint is not None:
            switch = next((name for name in LORA_SWITCHES if getattr(self, name) is not None), None)
            if switch is not None:
                raise BadInput("a run from a checkpoint inherits its LoRA targets; leave the switches out",
                               field=graphql_field(switch))
        self.lora()
        self.adam()
        self.labels().checked()
        if self.seed is not None:
            check_seed(self.seed, MAX_RUN_SEED)


# The contract's sampling bounds, for forms (the playground): the browser stops what the server would refuse.
SAMPLE_LIMITS = {"temperature": MAX_TEMPERATURE, "max_tokens": MAX_TOKENS_LIMIT, "num_samples": MAX_SAMPLES,
                 "top_p": MAX_TOP_P, "stop": MAX_STOP}


@dataclass
class RunLabels:
    """What a user calls a run (issue 18 §1): None leaves that label as it is."""

    name: str | None = None
    tags: list[str] | None = None
    note: str | None = None

    def checked(self) -> dict[str, str | list[str]]:
        """The labels given, cleaned (names and tags stripped, tags once each in their order) and within bounds."""
        values: dict[str, str | list[str]] = {}
        if self.name is not None:
            name = self.name.strip()
            if not name:
                raise BadInput("name is empty", field="name")
            if len(name) > RUN_NAME_LENGTH:
                raise BadInput(f"name is {len(name)} characters; at most {RUN_NAME_LENGTH}", field="name")
            values["name"] = name
        if self.tags is not None:
            tags = list(dict.fromkeys(tag.strip() for tag in self.tags if tag.strip()))
            if len(tags) > RUN_TAGS_MOST:
                raise BadInput(f"{len(tags)} tags; at most {RUN_TAGS_MOST}", field="tags")
            for tag in tags:
                if len(tag) > RUN_TAG_LENGTH:
                    raise BadInput(f"tag {tag[:20]!r}… is {len(tag)} characters; at most {RUN_TAG_LENGTH}",
                                   field="tags")
            values["tags"] = tags
        if self.note is not None:
            if len(self.note) > RUN_NOTE_LENGTH:
                raise BadInput(f"note is {len(self.note)} characters; at most {RUN_NOTE_LENGTH}", field="note")
            values["note"] = self.note
        return values


def default_run_name(base_model: str, when: datetime) -> str:
    """A readable name for a run created without one: its base model's short name and the UTC minute,
    e.g. "SmolLM2-135M 2026-12-04 17:40"."""
    return f"{base_model.rsplit('/', 1)[-1]} {when.astimezone(UTC):%Y-%m-%d %H:%M}"[:RUN_NAME_LENGTH]


SEARCH_LENGTH = RUN_NAME_LENGTH  # the runs list's search text: a whole name at most

# The runs list's orders (GraphQL's RunSort, the dashboard's ?sort=): the first is the default.
RUN_SORTS: dict[str, tuple[Any, ...]] = {
    "newest": (Run.created_at.desc(), Run.id),
    "oldest": (Run.created_at.asc(), Run.id),
    "name": (Run.name.asc(), Run.created_at.desc()),
    "activity": (Run.updated_at.desc(), Run.id),
    "step": (Run.step.desc(), Run.created_at.desc()),
}


def search_clause(search: str) -> Any:
    """A case-insensitive substring of the name, the base model or a tag (the tags' JSON text)."""
    pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    return or_(Run.name.ilike(pattern, escape="\\"), Run.base_model.ilike(pattern, escape="\\"),
               cast(Run.tags, Text).ilike(pattern, escape="\\"))


class ChatArgs(TypedDict, total=False):
    """The contract Sample's chat fields (and Tinker's prompt_alt_tokens_k), only those set."""

    messages: list[JSONObject]
    tools: list[JSONObject]
    prefill: str
    history_tokens: list[int]
    history_through: int
    pieces: str
    fit_context: bool
    prompt_alt_tokens_k: int


class SampleArgs(ChatArgs):
    """The contract's Sample less its run, weights and request: SampleCall(**args, …) is checked key by key."""

    prompts: list[str] | None
    prompt_tokens: list[list[int]] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str] | list[int] | None
    num_samples: int
    seed: int | None
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int


@dataclass
class SampleParams:
    """sample's arguments as GraphQL takes them; `engine_params` is the contract's Sample (less run and request)."""

    prompts: list[str] | None = None  # exactly one of prompts and prompt_tokens
    prompt_tokens: list[list[int]] | None = None
    max_tokens: int = SAMPLE_DEFAULTS["max_tokens"]
    temperature: float = SAMPLE_DEFAULTS["temperature"]
    top_p: float = SAMPLE_DEFAULTS["top_p"]
    top_k: int = SAMPLE_DEFAULTS["top_k"]
    stop: list[str] | None = None  # stop strings…
    stop_tokens: list[int] | None = None  # …or stop token ids: GraphQL lists are typed, so two arguments
    num_samples: int = SAMPLE_DEFAULTS["num_samples"]
    seed: int | None = None
    prompt_logprobs: bool = SAMPLE_DEFAULTS["prompt_logprobs"]
    topk_prompt_logprobs: int = SAMPLE_DEFAULTS["topk_prompt_logprobs"]
    topk_sample_logprobs: int = SAMPLE_DEFAULTS["topk_sample_logprobs"]
    prompt_alt_tokens_k: int = 0  # Tinker's draws at each prompt position (contract Sample.prompt_alt_tokens_k)
    store: bool | None = None  # None: stored (the run's current weights); False: no sample rows
    # What the history keeps as each token prompt's text (the playground's chat as typed); None: the ids, as JSON.
    prompt_texts: list[str] | None = None
    # /v1's chat, rendered by the runtime in the same call (contract Sample.messages): its conversation, tool
    # definitions, a forced call's opening, the carried history (ids, turn index); and what /v1 reads back.
    messages: list[JSONObject] | None = None
    tools: list[JSONObject] | None = None
    prefill: str | None = None
    history: tuple[list[int], int] | None = None
    fit_context: bool = False
    pieces: str | None = None

    def engine_params(self) -> SampleArgs:
        if self.stop is not None and self.stop_tokens is not None:
            raise BadInput("give stop (strings) or stopTokens (token ids), not both", field="stop")
        return {
            "prompts": self.prompts,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_tokens if self.stop_tokens is not None else self.stop,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "prompt_logprobs": self.prompt_logprobs,
            "topk_prompt_logprobs": self.topk_prompt_logprobs,
            "topk_sample_logprobs": self.topk_sample_logprobs,
            **self.chat_params(),
        }

    def chat_params(self) -> ChatArgs:
        """The contract's chat fields, only those set (a GraphQL sample's call stays as it was)."""
        args: ChatArgs = {}
        if self.messages is not None:
            args["messages"] = self.messages
        if self.tools is not None:
            args["tools"] = self.tools
        if self.prefill is not None:
            args["prefill"] = self.prefill
        if self.history is not None:
            args["history_tokens"], args["history_through"] = self.history
        if self.pieces is not None:
            args["pieces"] = self.pieces
        if self.fit_context:
            args["fit_context"] = True
        if self.prompt_alt_tokens_k:  # Tinker's alone; set only when asked, as the chat fields are
            args["prompt_alt_tokens_k"] = self.prompt_alt_tokens_k
        return args

    def check(self, bounds: RuntimeOptions) -> None:
        """The contract's bounds and the per-call size bounds (rows x max_tokens), checked now: a stream that starts
        later must not fail on a bad temperature or on n x max_tokens past SIGNAL_MAX_SAMPLE_TOKENS."""
        params = self.engine_params()
        settings = sampling_settings(max_tokens=params["max_tokens"], temperature=params["temperature"],
                                     top_p=params["top_p"], top_k=params["top_k"], stop=params["stop"],
                                     num_samples=params["num_samples"], seed=params["seed"])
        prompts = self.prompts if self.prompts is not None else self.prompt_tokens or []
        check_sample_size(len(prompts), settings, bounds, "prompts" if self.prompts is not None else "prompt_tokens")

    def stored_prompts(self, rendered: list[list[int]] | None = None) -> list[str]:
        """What a sample row keeps as its prompt: the text, a token-id prompt's given text, or its ids as JSON
        (`rendered`: the ids the runtime rendered messages as)."""
        if self.prompts is not None:
            return self.prompts
        ids = self.prompt_tokens if self.prompt_tokens is not None else rendered
        return self.prompt_texts or [json.dumps(ids) for ids in ids or []]


def graphql_field(field: str | None) -> str | None:
    """The contract's field names in GraphQL's: `max_tokens` → `maxTokens`, `lora.target_modules` →
    `loraTargetModules` (createRun's flat input), `lora.train_mlp` → `trainMlp` (Tinker's switch names),
    `batch[2].output` as is."""
    if not field:
        return field
    if field.startswith("lora.train_"):
        field = field.removeprefix("lora.")
    elif field.startswith("lora."):
        field = "lora_" + field.removeprefix("lora.")
    return to_camel_case(field)  # the same converter the schema applies to every name


@contextmanager
def fields_renamed(rename: Callable[[str], str]) -> Iterator[None]:
    """Re-raise the contract's BadInput under the field name the client sent, in GraphQL's case."""
    try:
        yield
    except BadInput as error:
        raise BadInput(error.message, field=graphql_field(rename(error.field)) if error.field else None) from None
