"""What the runtime answers, as types: one frozen result per call that returns more than an acknowledgement.

The runtime builds these and sends `to_dict()`; the server reads them back with `from_dict`, which keeps
the fields it knows, so a runtime one field ahead (same contract version) does not break an older reader.
`replayed` marks the first answer of a call given again (a retry with the same request id).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, TypedDict, TypeVar, cast

from gpu_runtime.contract.json_types import JSONObject, as_json_object, get_list, get_str
from gpu_runtime.contract.training_settings import LoraSettings

R = TypeVar("R", bound="Result")
OMITTED_UNLESS_SET = ("replayed", "hub", "pending_excluded", "prompt_logprobs", "topk_prompt_logprobs", "outputs",
                      "directory", "prompt_alt_tokens")


# The fixed shapes inside results, as they cross the wire (plain dicts at run time: to_dict and from_dict are unchanged).


class RenderedDatum(TypedDict):
    """Tinker's datum: the ids a pass reads, and per position its target_tokens, weights, advantages, logprobs, …"""

    model_input: list[int]
    loss_fn_inputs: dict[str, list[Any]]  # each of len(model_input): target_tokens ids, the rest floats


class SequenceChunk(TypedDict):
    """What became settled of one sequence since the last chunk."""

    text: str
    tokens: list[int]
    logprobs: list[float]


class BaseDescription(TypedDict):
    """A loaded base, as gpu_runtime.compute.models.describe says it."""

    name: str
    source: str
    revision: str | None
    path: str
    quantization: str | None


class HubUpload(TypedDict):
    """Where save_state(push_to_hub=True) put the checkpoint (gpu_runtime/engine/hub.py)."""

    repo_id: str
    url: str
    commit: str
    private: bool


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, listed once per class: `fields` walks them anew on every call's answer."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


@dataclass(frozen=True, kw_only=True)
class Result:
    def to_dict(self) -> JSONObject:
        # Shallow: no result holds a dataclass, and a deep copy of a long sample's tokens costs milliseconds per call.
        data = {name: getattr(self, name) for name in field_names(type(self))}
        # A first answer carries no `replayed`; a save with no upload no `hub`; a call that asked for none no `outputs`.
        for name in OMITTED_UNLESS_SET:
            if not data.get(name, True):
                del data[name]
        return data

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, object]) -> R:
        # The runtime wrote these fields from this type: each value is what its field says.
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def replay(self: R) -> R:
        return replace(self, replayed=True)  # type: ignore[call-arg]  # every call's result with an id has `replayed`


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardResult(Result):
    loss: float  # "mean": the call's loss sum over its normaliser; "sum": the raw sum
    num_tokens: int  # target tokens with weight
    num_examples: int
    step: int  # optim_steps applied before this call
    compute_seconds: float = 0.0
    reduction: str = "mean"
    # return_outputs: per datum {logprobs, elementwise_loss}, each of the datum's length. Never journaled, never kept
    # for retries: a replayed answer has none.
    outputs: list[dict[str, list[float]]] | None = None
    metrics: dict[str, float] | None = None  # a custom loss's own (custom/<name>:sum|mean), kept for retries
    replayed: bool = False

    def replay(self) -> ForwardBackwardResult:
        return replace(self, replayed=True, outputs=None)

    def kept(self) -> ForwardBackwardResult:
        """What the journal and the retry cache hold: no per-position outputs."""
        return replace(self, outputs=None)


@dataclass(frozen=True, kw_only=True)
class ForwardResult(Result):
    """forward: the batch's loss (its mean per counted position, as a "mean" reduction) and per-datum outputs."""

    loss: float
    loss_sum: float
    num_tokens: int
    num_examples: int
    step: int | None  # the run's step whose weights ran; None for a base model
    outputs: list[dict[str, list[float]]]  # per datum {logprobs, elementwise_loss}
    compute_seconds: float = 0.0
    metrics: dict[str, float] | None = None  # a custom loss's own (custom/<name>:sum|mean)


@dataclass(frozen=True, kw_only=True)
class RenderDatumsResult(Result):
    datums: list[RenderedDatum]


