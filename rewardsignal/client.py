"""SignalClient and AsyncSignalClient: the same surface, one blocking and one awaitable.

Each public method builds a `Call` (operation, variables, the field to return, how to wrap it);
the sync client runs it at once, the async client returns an awaitable that does.

The four training primitives carry a fresh `requestId` each. When the connection drops or the server
answers WORKER_FAILED, the client sends the same call again, with the same id, a few times: the server
applies a call once per id and answers a retry with the first attempt's result.
"""

from __future__ import annotations

import asyncio
import os
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from rewardsignal.errors import (
    AuthenticationError,
    NotFoundError,
    PayloadTooLargeError,
    ServerError,
    SignalAPIError,
    TransportError,
    WorkerFailedError,
    error_for_code,
    error_from_graphql,
)
from rewardsignal.operations import document
from rewardsignal.results import Result, convert

DEFAULT_BASE_URL = "http://localhost:8000"
DEFAULT_TIMEOUT = 600.0  # a forward_backward on a large model can take minutes
DEFAULT_MAX_ATTEMPTS = 3  # tries of a primitive whose connection dropped or whose worker failed
DEFAULT_RETRY_BACKOFF = 0.5  # seconds before the second try; doubled before each further one
# The connection dropped, or never came up: the call may or may not have reached the server.
RETRYABLE_TRANSPORT_ERRORS = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)


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

    def _retry_delay(self, call: Call, attempt: int, error: Exception) -> float | None:
        """Seconds to wait before sending `call` again after `error` on try `attempt`; None: give up."""
        retryable = isinstance(error, (*RETRYABLE_TRANSPORT_ERRORS, WorkerFailedError))
        if not (call.retry and retryable and attempt < self.max_attempts):
            return None
        return float(self.retry_backoff * 2 ** (attempt - 1))

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
        value = convert(body["data"][call.field])
        return call.wrap(value) if call.wrap else value

    # ---- the calls ----------------------------------------------------------------------

    def list_models(self, detailed: bool = False) -> Any:
        """Names of the base models, or with `detailed=True` their descriptions: gpu, contextLength, framework,
        quantizationAllowed, quantized, available, estimatedMemoryGb, ..."""
        wrap = None if detailed else (lambda models: [model["name"] for model in models])
        return self._run(Call("ListModels", {}, "models", wrap))

    def me(self) -> Any:
        return self._run(Call("Me", {}, "me"))

    def sample_base(self, prompts: list[str], base_model: str | None = None, max_tokens: int | None = None,
                    temperature: float | None = None, seed: int | None = None, num_samples: int | None = None) -> Any:
        """Generate from a base model alone (no run; the server's default model when None), billed to you."""
        if isinstance(prompts, str):
            prompts = [prompts]
        variables = _drop_none({"prompts": prompts, "baseModel": base_model, "maxTokens": max_tokens,
                                "temperature": temperature, "seed": seed, "numSamples": num_samples})
        return self._run(_primitive("Sample", variables, "sample"))

    def create_run(
        self, base_model: str | None = None, lora_r: int | None = None, lora_alpha: float | None = None,
        learning_rate: float | None = None, lora_dropout: float | None = None,
        lora_target_modules: list[str] | None = None, gpu_config: str | None = None, seed: int | None = None,
        weight_decay: float | None = None, grad_clip_norm: float | None = None, quantization: str | None = None,
    ) -> Any:
        """A new run; settings left as None take the server's defaults (LoRA r=32, alpha=2r, AdamW lr 1e-4).

        quantization: "8bit" or "4bit" loads the base through bitsandbytes (4-bit is QLoRA's NF4), on one GPU.
        """
        spec = _drop_none({
            "baseModel": base_model, "loraR": lora_r, "loraAlpha": lora_alpha, "learningRate": learning_rate,
            "loraDropout": lora_dropout, "loraTargetModules": lora_target_modules, "gpuConfig": gpu_config,
            "seed": seed, "weightDecay": weight_decay, "gradClipNorm": grad_clip_norm, "quantization": quantization,
        })
        return self._run(Call("CreateRun", {"input": spec}, "createRun", self._wrap_run))

    def get_run(self, run_id: str) -> Any:
        return self._run(Call("GetRun", {"id": run_id}, "run", self._wrap_run))

    def list_runs(self, limit: int = 50) -> Any:
        return self._run(Call("ListRuns", {"limit": limit}, "runs", lambda runs: [self._wrap_run(r) for r in runs]))

    def create_api_key(self, name: str = "") -> Any:
        return self._run(Call("CreateApiKey", {"name": name}, "createApiKey"))

    def list_api_keys(self) -> Any:
        return self._run(Call("ApiKeys", {}, "apiKeys"))

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

    def _download(self, url: str, directory: str | os.PathLike[str]) -> Any:  # pragma: no cover - likewise
        raise NotImplementedError


