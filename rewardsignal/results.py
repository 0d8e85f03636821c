"""Results: Mappings with snake_case keys that also allow attribute access (`r["loss"]` and `r.loss`).

Each training call answers with its own class (ForwardBackwardResult, OptimStepResult, ...), whose annotations
name its fields for type checkers and editors; all of them are `Result`, a dict subclass, so `r["loss"]`, `get`,
`keys`, `items`, `in`, `dict(r)`, equality with a dict and `json.dumps(r)` keep working as they always have.
"""

from __future__ import annotations

import re
from typing import Any

_CAMEL = re.compile(r"(?<=[a-z0-9])([A-Z])")
# JSON scalars pass through untouched: their keys are the user's or the engine's, not GraphQL fields.
_OPAQUE = {"optimizer", "params"}
# GraphQL Int is 32-bit, so counts travel as Float; hand users the ints they are.
_INTEGRAL = {"trainable_params", "total_params", "size_bytes", "parameters"}


class Result(dict[str, Any]):
    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        if type(self) is Result:
            return dict.__repr__(self)
        return f"{type(self).__name__}({', '.join(f'{key}={value!r}' for key, value in self.items())})"


# The typed answers. Annotations only: the values live in the mapping, read by __getattr__ (a class attribute
# would shadow it), so an answer that lacks a field (a document that did not select it) raises AttributeError.
class ForwardBackwardResult(Result):
    loss: float
    num_tokens: int
    num_examples: int
    step: int  # the step whose gradients this call added to (the next optim_step makes step + 1)
    reduction: str
    outputs: list[Result]  # with return_outputs only: per datum, logprobs and elementwise_loss


class ForwardResult(Result):
    loss: float  # the mean per counted position
    loss_sum: float
    num_tokens: int
    num_examples: int
    step: int | None  # the run's step whose weights ran; None for a base model
    outputs: list[Result]  # per datum: logprobs and elementwise_loss


class Datum(Result):
    model_input: list[int]
    loss_fn_inputs: Result  # target_tokens, and weights, advantages, logprobs, ... where set


class OptimStepResult(Result):
    step: int
    grad_norm: float
    learning_rate: float


class SampleResult(Result):
    outputs: list[str]  # per prompt: its first sample's text
    sequences: list[list[Result]]  # per prompt, per sample: text, tokens, logprobs, stop_reason
    prompt_tokens: list[list[int]]
    step: int
    prompt_logprobs: list[list[float | None]] | None
    topk_prompt_logprobs: list[list[list[Result] | None]] | None  # {token, logprob} pairs
    prompt_cache_hit_tokens: int  # prompt tokens found in the decode cache, not prefilled again


class LoadStateResult(Result):
    checkpoint: str
    step: int
    with_optimizer: bool
    pending_dropped: int


class SamplerSnapshotResult(Result):
    run_id: str
    name: str
    step: int
    named: bool
    expires_in_seconds: float | None


class TokenizerResult(Result):
    name: str
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None


class CheckpointResult(Result):
    id: str
    step: int
    mode: str
    name: str
    path: str  # signal://<run_id>/<mode>/<name>: what load_state and create_run(from_checkpoint=...) take
    checkpoint_path: str
    size_bytes: int
    hub_url: str | None
    created_at: str
    download_url: str
    with_optimizer: bool  # AdamW's state is in it: load_state(with_optimizer=True) resumes the run exactly
    pending_excluded: int  # forward_backward calls whose pending gradients it left out


class Limits(Result):
    max_batch_size: int  # most items one forward_backward carries; the SDK splits larger batches


class ModelInfo(Result):
    name: str
    family: str
    parameters: int
    gpu: str
    offline: bool
    description: str
    context_length: int | None
    framework: str
    quantization_allowed: bool
    quantized: str | None
    available: bool
    unavailable_reason: str | None
    estimated_memory_gb: float


class UserResult(Result):
    id: str
    email: str
    name: str
    is_admin: bool
    created_at: str


class UsageResult(Result):
    """`usage`: the window's total, by day (newest first) and by run (most compute first); each line has key, label,
    calls, compute_seconds, gpu_seconds, credits, tokens_trained, tokens_sampled, tokens_prompted and tokens_cached
    (of the prompt tokens, those found in the decode cache rather than prefilled again)."""

    user_id: str
    days: int
    since: str
    total: Result
    by_day: list[Result]
    by_run: list[Result]


class ApiKeyResult(Result):
    id: str
    name: str
    prefix: str
    created_at: str
    last_used_at: str | None
    revoked_at: str | None
    revoked: bool


class CreatedApiKeyResult(Result):
    secret: str  # shown this once
    api_key: Result  # the key's fields, as ApiKeyResult's


# The class each GraphQL field's answer becomes (calls.Call.field), or each item of a list answer; others stay
# plain Results.
TYPED: dict[str, type[Result]] = {
    "forwardBackward": ForwardBackwardResult,
    "forward": ForwardResult,
    "renderDatums": Datum,
    "optimStep": OptimStepResult,
    "sample": SampleResult,
    "loadState": LoadStateResult,
    "saveWeightsForSampler": SamplerSnapshotResult,
    "tokenizer": TokenizerResult,
    "limits": Limits,
    "models": ModelInfo,
    "me": UserResult,
    "usage": UsageResult,
    "apiKeys": ApiKeyResult,
    "revokeApiKey": ApiKeyResult,
    "createApiKey": CreatedApiKeyResult,
}


def snake(name: str) -> str:
    return _CAMEL.sub(r"_\1", name).lower()


def convert(value: Any, cls: type[Result] = Result) -> Any:
    """GraphQL's answer with snake_case keys, counts as ints; the top-level object (or each object of a top-level
    list) becomes `cls`."""
    if isinstance(value, list):
        return [convert(item, cls) for item in value]
    if isinstance(value, dict):
        out = cls()
        for key, item in value.items():
            name = snake(key)
            if name in _OPAQUE:
                out[name] = item
            elif name in _INTEGRAL and isinstance(item, float):
                out[name] = int(item)
            else:
                out[name] = convert(item)
        return out
    return value


def combine_forward_backward(parts: list[ForwardBackwardResult], reduction: str = "mean") -> ForwardBackwardResult:
    """One answer for a batch the SDK split into consecutive calls: with `mean` the loss weighted by each part's
    tokens (each part's loss is its own mean per target token), with `sum` the losses added; counts summed,
    per-datum outputs in batch order."""
    if len(parts) == 1:
        return parts[0]
    tokens = sum(int(part["num_tokens"]) for part in parts)
    combined = ForwardBackwardResult(parts[0])
    if "loss" in combined and reduction == "sum":
        combined["loss"] = sum(float(part["loss"]) for part in parts)
    elif "loss" in combined:
        combined["loss"] = (sum(float(p["loss"]) * int(p["num_tokens"]) for p in parts) / tokens if tokens
                            else sum(float(p["loss"]) for p in parts) / len(parts))
    combined["num_tokens"] = tokens
    if "num_examples" in combined:
        combined["num_examples"] = sum(int(part["num_examples"]) for part in parts)
    if "outputs" in combined:
        combined["outputs"] = [output for part in parts for output in part.get("outputs") or []]
    return combined