@dataclass(frozen=True, kw_only=True)
class OptimStepResult(Result):
    step: int
    grad_norm: float
    learning_rate: float
    compute_seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class SampledSequence:
    """One sampled sequence: its tokens, each one's logprob under the unmodified model, its text (a stop string and
    what follows it left out, the stop token's text too), why it ended ("stop", "length", "cancelled") and, when
    asked, each token's top-k [token, logprob] pairs, most likely first."""

    text: str
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    topk_logprobs: list[list[list[float]]] | None = None

    def to_dict(self) -> JSONObject:
        data: JSONObject = asdict(self)
        if data["topk_logprobs"] is None:
            del data["topk_logprobs"]  # asked for none: absent, as it always was on the wire
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SampledSequence:
        # The runtime wrote the lists from this type's; their items are what the fields say.
        return cls(text=get_str(data, "text"), tokens=cast(list[int], get_list(data, "tokens")),
                   logprobs=cast(list[float], get_list(data, "logprobs")), stop_reason=get_str(data, "stop_reason"),
                   topk_logprobs=cast("list[list[list[float]]] | None", data.get("topk_logprobs")))


@dataclass(frozen=True, kw_only=True)
class SampleResult(Result):
    outputs: list[str]  # the first sequence's text of each prompt
    sequences: list[list[SampledSequence]]  # per prompt, per sample
    prompt_tokens: list[list[int]]
    step: int
    compute_seconds: float = 0.0
    # per prompt, per position: the model's logprob of that prompt token (None at 0), when asked
    prompt_logprobs: list[list[float | None]] | None = None
    # per prompt, per position: the top-k [token, logprob] pairs, most likely first (None at 0), when asked
    topk_prompt_logprobs: list[list[list[list[float]] | None]] | None = None
    # per prompt, per position after the first (row i: position i + 1): Sample.prompt_alt_tokens_k [token, logprob]
    # pairs, each token an independent draw at the call's temperature, its logprob the model's at temperature 1
    prompt_alt_tokens: list[list[list[list[float]]]] | None = None
    # prompt tokens whose KV was already in the decode cache (a prefix sent before), not prefilled again: summed over
    # prompts, once per prompt whatever its num_samples
    prompt_cache_hit_tokens: int = 0
    replayed: bool = False
    # With Sample.pieces: the ids asked for (sorted) and each one's text; with messages, the base's EOS ids and the
    # tool-call format its template teaches (what render_chat would have said).
    piece_ids: list[int] | None = None
    pieces: list[str] | None = None
    eos_token_ids: list[int] | None = None
    tool_format: str | None = None

    def to_dict(self) -> JSONObject:
        data = super().to_dict()
        data["sequences"] = [[s.to_dict() for s in row] for row in self.sequences]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SampleResult:
        sequences = [[s if isinstance(s, SampledSequence) else SampledSequence.from_dict(cast(Mapping[str, object], s))
                      for s in cast(list[object], row)] for row in get_list(data, "sequences")]
        return super().from_dict({**data, "sequences": sequences})


@dataclass(frozen=True, kw_only=True)
class SampleChunk(Result):
    """A streamed sample's progress after one decode chunk (sent before its SampleResult, never instead of it)."""

    # per prompt, per sample: {text, tokens, logprobs}, what became settled since the last chunk: the text holds back
    # an incomplete UTF-8 sequence and any end that could start a stop string (gpu_runtime/engine/detokenize.py), the ids
    # those characters' tokens. A sequence that finished sends the rest in the result.
    sequences: list[list[SequenceChunk]]
    prompt_tokens: list[list[int]] | None = None  # on the first chunk sent: the prompts' ids (rendered in the runtime)


@dataclass(frozen=True, kw_only=True)
class CancelResult(Result):
    found: bool  # the call is here: withdrawn or stopped now, or in a pass (it completes); False: answered on arrival
    deferred: bool = False  # a deadline cancel of a call not yet able to run that long: withdrawn when it has been

    def to_dict(self) -> JSONObject:
        data = super().to_dict()
        if not self.deferred:
            del data["deferred"]  # only a deferred deadline says so: the answer every client had before stays as it was
        return data


@dataclass(frozen=True, kw_only=True)
class TokenizerResult(Result):
    """What a client without the tokenizer needs to build token-level inputs and read token-level outputs."""

    name: str  # the base model's name or path the tokenizer loads from
    vocab_size: int  # token ids are 0..vocab_size-1 (the model's embedding rows)
    eos_token_ids: list[int]  # the ids that stop sampling when `stop` is omitted
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None
    directory: str | None = None  # with save: where save_pretrained wrote it, on the runtime's machine