class SignalClient(_ClientBase):
    def __init__(self, api_key: str | None = None, base_url: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                 retry_backoff: float = DEFAULT_RETRY_BACKOFF) -> None:
        super().__init__(api_key, base_url, max_attempts, retry_backoff)
        self._http = httpx.Client(timeout=timeout, transport=transport)

    def _run(self, call: Call) -> Any:
        attempt = 1
        while True:
            try:
                response = self._http.post(self.url, json=self._payload(call), headers=self._headers())
                return self._answer(call, response)
            except (httpx.HTTPError, WorkerFailedError) as error:
                delay = self._retry_delay(call, attempt, error)
                if delay is None:
                    if isinstance(error, httpx.HTTPError):
                        raise self._transport_error(error) from error
                    raise
            time.sleep(delay)
            attempt += 1

    def _download(self, url: str, directory: str | os.PathLike[str]) -> Path:
        with tempfile.TemporaryFile() as archive:
            try:
                with self._http.stream("GET", self._download_url(url), headers=self._headers()) as response:
                    _check_download(response, url)
                    for chunk in response.iter_bytes():
                        archive.write(chunk)
            except httpx.HTTPError as error:
                raise self._transport_error(error) from error
            return _unpack(archive, directory)

    def close(self) -> None:
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

    async def _run(self, call: Call) -> Any:
        attempt = 1
        while True:
            try:
                response = await self._http.post(self.url, json=self._payload(call), headers=self._headers())
                return self._answer(call, response)
            except (httpx.HTTPError, WorkerFailedError) as error:
                delay = self._retry_delay(call, attempt, error)
                if delay is None:
                    if isinstance(error, httpx.HTTPError):
                        raise self._transport_error(error) from error
                    raise
            await asyncio.sleep(delay)
            attempt += 1

    async def _download(self, url: str, directory: str | os.PathLike[str]) -> Path:
        with tempfile.TemporaryFile() as archive:
            try:
                async with self._http.stream("GET", self._download_url(url), headers=self._headers()) as response:
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


