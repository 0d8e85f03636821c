"""SignalClient and AsyncSignalClient: the same surface, one blocking and one awaitable.

Each public method builds a `Call` (operation, variables, the field to return, how to wrap it);
the sync client runs it at once, the async client returns an awaitable that does.

The four training primitives carry a fresh `requestId` each. When the connection drops or the server
answers WORKER_FAILED, the client sends the same call again, with the same id, a few times: the server
applies a call once per id and answers a retry with the first attempt's result.

Pipelining: each primitive on a run is numbered when it is made (`seq` 1, 2, ... with a `session` id per client,
run and pipeline), and the server applies a session's calls on a run in that order whatever order they arrive in
(docs/ORDERING.md). So `Run.forward_backward_async(...)` and `Run.optim_step_async()` (futures), or
two AsyncRun calls gathered, can be in flight together and still apply as written. A batch over the server's
`limits.maxBatchSize` is sent as consecutive calls and answered as one result.
"""

from __future__ import annotations

import asyncio
import functools
import os
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Generic, Literal, ParamSpec, TypeVar, overload
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from rewardsignal.errors import (
    AuthenticationError,
    NotFoundError,
    PayloadTooLargeError,
    ResourceExhaustedError,
    ServerError,
    SignalAPIError,
    TransportError,
    UnavailableError,
    WorkerFailedError,
    error_for_code,
    error_from_graphql,
)
from rewardsignal.operations import document
from rewardsignal.results import (
    TYPED,
    ApiKeyResult,
    CheckpointResult,
    CreatedApiKeyResult,
    Datum,
    ForwardBackwardResult,
    ForwardResult,
    Limits,
    LoadStateResult,
    ModelInfo,
    OptimStepResult,
    Result,
    SampleResult,
    SamplerSnapshotResult,
    TokenizerResult,
    UsageResult,
    UserResult,
    combine_forward_backward,
    convert,
)

DEFAULT_BASE_URL = "http://localhost:8000"
DEFAULT_TIMEOUT = 600.0  # a forward_backward on a large model can take minutes
DEFAULT_MAX_ATTEMPTS = 3  # tries of a primitive whose connection dropped or whose worker failed
DEFAULT_RETRY_BACKOFF = 0.5  # seconds before the second try; doubled before each further one
UNAVAILABLE_BUDGET_S = 60.0  # an UNAVAILABLE (locked database) or too-many-calls answer is retried this long in all
MAX_RETRY_DELAY_S = 8.0
# Checkpoint downloads ask for the plain tar: model weights barely compress, and the server can then say its length.
ARCHIVE_ACCEPT = {"Accept": "application/x-tar"}
# The connection dropped, or never came up: the call may or may not have reached the server.
RETRYABLE_TRANSPORT_ERRORS = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)
# What a call's attempt may end in that `_retry_delay` may send again; it decides which (a full disk: never).
MAYBE_RETRIED = (httpx.HTTPError, WorkerFailedError, UnavailableError, ResourceExhaustedError)
DEFAULT_MAX_IN_FLIGHT = 32  # the sync client's threads for pipelined calls (its futures); more queue, in order
# Answers that hand out runs: the async client learns the server's limits with them, so that an AsyncRun's
# calls are numbered (and a large batch split) when they are made, without a request of their own first.
_RUN_OPERATIONS = {"CreateRun", "GetRun", "ListRuns"}
# A sample or forward on a snapshot or checkpoint is ordered after the call that made its source and nothing else
# (issue 15 §4): it never joins its run's queue, so it takes no number there (a number nobody admits is a gap).
_OFF_THE_QUEUE = {"Sample", "Forward"}


P = ParamSpec("P")
S = TypeVar("S")  # a method's answer on the sync client (and Run)
A = TypeVar("A")  # the same method's answer, awaited, on the async client (and AsyncRun)

if TYPE_CHECKING:
    from typing import Concatenate, Self

    class _Answers(Generic[P, S, A]):
        """For type checkers only: a method written once on the shared base answers S on SignalClient and Run,
        and a coroutine of A on AsyncSignalClient and AsyncRun (it returns `_run`'s awaitable there)."""

        def __init__(self, method: Callable[Concatenate[Any, P], Any]) -> None: ...

        @overload
        def __get__(self, owner: None, cls: type) -> Self: ...
        @overload
        def __get__(self, owner: SignalClient | Run, cls: type) -> Callable[P, S]: ...
        @overload
        def __get__(self, owner: AsyncSignalClient | AsyncRun, cls: type) -> Callable[P, Coroutine[Any, Any, A]]: ...
        @overload
        def __get__(self, owner: _ClientBase | _RunBase, cls: type) -> Callable[P, Any]: ...
        def __get__(self, owner: object, cls: type) -> Any: ...

    def _answers(answer: type[S]) -> Callable[[Callable[Concatenate[Any, P], Any]], _Answers[P, S, S]]: ...
    def _answers_run(method: Callable[Concatenate[Any, P], Any]) -> _Answers[P, Run, AsyncRun]: ...
    def _answers_runs(method: Callable[Concatenate[Any, P], Any]) -> _Answers[P, list[Run], list[AsyncRun]]: ...