@dataclass(frozen=True, kw_only=True)
class RenderChatResult(Result):
    """render_chat: the rendered prompt's ids (None without messages), the text prompts' ids, each `decode` id's text, the context."""

    prompt_tokens: list[int] | None
    prompts_tokens: list[list[int]] | None  # `prompts`' ids
    pieces: list[str]
    context_length: int  # prompt + generated tokens fit in this many
    eos_token_ids: list[int]
    tool_format: str | None = None  # the call format the chat template teaches (hermes, llama3_json, gpt_oss)


@dataclass(frozen=True, kw_only=True)
class SaveStateResult(Result):
    checkpoint_path: str
    mode: str
    step: int
    size_bytes: int
    compute_seconds: float = 0.0
    hub: HubUpload | None = None  # push_to_hub: where the upload went
    name: str = ""  # unique per run and mode; step-N unless named
    with_optimizer: bool = False  # AdamW's state is in it (load_state can resume it exactly)
    pending_excluded: int = 0  # forward_backward calls whose gradients were pending: not in the checkpoint
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class LoadStateResult(Result):
    checkpoint: str  # signal://<run_id>/<kind>/<name> it came from
    step: int  # the run's step now: the checkpoint's (docs/CHECKPOINTS.md)
    with_optimizer: bool
    pending_dropped: int = 0  # forward_backward calls pending before the load: their gradients are gone
    compute_seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class SaveWeightsForSamplerResult(Result):
    """A sampler snapshot: sample from it with run_id + snapshot=name (docs/SNAPSHOTS.md)."""

    run_id: str
    name: str
    step: int  # the run's step when it was frozen
    named: bool  # named: persisted under the run's directory; unnamed: expires after `expires_in_seconds`
    path: str  # named: its directory (a PEFT adapter); unnamed: "" (memory only)
    size_bytes: int
    expires_in_seconds: float | None = None
    compute_seconds: float = 0.0
    replayed: bool = False


@dataclass(frozen=True, kw_only=True)
class RunDescription(Result):
    """create_run, run_info and load_run: a run as the runtime holds it."""

    run_id: str
    user_id: str
    base_model: str
    quantization: str | None
    base_revision: str | None
    lora: LoraSettings
    target_modules: list[str]
    seed: int
    step: int
    trainable_params: int
    total_params: int
    pending_forward_backward: int
    pending_tokens: int
    path: str
    device: str = "cpu"  # what the run trains on: cpu, cuda:0, …


@dataclass(frozen=True, kw_only=True)
class CloseRunResult(Result):
    run_id: str
    closed: bool  # always True: its memory is freed (its files stay)


@dataclass(frozen=True, kw_only=True)
class DeleteRunResult(Result):
    run_id: str
    deleted: bool  # always True: its files are gone


@dataclass(frozen=True, kw_only=True)
class DeleteCheckpointResult(Result):
    run_id: str
    mode: str
    name: str
    deleted: bool  # always True: its files are gone


@dataclass(frozen=True, kw_only=True)
class ExportCheckpointResult(Result):
    archive_b64: str  # the checkpoint's directory as a base64 .tar.gz


@dataclass(frozen=True, kw_only=True)
class PingResult(Result):
    """The runtime's greeting: who it is, what it holds, and the contract version it speaks."""

    pid: int
    device: str
    dtype: str
    loaded_models: list[str]
    models: list[BaseDescription]
    runs_in_memory: list[str]
    max_batch_size: int
    options: dict[str, float]  # RuntimeOptions.to_dict(): every option is a number
    contract: int


@dataclass(frozen=True, kw_only=True)
class RuntimeStateResult(Result):
    """An operator's view of the runtime (bases, resident and evicted runs, queues, ticks), kept as the document it is:
    read whole by the admin page and GraphQL's `runtime`. On Modal, with no pool, each pool's answer under `pools`."""

    state: JSONObject

    def to_dict(self) -> JSONObject:
        return self.state

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> RuntimeStateResult:
        return cls(state=as_json_object(data, "state"))
