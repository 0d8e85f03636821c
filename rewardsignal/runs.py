"""A training run's handle: RunBase's methods written once, Run (blocking, with pipelined `*_async` futures) and
AsyncRun (awaitable) on top. A run reaches its client only through `RunClient`, so the clients import this module
and never the other way round."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from rewardsignal.answer_types import Awaiting, Blocking, Owner, answers
from rewardsignal.artifacts import Artifact
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
from rewardsignal.pipelining import Item
from rewardsignal.results import (
    Datum,
    ForwardBackwardResult,
    ForwardResult,
    LoadStateResult,
    OptimStepResult,
    Result,
    SampleResult,
    SamplerSnapshotResult,
    TokenizerResult,
    combine_forward_backward,
)

if TYPE_CHECKING:
    from typing import Concatenate

    from rewardsignal.answer_types import Answers, P

    # A method answering a run: Run on the blocking owners, AsyncRun on the awaiting ones (answer_types.py).
    def answers_run(method: Callable[Concatenate[Any, P], Any]) -> Answers[P, Run, AsyncRun]: ...
    def answers_runs(method: Callable[Concatenate[Any, P], Any]) -> Answers[P, list[Run], list[AsyncRun]]: ...
else:
    def answers_run(method):
        return method

    answers_runs = answers_run


class RunClient(Protocol):
    """What a run needs of its client (ClientBase has it): a call run, consecutive calls run together, a batch
    split to the server's size, and a checkpoint's answer wrapped."""

    def _run(self, call: Call) -> Any: ...
    def _run_all(self, calls: list[Call], combine: Callable[[list[Any]], Any]) -> Any: ...
    def _split(self, batch: Sequence[Item]) -> list[Sequence[Item]]: ...
    def _wrap_artifact(self, info: Result) -> Artifact: ...


class PipelinedClient(RunClient, Protocol):
    """The sync client as Run sees it: also a Run method made now and answered as a future."""

    def _pipelined(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]: ...


class RunBase(Owner):
    """A training run. `info` holds its fields as last fetched (`refresh()` fetches them again)."""

    def __init__(self, client: RunClient, info: Result) -> None:
        self._client = client
        self.info = info
        self.id: str = info["id"]

    def __repr__(self) -> str:
        return f"<Run {self.id} {self.info.get('name')!r} {self.info.get('base_model')} step={self.info.get('step')}>"

    @property
    def step(self) -> int:
        return int(self.info["step"])

    @property
    def name(self) -> str:
        return str(self.info.get("name") or "")

    @answers_run
    def update(self, name: str | None = None, tags: list[str] | None = None, note: str | None = None) -> Any:
        """Rename the run, replace its tags or its note; what is left as None keeps its value."""
        variables = drop_none({"runId": self.id, "name": name, "tags": tags, "note": note})
        return self._client._run(Call("UpdateRun", variables, "updateRun", self._store))

    @answers_run
    def archive(self) -> Any:
        """Hide the run from `list_runs` and refuse its training and sampling (FAILED_PRECONDITION) until
        `unarchive`; its files, checkpoints and history are kept."""
        return self._client._run(Call("ArchiveRun", {"runId": self.id}, "archiveRun", self._store))

    @answers_run
    def unarchive(self) -> Any:
        return self._client._run(Call("UnarchiveRun", {"runId": self.id}, "unarchiveRun", self._store))

    @answers(ForwardBackwardResult)
    def forward_backward(self, batch: Sequence[BatchItem], loss_fn: str | None = None,
                         loss_fn_config: LossFnConfig | None = None, reduction: str | None = None,
                         return_outputs: bool = False) -> Any:
        """Loss and gradients for `batch`; gradients add up until `optim_step`. Unset: the server's
        default loss (cross_entropy) and reduction ("mean"; "sum" is Tinker's: one per step). With
        `return_outputs`, the result's `outputs` holds each datum's per-position `logprobs` and
        `elementwise_loss` (a retried call's answer has none). A batch over the server's max_batch_size goes as
        consecutive calls with one answer (`mean` normalises across them)."""
        variables = drop_none({"runId": self.id, "lossFn": enum_value(loss_fn), "lossFnConfig": loss_fn_config,
                                "reduction": enum_value(reduction), "withOutputs": return_outputs or None})
        calls = [primitive("ForwardBackward", {**variables, "batch": graphql_batch(part)}, "forwardBackward")
                 for part in self._client._split(batch)]
        return self._client._run_all(calls, functools.partial(combine_forward_backward, reduction=reduction or "mean"))

    @answers(ForwardResult)
    def forward(self, batch: Sequence[BatchItem], loss_fn: str | None = None,
                loss_fn_config: LossFnConfig | None = None, snapshot: str | None = None) -> Any:
        """The loss and each datum's per-position `logprobs` on the run's current weights (or with `snapshot`, on
        a snapshot of it: it waits for none of the run's training), with no backward: no gradient, step or
        dropout counter changes."""
        variables = drop_none({"runId": self.id, "batch": graphql_batch(batch), "lossFn": enum_value(loss_fn),
                                "lossFnConfig": loss_fn_config, "snapshot": snapshot})
        return self._client._run(primitive("Forward", variables, "forward"))

    @answers(list[Datum])
    def render_datums(self, batch: Sequence[BatchItem], loss_fn: str | None = None) -> Any:
        """The token-level datums ({model_input, loss_fn_inputs}) the server builds for `batch` on this run's model."""
        variables = drop_none({"runId": self.id, "batch": graphql_batch(batch), "lossFn": enum_value(loss_fn)})
        return self._client._run(Call("RenderDatums", variables, "renderDatums"))

    @answers(OptimStepResult)
    def optim_step(self, learning_rate: float | None = None, beta1: float | None = None, beta2: float | None = None,
                   eps: float | None = None, weight_decay: float | None = None,
                   grad_clip_norm: float | None = None) -> Any:
        """Apply the accumulated gradients (AdamW); unset settings use the run's defaults."""
        adam = drop_none({"learningRate": learning_rate, "beta1": beta1, "beta2": beta2, "eps": eps,
                           "weightDecay": weight_decay, "gradClipNorm": grad_clip_norm})
        return self._client._run(primitive("OptimStep", {"runId": self.id, "adam": adam or None}, "optimStep"))

    @answers(SampleResult)
    def sample(self, prompts: str | list[str] | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               stop: str | list[str] | list[int] | None = None, num_samples: int | None = None,
               seed: int | None = None, prompt_tokens: list[list[int]] | None = None,
               prompt_logprobs: bool | None = None, topk_prompt_logprobs: int | None = None,
               topk_sample_logprobs: int | None = None, store: bool | None = None,
               snapshot: str | None = None,
               messages: Sequence[Message] | Sequence[Sequence[Message]] | None = None) -> Any:
        """Generate from the run's current weights, or with `snapshot` from a snapshot of it (save_weights_for_sampler:
        it waits for none of the run's training); settings left unset take the server's defaults (the engine
        contract's: 64 tokens, temperature 1, top_p 1, no top_k, one sample).

        Give `prompts` (text), `prompt_tokens` (token ids) or `messages`: a chat, `[{"role": "user", "content":
        …}]`, or a list of chats, each rendered with the base's chat template and the assistant's turn opened (as
        /v1's chat completions are). `stop`: strings or token ids; omitted, EOS stops;
        `[]`, nothing but max_tokens stops; a non-empty list stops there and at EOS. Each sequence's `logprobs`
        are the unmodified model's (temperature 1), what a teacher-forced forward returns. `store` keeps the
        samples in the run's history (default: yes for current weights, no for a snapshot)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(stop, str):
            stop = [stop]
        tokens = isinstance(stop, list) and bool(stop) and all(isinstance(s, int) for s in stop)
        variables = drop_none({"runId": self.id, "prompts": prompts, "promptTokens": prompt_tokens,
                                "messages": conversations(messages),
                                "maxTokens": max_tokens, "temperature": temperature, "topP": top_p, "topK": top_k,
                                "stop": None if tokens else stop, "stopTokens": stop if tokens else None,
                                "numSamples": num_samples, "seed": seed, "promptLogprobs": prompt_logprobs,
                                "topkPromptLogprobs": topk_prompt_logprobs,
                                "topkSampleLogprobs": topk_sample_logprobs, "store": store,
                                "snapshot": snapshot})
        return self._client._run(primitive("Sample", variables, "sample"))

    @answers(TokenizerResult)
    def tokenizer(self) -> Any:
        """The tokenizer of this run's base: name, vocab_size, eos_token_ids, bos_token_id, pad_token_id,
        chat_template."""
        return self._client._run(Call("Tokenizer", {"runId": self.id}, "tokenizer"))

    @answers(SamplerSnapshotResult)
    def save_weights_for_sampler(self, name: str | None = None) -> Any:
        """Freeze the run's current weights (after every call sent before this one) to sample from while it trains
        on: {"name", "step", "named", "expires_in_seconds"}. Named snapshots are kept; unnamed ones expire
        (docs/SNAPSHOTS.md)."""
        variables = drop_none({"runId": self.id, "name": name})
        return self._client._run(primitive("SaveWeightsForSampler", variables, "saveWeightsForSampler"))

    @answers(list[Artifact])
    def snapshots(self) -> Any:
        wrap = self._client._wrap_artifact
        return self._client._run(Call("RunSnapshots", {"id": self.id}, "run",
                                      lambda run: [wrap(c) for c in run["snapshots"]]))

    @answers(Artifact)
    def save_state(self, mode: str = "adapter", push_to_hub: bool = False, hub_model_id: str | None = None,
                   hf_token: str | None = None, name: str | None = None,
                   with_optimizer: bool | None = None) -> Any:
        """Export the run (an `Artifact`: `.download(dir)` fetches its files; its `path` is what `load_state` and
        `create_run(from_checkpoint=…)` take). `name` is unique per run and mode (default step-N); `with_optimizer`
        keeps AdamW's state (default: for mode "state" only). With `push_to_hub`, the server also uploads it to
        `hub_model_id` (a private repo) with `hf_token` (default: env HF_TOKEN), used for that upload only."""
        if push_to_hub and hf_token is None:
            hf_token = os.environ.get("HF_TOKEN")
        variables = drop_none({"runId": self.id, "mode": mode.upper(), "name": name, "withOptimizer": with_optimizer,
                                "pushToHub": push_to_hub, "hubModelId": hub_model_id,
                                "hfToken": hf_token if push_to_hub else None})
        call = primitive("SaveState", variables, "saveState")
        call.wrap = self._client._wrap_artifact
        return self._client._run(call)

    @answers(LoadStateResult)
    def load_state(self, checkpoint: Any, with_optimizer: bool = True) -> Any:
        """Load a checkpoint into this run: an `Artifact`, its `path` (signal://…, one of your runs'), or the name
        of this run's "state" checkpoint. Its weights, with `with_optimizer` its AdamW state, and its step."""
        path = checkpoint["path"] if isinstance(checkpoint, dict) else checkpoint
        variables = {"runId": self.id, "checkpoint": path, "withOptimizer": with_optimizer}
        return self._client._run(primitive("LoadState", variables, "loadState"))

    @answers(bool)
    def delete_checkpoint(self, checkpoint: Any) -> Any:
        """Delete a checkpoint or sampler snapshot of this run (an `Artifact`, or its id): its files and its row."""
        checkpoint_id = checkpoint["id"] if isinstance(checkpoint, dict) else checkpoint
        return self._client._run(Call("DeleteCheckpoint", {"runId": self.id, "checkpointId": str(checkpoint_id)},
                                      "deleteCheckpoint"))

    @answers(int)
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> Any:
        """Record your own numbers for a step (a DPO loss, a reward): stored with the run's metrics as
        `user:<name>`, drawn on the run's page. `step` defaults to the run's current step; answers the step."""
        variables = drop_none({"runId": self.id, "metrics": metrics, "step": step})
        return self._client._run(Call("LogMetrics", variables, "logMetrics"))

    @answers(list[Result])
    def metrics(self, name: str | None = None, limit: int = 1000) -> Any:
        variables = drop_none({"id": self.id, "name": name, "limit": limit})
        return self._client._run(Call("RunMetrics", variables, "run", lambda run: run["metrics"]))

    @answers(list[Result])
    def samples(self, limit: int = 100) -> Any:
        return self._client._run(Call("RunSamples", {"id": self.id, "limit": limit}, "run", lambda r: r["samples"]))

    @answers(list[Artifact])
    def checkpoints(self) -> Any:
        wrap = self._client._wrap_artifact
        return self._client._run(Call("RunCheckpoints", {"id": self.id}, "run",
                                      lambda run: [wrap(c) for c in run["checkpoints"]]))

    @answers(bool)
    def delete(self) -> Any:
        return self._client._run(Call("DeleteRun", {"runId": self.id}, "deleteRun"))

    def _store(self, info: Result) -> Any:
        self.info = info
        return self


class Run(RunBase, Blocking):
    _client: PipelinedClient

    def refresh(self) -> Any:
        refreshed: Run = self._client._run(Call("GetRun", {"id": self.id}, "run", self._store))
        return refreshed

    # Pipelined: the same calls, numbered when made and answered as futures (concurrent.futures.Future), so the
    # next can be sent before this one's answer; the server applies them in the order they were made.
    def forward_backward_async(self, *args: Any, **kwargs: Any) -> Future[ForwardBackwardResult]:
        return self._client._pipelined(self.forward_backward, *args, **kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[ForwardResult]:
        return self._client._pipelined(self.forward, *args, **kwargs)

    def optim_step_async(self, *args: Any, **kwargs: Any) -> Future[OptimStepResult]:
        return self._client._pipelined(self.optim_step, *args, **kwargs)

    def sample_async(self, *args: Any, **kwargs: Any) -> Future[SampleResult]:
        return self._client._pipelined(self.sample, *args, **kwargs)

    def save_state_async(self, *args: Any, **kwargs: Any) -> Future[Artifact]:
        return self._client._pipelined(self.save_state, *args, **kwargs)


class AsyncRun(RunBase, Awaiting):
    async def refresh(self) -> AsyncRun:
        refreshed: AsyncRun = await self._client._run(Call("GetRun", {"id": self.id}, "run", self._store))
        return refreshed