else:
    # At run time each method is itself: the clients' behaviour does not depend on its typing.
    def _answers(answer):
        return lambda method: method

    def _answers_run(method):
        return method

    _answers_runs = _answers_run


@dataclass
class _Pipeline:
    """A run's calls from one client that overlap in time: one `session`, numbered 1, 2, ..."""

    session: str
    seq: int = 0
    unanswered: int = 0


@dataclass
class Call:
    operation: str
    variables: dict[str, Any]
    field: str
    wrap: Callable[[Any], Any] | None = None
    retry: bool = False  # safe to send again: it carries a requestId


def _primitive(operation: str, variables: dict[str, Any], field: str) -> Call:
    """A training primitive, with the idempotency id that makes retrying it safe."""
    return Call(operation, {**variables, "requestId": str(uuid.uuid4())}, field, retry=True)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _batch(batch: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as GraphQL's BatchItem: Tinker's datum keys (model_input, loss_fn_inputs.target_tokens, …) in camelCase;
    Signal's own keys are single words already."""
    def item(value: dict[str, Any]) -> dict[str, Any]:
        out = {_camel(k): v for k, v in value.items()}
        for nested in ("lossFnInputs", "packed"):
            if isinstance(out.get(nested), dict):
                out[nested] = {_camel(k): v for k, v in out[nested].items()}
        return out

    return [item(value) if isinstance(value, dict) else value for value in batch]


@cache
def _takes_seq(operation: str) -> bool:
    """Whether the operation's document passes `$seq` on: a number the server never sees would be a gap that the
    calls after it wait on."""
    return "$seq" in document(operation)


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


class _ClientBase:
    """Everything but the transport."""

    def __init__(self, api_key: str | None, base_url: str | None, max_attempts: int, retry_backoff: float) -> None:
        self.api_key = api_key or os.environ.get("SIGNAL_API_KEY")
        self.base_url = (base_url or os.environ.get("SIGNAL_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.url = f"{self.base_url}/graphql"
        self.max_attempts = max(1, max_attempts)
        self.retry_backoff = retry_backoff
        # The ordering of this client's calls on each run (docs/ORDERING.md): per run, the session of the pipeline
        # now going (calls in flight), its last number, and how many of its calls are unanswered.
        self._pipelines: dict[str, _Pipeline] = {}
        self._seq_lock = threading.Lock()  # the sync client's futures number calls from any thread
        self._limits: Limits | None = None  # the server's, once asked (`limits`)

    def _number(self, call: Call, pipelined: bool = True) -> Call:
        """Give a primitive on a run its place in this client's order on that run, now, as it is made: a retry
        sends the same Call (same requestId, same seq). A blocking call (`pipelined=False`: the sync client's
        plain methods) is numbered only behind pipelined calls still in flight on the run: blocking calls made
        at once from several threads have no order of their own to keep."""
        run_id = call.variables.get("runId")
        if call.operation in _OFF_THE_QUEUE and any(call.variables.get(name) for name in ("snapshot", "checkpoint")):
            return call  # reads frozen weights: not queued on the run, so not in its order (docs/ORDERING.md)
        if call.retry and run_id is not None and "seq" not in call.variables and _takes_seq(call.operation):
            with self._seq_lock:
                pipeline = self._pipelines.get(run_id)
                if not pipelined and (pipeline is None or not pipeline.unanswered):
                    return call
                if pipeline is None or not pipeline.unanswered:
                    # Nothing in flight: no earlier call to wait for, so a new session, from 1. A server process
                    # that never saw this run's earlier calls (another worker, a restart) has nothing to wait on.
                    pipeline = self._pipelines[run_id] = _Pipeline(uuid.uuid4().hex)
                pipeline.seq += 1
                pipeline.unanswered += 1
            call.variables.update(seq=pipeline.seq, session=pipeline.session)
        return call

    def _answered(self, call: Call) -> None:
        """A numbered call is done (answered, or failed for good): its pipeline has one call fewer in flight."""
        session = call.variables.get("session")
        if session is None:
            return
        with self._seq_lock:
            pipeline = self._pipelines.get(call.variables["runId"])
            if pipeline is not None and pipeline.session == session:
                pipeline.unanswered -= 1

    def _split(self, batch: Sequence[dict[str, Any]]) -> list[Sequence[dict[str, Any]]]:
        """`batch` in parts of at most the server's max_batch_size (known: `_max_batch_size`), in order."""
        most = self._max_batch_size()
        if not most or not isinstance(batch, list) or len(batch) <= most:
            return [batch]
        return [batch[start:start + most] for start in range(0, len(batch), most)]

    def _max_batch_size(self) -> int | None:
        return self._limits["max_batch_size"] if self._limits else None

    def _retry_delay(self, call: Call, attempt: int, error: Exception, elapsed: float = 0.0) -> float | None:
        """Seconds to wait before sending `call` again (same request id) after `error` on try `attempt`; None: give
        up. A dropped connection or a dead runtime: `max_attempts` tries. UNAVAILABLE (the call may be applied; a
        retry records it): backoff for UNAVAILABLE_BUDGET_S in all. Too many calls in flight: after the server's
        retryAfterS, within the same budget. Errors that mean "never applied" (deadline, full disk) are raised."""
        if not call.retry:
            return None
        backoff = self.retry_backoff * 2 ** (attempt - 1)
        if isinstance(error, UnavailableError) or (isinstance(error, ResourceExhaustedError) and error.retryable):
            delay = error.retry_after_s if isinstance(error, ResourceExhaustedError) else None
            delay = min(delay if delay is not None else backoff, MAX_RETRY_DELAY_S)
            return float(delay) if elapsed + delay <= UNAVAILABLE_BUDGET_S else None  # `elapsed`: since the first try
        if isinstance(error, WorkerFailedError) and error.retryable is False:
            return None  # in flight through two runtime deaths: the server says not to send it a third time
        if not (isinstance(error, (*RETRYABLE_TRANSPORT_ERRORS, WorkerFailedError)) and attempt < self.max_attempts):
            return None
        return float(backoff)

    def _transport_error(self, error: httpx.HTTPError) -> TransportError:
        return TransportError(f"cannot reach Signal at {self.url}: {error}")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @staticmethod
    def _payload(call: Call) -> dict[str, Any]:
        return {"query": document(call.operation), "variables": call.variables, "operationName": call.operation}

    @staticmethod
    def _answer(call: Call, response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            if response.status_code == 413:  # refused by the server's body limit before any GraphQL
                raise PayloadTooLargeError(f"the request body is too large: {response.text[:200]}") from None
            raise TransportError(f"server answered HTTP {response.status_code} without JSON: {response.text[:200]}") from None
        if body.get("errors"):
            raise error_from_graphql(body["errors"][0])
        if response.status_code >= 400 or not isinstance(body.get("data"), dict):
            raise ServerError(f"server answered HTTP {response.status_code}")
        value = convert(body["data"][call.field], TYPED.get(call.field, Result))
        return call.wrap(value) if call.wrap else value

    # ---- the calls ----------------------------------------------------------------------

    def list_models(self, detailed: bool = False) -> Any:  # typed on each client, by `detailed`
        """Names of the base models, or with `detailed=True` their descriptions: gpu, contextLength, framework,
        quantizationAllowed, quantized, available, estimatedMemoryGb, ..."""
        wrap = None if detailed else (lambda models: [model["name"] for model in models])
        return self._run(Call("ListModels", {}, "models", wrap))

    @_answers(UserResult)
    def me(self) -> Any:
        return self._run(Call("Me", {}, "me"))

    @_answers(UsageResult)
    def usage(self, days: int | None = None, user_id: str | None = None) -> Any:
        """Compute seconds, GPU-seconds, cost (credits) and tokens trained and sampled over the last `days` days (the
        server's default: 30), in all, by day and by run; `user_id`: another user's (admins only)."""
        return self._run(Call("Usage", _drop_none({"days": days, "userId": user_id}), "usage"))

    @_answers(SampleResult)
    def sample_base(self, prompts: str | list[str] | None = None, base_model: str | None = None,
                    max_tokens: int | None = None, temperature: float | None = None, seed: int | None = None,
                    num_samples: int | None = None, prompt_tokens: list[list[int]] | None = None,
                    store: bool | None = None) -> Any:
        """Generate from a base model alone (no run; the server's default model when None), billed to you."""
        if isinstance(prompts, str):
            prompts = [prompts]
        variables = _drop_none({"prompts": prompts, "promptTokens": prompt_tokens, "baseModel": base_model,
                                "maxTokens": max_tokens, "temperature": temperature, "seed": seed,
                                "numSamples": num_samples, "store": store})
        return self._run(_primitive("Sample", variables, "sample"))

    @_answers(ForwardResult)
    def forward(self, batch: Sequence[dict[str, Any]], base_model: str, loss_fn: str | None = None,
                loss_fn_config: dict[str, Any] | None = None) -> Any:
        """The loss and per-position `logprobs` of `batch` on a base model alone (no run, no adapter): the
        reference a DPO or KL term needs. `run.forward(...)` runs on a run's weights."""
        variables = _drop_none({"batch": _batch(batch), "baseModel": base_model, "lossFn": loss_fn,
                                "lossFnConfig": loss_fn_config})
        return self._run(_primitive("Forward", variables, "forward"))

    @_answers_run
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
        spec = _drop_none({
            "baseModel": base_model, "loraR": lora_r, "loraAlpha": lora_alpha, "learningRate": learning_rate,
            "loraDropout": lora_dropout, "loraTargetModules": lora_target_modules, "gpuConfig": gpu_config,
            "seed": seed, "weightDecay": weight_decay, "gradClipNorm": grad_clip_norm, "quantization": quantization,
            "trainAttn": train_attn, "trainMlp": train_mlp, "trainUnembed": train_unembed,
            "fromCheckpoint": from_checkpoint["path"] if isinstance(from_checkpoint, dict) else from_checkpoint,
            "withOptimizer": with_optimizer, "name": name, "tags": tags, "note": note,
        })
        return self._run(Call("CreateRun", {"input": spec}, "createRun", self._wrap_run))

    @_answers_run
    def get_run(self, run_id: str) -> Any:
        return self._run(Call("GetRun", {"id": run_id}, "run", self._wrap_run))

    @_answers_runs
    def list_runs(self, limit: int = 50, search: str = "", sort: str = "newest", archived: bool | None = False) -> Any:
        """Your runs in `sort`'s order (newest, oldest, name, activity, step); with `search`, those whose name,
        base model or a tag contains it (any case). archived: False those not archived, True the archived ones,
        None both."""
        variables = {"limit": limit, "search": search, "sort": sort.upper(), "archived": archived}
        return self._run(Call("ListRuns", variables, "runs", lambda runs: [self._wrap_run(r) for r in runs]))

    @_answers(TokenizerResult)
    def tokenizer(self, base_model: str | None = None, run_id: str | None = None) -> Any:
        """A base model's tokenizer (a catalogue name; default: the server's model), or a run's base's: name,
        vocab_size, eos_token_ids, bos_token_id, pad_token_id, chat_template."""
        return self._run(Call("Tokenizer", _drop_none({"baseModel": base_model, "runId": run_id}), "tokenizer"))

    @_answers(CreatedApiKeyResult)
    def create_api_key(self, name: str = "") -> Any:
        return self._run(Call("CreateApiKey", {"name": name}, "createApiKey"))

    @_answers(list[ApiKeyResult])
    def list_api_keys(self) -> Any:
        return self._run(Call("ApiKeys", {}, "apiKeys"))

    @_answers(ApiKeyResult)
    def revoke_api_key(self, key_id: str) -> Any:
        return self._run(Call("RevokeApiKey", {"id": key_id}, "revokeApiKey"))

    def _wrap_run(self, info: Result) -> Any:
        return (AsyncRun if isinstance(self, AsyncSignalClient) else Run)(self, info)

    def _wrap_artifact(self, info: Result) -> Artifact:
        return Artifact(info, self)

    def _download_url(self, url: str) -> str:
        """The key is only ever sent to this client's server: a URL naming another origin (the server's
        SIGNAL_PUBLIC_URL, say, seen through a tunnel) is fetched at the same path on this client's base URL."""
        mine, theirs = urlsplit(self.base_url), urlsplit(urljoin(self.base_url + "/", url))
        if (theirs.scheme, theirs.netloc) == (mine.scheme, mine.netloc):
            return theirs.geturl()
        return urlunsplit((mine.scheme, mine.netloc, theirs.path, theirs.query, ""))

    def _run(self, call: Call) -> Any:  # pragma: no cover - each transport defines it
        raise NotImplementedError

    def _run_all(self, calls: list[Call], combine: Callable[[list[Any]], Any]) -> Any:  # pragma: no cover - likewise
        """Consecutive calls (a split batch), numbered now, answered as `combine` of their answers."""
        raise NotImplementedError

    def _download(self, url: str, directory: str | os.PathLike[str]) -> Any:  # pragma: no cover - likewise
        raise NotImplementedError


class SignalClient(_ClientBase):
    def __init__(self, api_key: str | None = None, base_url: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                 retry_backoff: float = DEFAULT_RETRY_BACKOFF) -> None:
        super().__init__(api_key, base_url, max_attempts, retry_backoff)
        self._http = httpx.Client(timeout=timeout, transport=transport)
        self._executor: ThreadPoolExecutor | None = None  # made at the first pipelined call
        self._pipelining = threading.local()  # set while a `*_async` method makes its calls: they become futures

    if TYPE_CHECKING:  # the answer's type follows `detailed`
        @overload
        def list_models(self, detailed: Literal[False] = False) -> list[str]: ...
        @overload
        def list_models(self, detailed: Literal[True]) -> list[ModelInfo]: ...
        @overload
        def list_models(self, detailed: bool = False) -> list[str] | list[ModelInfo]: ...
        def list_models(self, detailed: bool = False) -> list[str] | list[ModelInfo]: ...

    def _run(self, call: Call) -> Any:
        pipelined = getattr(self._pipelining, "on", False)
        self._number(call, pipelined)
        if pipelined:
            return self._pool().submit(self._send, call)
        return self._send(call)

    def _run_all(self, calls: list[Call], combine: Callable[[list[Any]], Any]) -> Any:
        # A split batch's parts go together, so they are numbered (pipelined) whenever there is more than one.
        pipelined = getattr(self._pipelining, "on", False) or len(calls) > 1
        for call in calls:
            self._number(call, pipelined)
        if len(calls) == 1 and not getattr(self._pipelining, "on", False):
            return combine([self._send(calls[0])])
        # The parts go together, so a later call (numbered after them) never waits on the server for a part
        # that this client has not sent yet.
        gathered = _gathered([self._pool().submit(self._send, call) for call in calls], combine)
        return gathered if getattr(self._pipelining, "on", False) else gathered.result()

    def _pipelined(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """`method` (a Run primitive) made now, numbered now, sent from a thread: its future."""
        self._pipelining.on = True
        try:
            future = method(*args, **kwargs)
        finally:
            self._pipelining.on = False
        assert isinstance(future, Future), f"{method.__name__} is not a pipelined call"
        return future

    def _pool(self) -> ThreadPoolExecutor:
        with self._seq_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(DEFAULT_MAX_IN_FLIGHT, thread_name_prefix="rewardsignal")
            return self._executor

    def _max_batch_size(self) -> int | None:
        if self._limits is None:  # asked once, at the first batch
            self._limits = self._send(Call("Limits", {}, "limits"))
        return super()._max_batch_size()

    def _send(self, call: Call) -> Any:
        try:
            return self._attempts(call)
        finally:
            self._answered(call)

    def _attempts(self, call: Call) -> Any:
        attempt, began = 1, time.monotonic()
        while True:
            try:
                response = self._http.post(self.url, json=self._payload(call), headers=self._headers())
                return self._answer(call, response)
            except MAYBE_RETRIED as error:
                delay = self._retry_delay(call, attempt, error, time.monotonic() - began)
                if delay is None:
                    if isinstance(error, httpx.HTTPError):
                        raise self._transport_error(error) from error
                    raise
            time.sleep(delay)
            attempt += 1

    def _download(self, url: str, directory: str | os.PathLike[str]) -> Path:
        with tempfile.TemporaryFile() as archive:
            try:
                with self._http.stream("GET", self._download_url(url), headers=self._headers() | ARCHIVE_ACCEPT) as response:
                    _check_download(response, url)
                    for chunk in response.iter_bytes():
                        archive.write(chunk)
            except httpx.HTTPError as error:
                raise self._transport_error(error) from error
            return _unpack(archive, directory)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)  # pipelined calls still in flight finish first
        self._http.close()

    def __enter__(self) -> SignalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSignalClient(_ClientBase):
    def __init__(self, api_key: str | None = None, base_url: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 transport: httpx.AsyncBaseTransport | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                 retry_backoff: float = DEFAULT_RETRY_BACKOFF) -> None:
        super().__init__(api_key, base_url, max_attempts, retry_backoff)
        self._http = httpx.AsyncClient(timeout=timeout, transport=transport)

    if TYPE_CHECKING:  # the answer's type follows `detailed`
        @overload
        def list_models(self, detailed: Literal[False] = False) -> Coroutine[Any, Any, list[str]]: ...
        @overload
        def list_models(self, detailed: Literal[True]) -> Coroutine[Any, Any, list[ModelInfo]]: ...
        @overload
        def list_models(self, detailed: bool = False) -> Coroutine[Any, Any, list[str] | list[ModelInfo]]: ...
        def list_models(self, detailed: bool = False) -> Coroutine[Any, Any, list[str] | list[ModelInfo]]: ...

    def _run(self, call: Call) -> Coroutine[Any, Any, Any]:
        """The call, numbered now (when the method is called, not when it is awaited): its awaitable."""
        return self._send(self._number(call))

    def _run_all(self, calls: list[Call], combine: Callable[[list[Any]], Any]) -> Coroutine[Any, Any, Any]:
        for call in calls:
            self._number(call)

        async def together() -> Any:
            return combine(list(await asyncio.gather(*(self._send(call) for call in calls))))

        return together()

    async def _send(self, call: Call) -> Any:
        try:
            return await self._attempts(call)
        finally:
            self._answered(call)

    async def _attempts(self, call: Call) -> Any:
        attempt, began = 1, time.monotonic()
        while True:
            try:
                response = await self._http.post(self.url, json=self._payload(call), headers=self._headers())
                answer = self._answer(call, response)
                if call.operation in _RUN_OPERATIONS and self._limits is None:
                    self._limits = await self._send(Call("Limits", {}, "limits"))
                return answer
            except MAYBE_RETRIED as error:
                delay = self._retry_delay(call, attempt, error, time.monotonic() - began)
                if delay is None:
                    if isinstance(error, httpx.HTTPError):
                        raise self._transport_error(error) from error
                    raise
            await asyncio.sleep(delay)
            attempt += 1

    async def _download(self, url: str, directory: str | os.PathLike[str]) -> Path:
        with tempfile.TemporaryFile() as archive:
            try:
                async with self._http.stream("GET", self._download_url(url), headers=self._headers() | ARCHIVE_ACCEPT) as response:
                    if response.status_code != 200:
                        await response.aread()
                    _check_download(response, url)
                    async for chunk in response.aiter_bytes():
                        archive.write(chunk)
            except httpx.HTTPError as error:
                raise self._transport_error(error) from error
            return await asyncio.to_thread(_unpack, archive, directory)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSignalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Artifact(CheckpointResult):
    """A checkpoint (what save_state and checkpoints() return): its fields, and `download(dir)`, which fetches
    its files from the server as an archive and unpacks them into `dir` (awaitable on the async client)."""

    def __init__(self, info: Result, client: _ClientBase) -> None:
        super().__init__(info)
        self._client = client

    def download(self, directory: str | os.PathLike[str]) -> Any:
        return self._client._download(self["download_url"], directory)


def _gathered(parts: list[Future[Any]], combine: Callable[[list[Any]], Any]) -> Future[Any]:
    """One future for `parts`: `combine` of their results once all are done, or the first part's error."""
    out: Future[Any] = Future()
    out.set_running_or_notify_cancel()
    left = [len(parts)]
    lock = threading.Lock()

    def done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result(combine([part.result() for part in parts]))
        except BaseException as error:  # noqa: BLE001 - handed to the caller through the future, as a part's own would be
            out.set_exception(error)

    for part in parts:
        part.add_done_callback(done)
    return out


def _check_download(response: httpx.Response, url: str) -> None:
    if response.status_code == 200:
        return
    if not response.is_stream_consumed:
        response.read()
    message = f"download of {url} answered HTTP {response.status_code}: {response.text[:200]}"
    code = response.headers.get("x-signal-error-code")  # the server's typed errors name their code
    if code:
        raise error_for_code(code, message)
    cls = {401: AuthenticationError, 403: AuthenticationError, 404: NotFoundError}.get(response.status_code, ServerError)
    raise cls(message)


def _unpack(archive: IO[bytes], directory: str | os.PathLike[str]) -> Path:
    """Unpack a checkpoint archive into `directory`, without its one top-level folder; only plain files and
    folders inside `directory` (tarfile's "data" filter refuses links out, absolute paths and devices)."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    archive.seek(0)
    with tarfile.open(fileobj=archive, mode="r:*") as tar:  # a plain tar, or a .tar.gz from older servers
        members = []
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 2:
                continue  # the top-level folder itself
            member.name = str(Path(*parts[1:]))
            members.append(member)
        tar.extractall(target, members=members, filter="data")
    return target


class _RunBase:
    """A training run. `info` holds its fields as last fetched (`refresh()` fetches them again)."""

    def __init__(self, client: _ClientBase, info: Result) -> None:
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

    @_answers_run
    def update(self, name: str | None = None, tags: list[str] | None = None, note: str | None = None) -> Any:
        """Rename the run, replace its tags or its note; what is left as None keeps its value."""
        variables = _drop_none({"runId": self.id, "name": name, "tags": tags, "note": note})
        return self._client._run(Call("UpdateRun", variables, "updateRun", self._store))

    @_answers_run
    def archive(self) -> Any:
        """Hide the run from `list_runs` and refuse its training and sampling (FAILED_PRECONDITION) until
        `unarchive`; its files, checkpoints and history are kept."""
        return self._client._run(Call("ArchiveRun", {"runId": self.id}, "archiveRun", self._store))

    @_answers_run
    def unarchive(self) -> Any:
        return self._client._run(Call("UnarchiveRun", {"runId": self.id}, "unarchiveRun", self._store))

    @_answers(ForwardBackwardResult)
    def forward_backward(self, batch: Sequence[dict[str, Any]], loss_fn: str | None = None,
                         loss_fn_config: dict[str, Any] | None = None, reduction: str | None = None,
                         return_outputs: bool = False) -> Any:
        """Loss and gradients for `batch`; gradients add up until `optim_step`. Unset: the server's
        default loss (cross_entropy) and reduction ("mean"; "sum" is Tinker's: one per step). With
        `return_outputs`, the result's `outputs` holds each datum's per-position `logprobs` and
        `elementwise_loss` (a retried call's answer has none). A batch over the server's max_batch_size goes as
        consecutive calls with one answer (`mean` normalises across them)."""
        variables = _drop_none({"runId": self.id, "lossFn": loss_fn, "lossFnConfig": loss_fn_config,
                                "reduction": reduction, "withOutputs": return_outputs or None})
        calls = [_primitive("ForwardBackward", {**variables, "batch": _batch(part)}, "forwardBackward")
                 for part in self._client._split(batch)]
        return self._client._run_all(calls, functools.partial(combine_forward_backward, reduction=reduction or "mean"))

    @_answers(ForwardResult)
    def forward(self, batch: Sequence[dict[str, Any]], loss_fn: str | None = None,
                loss_fn_config: dict[str, Any] | None = None, snapshot: str | None = None) -> Any:
        """The loss and each datum's per-position `logprobs` on the run's current weights (or with `snapshot`, on
        a snapshot of it: it waits for none of the run's training), with no backward: no gradient, step or
        dropout counter changes."""
        variables = _drop_none({"runId": self.id, "batch": _batch(batch), "lossFn": loss_fn,
                                "lossFnConfig": loss_fn_config, "snapshot": snapshot})
        return self._client._run(_primitive("Forward", variables, "forward"))

    @_answers(list[Datum])
    def render_datums(self, batch: Sequence[dict[str, Any]], loss_fn: str | None = None) -> Any:
        """The token-level datums ({model_input, loss_fn_inputs}) the server builds for `batch` on this run's model."""
        variables = _drop_none({"runId": self.id, "batch": _batch(batch), "lossFn": loss_fn})
        return self._client._run(Call("RenderDatums", variables, "renderDatums"))

    @_answers(OptimStepResult)
    def optim_step(self, learning_rate: float | None = None, beta1: float | None = None, beta2: float | None = None,
                   eps: float | None = None, weight_decay: float | None = None,
                   grad_clip_norm: float | None = None) -> Any:
        """Apply the accumulated gradients (AdamW); unset settings use the run's defaults."""
        adam = _drop_none({"learningRate": learning_rate, "beta1": beta1, "beta2": beta2, "eps": eps,
                           "weightDecay": weight_decay, "gradClipNorm": grad_clip_norm})
        return self._client._run(_primitive("OptimStep", {"runId": self.id, "adam": adam or None}, "optimStep"))

    @_answers(SampleResult)
    def sample(self, prompts: str | list[str] | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               stop: str | list[str] | list[int] | None = None, num_samples: int | None = None,
               seed: int | None = None, prompt_tokens: list[list[int]] | None = None,
               prompt_logprobs: bool | None = None, topk_prompt_logprobs: int | None = None,
               topk_sample_logprobs: int | None = None, store: bool | None = None,
               snapshot: str | None = None) -> Any:
        """Generate from the run's current weights, or with `snapshot` from a snapshot of it (save_weights_for_sampler:
        it waits for none of the run's training); settings left unset take the server's defaults (the engine
        contract's: 64 tokens, temperature 1, top_p 1, no top_k, one sample).

        Give `prompts` (text) or `prompt_tokens` (token ids). `stop`: strings or token ids; omitted, EOS stops;
        `[]`, nothing but max_tokens stops; a non-empty list stops there and at EOS. Each sequence's `logprobs`
        are the unmodified model's (temperature 1), what a teacher-forced forward returns. `store` keeps the
        samples in the run's history (default: yes for current weights, no for a snapshot)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(stop, str):
            stop = [stop]
        tokens = isinstance(stop, list) and bool(stop) and all(isinstance(s, int) for s in stop)
        variables = _drop_none({"runId": self.id, "prompts": prompts, "promptTokens": prompt_tokens,
                                "maxTokens": max_tokens, "temperature": temperature, "topP": top_p, "topK": top_k,
                                "stop": None if tokens else stop, "stopTokens": stop if tokens else None,
                                "numSamples": num_samples, "seed": seed, "promptLogprobs": prompt_logprobs,
                                "topkPromptLogprobs": topk_prompt_logprobs,
                                "topkSampleLogprobs": topk_sample_logprobs, "store": store,
                                "snapshot": snapshot})
        return self._client._run(_primitive("Sample", variables, "sample"))

    @_answers(TokenizerResult)
    def tokenizer(self) -> Any:
        """The tokenizer of this run's base: name, vocab_size, eos_token_ids, bos_token_id, pad_token_id,
        chat_template."""
        return self._client.tokenizer(run_id=self.id)

    @_answers(SamplerSnapshotResult)
    def save_weights_for_sampler(self, name: str | None = None) -> Any:
        """Freeze the run's current weights (after every call sent before this one) to sample from while it trains
        on: {"name", "step", "named", "expires_in_seconds"}. Named snapshots are kept; unnamed ones expire
        (docs/SNAPSHOTS.md)."""
        variables = _drop_none({"runId": self.id, "name": name})
        return self._client._run(_primitive("SaveWeightsForSampler", variables, "saveWeightsForSampler"))

    @_answers(list[Artifact])
    def snapshots(self) -> Any:
        wrap = self._client._wrap_artifact
        return self._client._run(Call("RunSnapshots", {"id": self.id}, "run",
                                      lambda run: [wrap(c) for c in run["snapshots"]]))

    @_answers(Artifact)
    def save_state(self, mode: str = "adapter", push_to_hub: bool = False, hub_model_id: str | None = None,
                   hf_token: str | None = None, name: str | None = None,
                   with_optimizer: bool | None = None) -> Any:
        """Export the run (an `Artifact`: `.download(dir)` fetches its files; its `path` is what `load_state` and
        `create_run(from_checkpoint=…)` take). `name` is unique per run and mode (default step-N); `with_optimizer`
        keeps AdamW's state (default: for mode "state" only). With `push_to_hub`, the server also uploads it to
        `hub_model_id` (a private repo) with `hf_token` (default: env HF_TOKEN), used for that upload only."""
        if push_to_hub and hf_token is None:
            hf_token = os.environ.get("HF_TOKEN")
        variables = _drop_none({"runId": self.id, "mode": mode.upper(), "name": name, "withOptimizer": with_optimizer,
                                "pushToHub": push_to_hub, "hubModelId": hub_model_id,
                                "hfToken": hf_token if push_to_hub else None})
        call = _primitive("SaveState", variables, "saveState")
        call.wrap = self._client._wrap_artifact
        return self._client._run(call)

    @_answers(LoadStateResult)
    def load_state(self, checkpoint: Any, with_optimizer: bool = True) -> Any:
        """Load a checkpoint into this run: an `Artifact`, its `path` (signal://…, one of your runs'), or the name
        of this run's "state" checkpoint. Its weights, with `with_optimizer` its AdamW state, and its step."""
        path = checkpoint["path"] if isinstance(checkpoint, dict) else checkpoint
        variables = {"runId": self.id, "checkpoint": path, "withOptimizer": with_optimizer}
        return self._client._run(_primitive("LoadState", variables, "loadState"))

    @_answers(bool)
    def delete_checkpoint(self, checkpoint: Any) -> Any:
        """Delete a checkpoint or sampler snapshot of this run (an `Artifact`, or its id): its files and its row."""
        checkpoint_id = checkpoint["id"] if isinstance(checkpoint, dict) else checkpoint
        return self._client._run(Call("DeleteCheckpoint", {"runId": self.id, "checkpointId": str(checkpoint_id)},
                                      "deleteCheckpoint"))

    @_answers(list[Result])
    def metrics(self, name: str | None = None, limit: int = 1000) -> Any:
        variables = _drop_none({"id": self.id, "name": name, "limit": limit})
        return self._client._run(Call("RunMetrics", variables, "run", lambda run: run["metrics"]))

    @_answers(list[Result])
    def samples(self, limit: int = 100) -> Any:
        return self._client._run(Call("RunSamples", {"id": self.id, "limit": limit}, "run", lambda r: r["samples"]))

    @_answers(list[Artifact])
    def checkpoints(self) -> Any:
        wrap = self._client._wrap_artifact
        return self._client._run(Call("RunCheckpoints", {"id": self.id}, "run",
                                      lambda run: [wrap(c) for c in run["checkpoints"]]))

    @_answers(bool)
    def delete(self) -> Any:
        return self._client._run(Call("DeleteRun", {"runId": self.id}, "deleteRun"))

    def _store(self, info: Result) -> Any:
        self.info = info
        return self


class Run(_RunBase):
    _client: SignalClient

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


class AsyncRun(_RunBase):
    async def refresh(self) -> AsyncRun:
        refreshed: AsyncRun = await self._client._run(Call("GetRun", {"id": self.id}, "run", self._store))
        return refreshed


__all__ = ["Artifact", "AsyncRun", "AsyncSignalClient", "Run", "SignalAPIError", "SignalClient"]
