"""The methods both clients share, written once: each builds a `Call` and hands it to `_run`, which the sync client
runs at once and the async client returns as an awaitable (sync_client.py, async_client.py)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rewardsignal.answer_types import Owner, answers
from rewardsignal.artifacts import Artifact, on_own_server
from rewardsignal.calls import (
    BatchItem,
    Call,
    LossFnConfig,
    Message,
    conversations,
    drop_none,
    enum_value,
    graphql_batch,
    primitive,
)
from rewardsignal.pipelining import Item, Sequencer, split
from rewardsignal.results import (
    ApiKeyResult,
    CreatedApiKeyResult,
    ForwardResult,
    Limits,
    Result,
    SampleResult,
    TokenizerResult,
    UsageResult,
    UserResult,
)
from rewardsignal.runs import RunBase, answers_run, answers_runs
from rewardsignal.transport import DEFAULT_BASE_URL, auth_headers


class ClientBase(Owner):
    """Everything but the transport."""

    _run_type: ClassVar[type[RunBase]]  # what a run's answer becomes on this client: Run or AsyncRun

    def __init__(self, api_key: str | None, base_url: str | None, max_attempts: int, retry_backoff: float) -> None:
        self.api_key = api_key or os.environ.get("SIGNAL_API_KEY")
        self.base_url = (base_url or os.environ.get("SIGNAL_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.url = f"{self.base_url}/graphql"
        self.max_attempts = max(1, max_attempts)
        self.retry_backoff = retry_backoff
        self._order = Sequencer()  # this client's calls on each run, numbered as they are made
        self._limits: Limits | None = None  # the server's, once asked (`limits`)

    def _split(self, batch: Sequence[Item]) -> list[Sequence[Item]]:
        """`batch` in parts of at most the server's max_batch_size (known: `_max_batch_size`), in order."""
        return split(batch, self._max_batch_size())

    def _max_batch_size(self) -> int | None:
        return self._limits["max_batch_size"] if self._limits else None

    def _headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    # ---- the calls ----------------------------------------------------------------------

    def list_models(self, detailed: bool = False) -> Any:  # typed on each client, by `detailed`
        """Names of the base models, or with `detailed=True` their descriptions: gpu, contextLength, framework,
        quantizationAllowed, quantized, available, estimatedMemoryGb, ..."""
        wrap = None if detailed else (lambda models: [model["name"] for model in models])
        return self._run(Call("ListModels", {}, "models", wrap))

    @answers(UserResult)
    def me(self) -> Any:
        return self._run(Call("Me", {}, "me"))

    @answers(UsageResult)
    def usage(self, days: int | None = None, user_id: str | None = None) -> Any:
        """Compute seconds, GPU-seconds, cost (credits) and tokens trained and sampled over the last `days` days (the
        server's default: 30), in all, by day and by run; `user_id`: another user's (admins only)."""
        return self._run(Call("Usage", drop_none({"days": days, "userId": user_id}), "usage"))

    @answers(SampleResult)
    def sample_base(self, prompts: str | list[str] | None = None, base_model: str | None = None,
                    max_tokens: int | None = None, temperature: float | None = None, seed: int | None = None,
                    num_samples: int | None = None, prompt_tokens: list[list[int]] | None = None,
                    store: bool | None = None,
                    messages: Sequence[Message] | Sequence[Sequence[Message]] | None = None) -> Any:
        """Generate from a base model alone (no run; the server's default model when None), billed to you; `messages`
        as Run.sample takes them (a chat or a list of chats, through the base's chat template)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        variables = drop_none({"prompts": prompts, "promptTokens": prompt_tokens, "messages": conversations(messages),
                                "baseModel": base_model,
                                "maxTokens": max_tokens, "temperature": temperature, "seed": seed,
                                "numSamples": num_samples, "store": store})
        return self._run(primitive("Sample", variables, "sample"))

    @answers(ForwardResult)
    def forward(self, batch: Sequence[BatchItem], base_model: str, loss_fn: str | None = None,
                loss_fn_config: LossFnConfig | None = None) -> Any:
        """The loss and per-position `logprobs` of `batch` on a base model alone (no run, no adapter): the
        reference a DPO or KL term needs. `run.forward(...)` runs on a run's weights."""
        variables = drop_none({"batch": graphql_batch(batch), "baseModel": base_model, "lossFn": enum_value(loss_fn),
                                "lossFnConfig": loss_fn_config})
        return self._run(primitive("Forward", variables, "forward"))

    @answers_run
    def create_run(
        self, base_model: str | None = None, lora_r: int | None = None, lora_alpha: float | None = None,
        learning_rate: float | None = None, lora_dropout: float | None = None,
        lora_target_modules: list[str] | None = None, gpu_config: str | None = None, seed: int | None = None,
        weight_decay: float | None = None, grad_clip_norm: float | None = None, quantization: str | None = None,
        train_attn: bool | None = None, train_mlp: bool | None = None, train_unembed: bool | None = None,
        from_checkpoint: Any = None, with_optimizer: bool | None = None, name: str | None = None,
        tags: list[str] | None = None, note: str | None = None,
    ) -> Any:
        """A new run; settings left as None take the server's defaults (LoRA r=32, alpha=2r, AdamW lr 1e-4).

        The LoRA targets: lora_target_modules (layer names), or Tinker's switches train_attn, train_mlp (gate, up,
        down) and train_unembed (lm_head), not both; the default is attention only.
        quantization: "8bit" or "4bit" loads the base through bitsandbytes (4-bit is QLoRA's NF4), on one GPU.
        from_checkpoint: an `Artifact` or its `path` (signal://<run_id>/<mode>/<name>, one of your runs'): the run
        starts there, inheriting its base model, seed, step and LoRA settings (any given too must agree);
        with_optimizer (default true) takes its AdamW state as well, so training resumes exactly.
        name (at most 200 characters, not unique; default: the base model's short name and the UTC minute), tags
        (at most 20, of 40 characters) and note (10,000 characters) label the run; `Run.update` changes them.
        """
        spec = drop_none({
            "baseModel": base_model, "loraR": lora_r, "loraAlpha": lora_alpha, "learningRate": learning_rate,
            "loraDropout": lora_dropout, "loraTargetModules": lora_target_modules, "gpuConfig": gpu_config,
            "seed": seed, "weightDecay": weight_decay, "gradClipNorm": grad_clip_norm, "quantization": quantization,
            "trainAttn": train_attn, "trainMlp": train_mlp, "trainUnembed": train_unembed,
            "fromCheckpoint": from_checkpoint["path"] if isinstance(from_checkpoint, dict) else from_checkpoint,
            "withOptimizer": with_optimizer, "name": name, "tags": tags, "note": note,
        })
        return self._run(Call("CreateRun", {"input": spec}, "createRun", self._wrap_run))

    @answers_run
    def get_run(self, run_id: str) -> Any:
        return self._run(Call("GetRun", {"id": run_id}, "run", self._wrap_run))

    @answers_runs
    def list_runs(self, limit: int = 50, search: str = "", sort: str = "newest", archived: bool | None = False) -> Any:
        """Your runs in `sort`'s order (newest, oldest, name, activity, step); with `search`, those whose name,
        base model or a tag contains it (any case). archived: False those not archived, True the archived ones,
        None both."""
        variables = {"limit": limit, "search": search, "sort": sort.upper(), "archived": archived}
        return self._run(Call("ListRuns", variables, "runs", lambda runs: [self._wrap_run(r) for r in runs]))

    @answers(TokenizerResult)
    def tokenizer(self, base_model: str | None = None, run_id: str | None = None) -> Any:
        """A base model's tokenizer (a catalogue name; default: the server's model), or a run's base's: name,
        vocab_size, eos_token_ids, bos_token_id, pad_token_id, chat_template."""
        return self._run(Call("Tokenizer", drop_none({"baseModel": base_model, "runId": run_id}), "tokenizer"))

    @answers(CreatedApiKeyResult)
    def create_api_key(self, name: str = "") -> Any:
        return self._run(Call("CreateApiKey", {"name": name}, "createApiKey"))

    @answers(list[ApiKeyResult])
    def list_api_keys(self) -> Any:
        return self._run(Call("ApiKeys", {}, "apiKeys"))

    @answers(ApiKeyResult)
    def revoke_api_key(self, key_id: str) -> Any:
        return self._run(Call("RevokeApiKey", {"id": key_id}, "revokeApiKey"))

    def _wrap_run(self, info: Result) -> Any:
        return self._run_type(self, info)

    def _wrap_artifact(self, info: Result) -> Artifact:
        return Artifact(info, self)

    def _download_url(self, url: str) -> str:
        return on_own_server(self.base_url, url)

    def _run(self, call: Call) -> Any:  # pragma: no cover - each transport defines it
        raise NotImplementedError

    def _run_all(self, calls: list[Call], combine: Callable[[list[Any]], Any]) -> Any:  # pragma: no cover - likewise
        """Consecutive calls (a split batch), numbered now, answered as `combine` of their answers."""
        raise NotImplementedError

    def _download(self, url: str, directory: str | os.PathLike[str]) -> Any:  # pragma: no cover - likewise
        raise NotImplementedError