class Artifact(Result):
    """A checkpoint (what save_state and checkpoints() return): its fields, and `download(dir)`, which fetches
    its files from the server as an archive and unpacks them into `dir` (awaitable on the async client)."""

    def __init__(self, info: Result, client: _ClientBase) -> None:
        super().__init__(info)
        self._client = client

    def download(self, directory: str | os.PathLike[str]) -> Any:
        return self._client._download(self["download_url"], directory)


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
    with tarfile.open(fileobj=archive, mode="r:gz") as tar:
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
        return f"<Run {self.id} {self.info.get('base_model')} step={self.info.get('step')}>"

    @property
    def step(self) -> int:
        return int(self.info["step"])

    def forward_backward(self, batch: list[dict[str, Any]], loss_fn: str | None = None,
                         loss_fn_config: dict[str, Any] | None = None) -> Any:
        """Loss and gradients for `batch`; gradients add up until `optim_step`. Unset: the server's
        default loss (cross_entropy)."""
        variables = _drop_none({"runId": self.id, "batch": batch, "lossFn": loss_fn, "lossFnConfig": loss_fn_config})
        return self._client._run(_primitive("ForwardBackward", variables, "forwardBackward"))

    def optim_step(self, learning_rate: float | None = None, beta1: float | None = None, beta2: float | None = None,
                   eps: float | None = None, weight_decay: float | None = None,
                   grad_clip_norm: float | None = None) -> Any:
        """Apply the accumulated gradients (AdamW); unset settings use the run's defaults."""
        adam = _drop_none({"learningRate": learning_rate, "beta1": beta1, "beta2": beta2, "eps": eps,
                           "weightDecay": weight_decay, "gradClipNorm": grad_clip_norm})
        return self._client._run(_primitive("OptimStep", {"runId": self.id, "adam": adam or None}, "optimStep"))

    def sample(self, prompts: list[str], max_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, stop: list[str] | None = None,
               num_samples: int | None = None, seed: int | None = None, snapshot: str | None = None,
               store: bool | None = None) -> Any:
        """Generate from the run's current weights, or with `snapshot` from a snapshot of it (save_weights_for_sampler:
        it waits for none of the run's training); settings left unset take the server's defaults (the engine
        contract's: 64 tokens, temperature 1, top_p 1, no top_k, one sample). `store` keeps the samples in the run's
        history (default: yes for current weights, no for a snapshot)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        variables = _drop_none({"runId": self.id, "prompts": prompts, "maxTokens": max_tokens,
                                "temperature": temperature, "topP": top_p, "topK": top_k, "stop": stop,
                                "numSamples": num_samples, "seed": seed, "snapshot": snapshot, "store": store})
        return self._client._run(_primitive("Sample", variables, "sample"))

    def save_weights_for_sampler(self, name: str | None = None) -> Any:
        """Freeze the run's current weights (after every call sent before this one) to sample from while it trains
        on: {"name", "step", "named", "expires_in_seconds"}. Named snapshots are kept; unnamed ones expire
        (docs/SNAPSHOTS.md)."""
        variables = _drop_none({"runId": self.id, "name": name})
        return self._client._run(_primitive("SaveWeightsForSampler", variables, "saveWeightsForSampler"))

    def snapshots(self) -> Any:
        wrap = self._client._wrap_artifact
        return self._client._run(Call("RunSnapshots", {"id": self.id}, "run",
                                      lambda run: [wrap(c) for c in run["snapshots"]]))

    def save_state(self, mode: str = "adapter", push_to_hub: bool = False, hub_model_id: str | None = None,
                   hf_token: str | None = None) -> Any:
        """Export the run (an `Artifact`: `.download(dir)` fetches its files). With `push_to_hub`, the server also
        uploads it to `hub_model_id` (a private repo) with `hf_token` (default: env HF_TOKEN), used for that upload only."""
        if push_to_hub and hf_token is None:
            hf_token = os.environ.get("HF_TOKEN")
        variables = _drop_none({"runId": self.id, "mode": mode.upper(), "pushToHub": push_to_hub,
                                "hubModelId": hub_model_id, "hfToken": hf_token if push_to_hub else None})
        call = _primitive("SaveState", variables, "saveState")
        call.wrap = self._client._wrap_artifact
        return self._client._run(call)

    def metrics(self, name: str | None = None, limit: int = 1000) -> Any:
        variables = _drop_none({"id": self.id, "name": name, "limit": limit})
        return self._client._run(Call("RunMetrics", variables, "run", lambda run: run["metrics"]))

    def samples(self, limit: int = 100) -> Any:
        return self._client._run(Call("RunSamples", {"id": self.id, "limit": limit}, "run", lambda r: r["samples"]))

    def checkpoints(self) -> Any:
        wrap = self._client._wrap_artifact
        return self._client._run(Call("RunCheckpoints", {"id": self.id}, "run",
                                      lambda run: [wrap(c) for c in run["checkpoints"]]))

    def delete(self) -> Any:
        return self._client._run(Call("DeleteRun", {"runId": self.id}, "deleteRun"))

    def _store(self, info: Result) -> Any:
        self.info = info
        return self


class Run(_RunBase):
    def refresh(self) -> Run:
        refreshed: Run = self._client._run(Call("GetRun", {"id": self.id}, "run", self._store))
        return refreshed


class AsyncRun(_RunBase):
    async def refresh(self) -> AsyncRun:
        refreshed: AsyncRun = await self._client._run(Call("GetRun", {"id": self.id}, "run", self._store))
        return refreshed


__all__ = ["Artifact", "AsyncRun", "AsyncSignalClient", "Run", "SignalAPIError", "SignalClient"]
