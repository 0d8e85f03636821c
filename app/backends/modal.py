"""The Modal backend: each run's calls go to its pool's warm container (gpu_runtime/modal_app.py).

A pool is (base model, GPU configuration, quantization), named by gpu_runtime.client.allocation.pool_key. The class
is looked up once by name (`modal.Cls.from_name`); each pool gets its GPU with `with_options(gpu=...)` and its
own instance, cached, and its calls go through `.aio`, so many are in flight at once from the event loop and
the container's scheduler co-batches them.

The lookup is injected through the constructor: tests hand it the app module's class and `local=True`, and
calls then run through Modal's offline `.local()` path in a thread, every argument and answer through JSON as
the wire would carry them. No setting skips the credentials check of the real lookup.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from app.backends.base import A, Progress
from app.errors import BadInput, FailedPrecondition, SignalError, WorkerFailed
from app.settings import Settings
from gpu_runtime.client.allocation import PoolKey, modal_gpu
from gpu_runtime.client.modal_names import APP_NAME, CLASS_NAME
from gpu_runtime.client.poison import Deaths, call_key, poison_pill
from gpu_runtime.client.protocol import check_contract
from gpu_runtime.contract import Call, DeleteRun, Method
from gpu_runtime.contract.json_types import JSON, JSONObject, as_json, as_object, get_object, opt_object

if TYPE_CHECKING:
    from modal.cls import Obj

DEATHS_FILE = "modal-deaths.json"  # in the server's data directory: the poison-pill count its processes share
log = logging.getLogger("signal.backend")
CREDENTIALS_HELP = ("Modal credentials are missing: run `modal token new` (writes ~/.modal.toml), or set "
                    "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET; then deploy the runtime with "
                    "`modal deploy -m gpu_runtime.modal_app`. `signal doctor` checks the whole setup.")


class ModalNotConfigured(FailedPrecondition):
    """SIGNAL_BACKEND=modal without the credentials to reach Modal: said once, at start."""


def check_credentials() -> None:
    if not modal_credentials():
        raise ModalNotConfigured(CREDENTIALS_HELP)


def modal_credentials() -> bool:
    """Whether Modal credentials are configured (env vars or ~/.modal.toml); reads config only, no network."""
    from modal.config import config

    return bool(config.get("token_id") and config.get("token_secret"))


def pool_gpu(pool: str) -> str:
    """Modal's GPU string for a pool key ("base|L40S:1|none" → "L40S"): what `with_options(gpu=...)` gets."""
    return modal_gpu(PoolKey.parse(pool).gpu)


class ModalBackend:
    shares_disk = False  # run files live on the Volume: archives come through the runtime
    label = "Modal"
    allocates = True  # a run's pool is a container with the GPUs its gpu_config names

    def __init__(self, settings: Settings, lookup: Callable[[], Any] | None = None, local: bool = False) -> None:
        if lookup is None:
            check_credentials()
            import modal

            def lookup() -> Any:
                return modal.Cls.from_name(APP_NAME, CLASS_NAME)

        self.lookup = lookup
        self.local = local
        # Canonical JSON: each distinct parameter set is its own Modal variant, so it must never vary in spelling.
        self.options = json.dumps(settings.runtime_options().to_dict(), sort_keys=True)
        self.pools: dict[str, Obj] = {}  # pool key → its instance of the class (one container each)
        self._cls: Any = None
        self._lock = threading.Lock()  # guards the pool table (calls come from many threads)
        self._lookup_lock = threading.Lock()
        self._checking: asyncio.Future[None] | None = None
        self._entering: dict[str, threading.Lock] = {}  # offline: `.local()` runs @modal.enter unlocked
        self._entered: set[str] = set()
        self._started = False
        self._agreed: set[str] = set()  # pools whose container answered this server's contract version
        # A call in flight through two container failures in a row is not sent again (poison.py), as locally.
        self.deaths = Deaths(settings.data_dir / DEATHS_FILE)

    @property
    def ready(self) -> bool:
        return self._started  # pools start on their first call, each in its own container

    @property
    def health(self) -> str:
        # 200 while serving: each pool's container is Modal's to keep alive, and a call to a dead one is retried there.
        return "ok" if self._started else "warming"

    async def start(self) -> None:
        self._started = True
        if not self.local:
            self._checking = asyncio.ensure_future(self._check_deployed())

    async def _check_deployed(self) -> None:
        """Say at start, in the log, when the app is not deployed (or unreachable); calls would fail alike."""
        try:
            cls = await anyio.to_thread.run_sync(self._lookup)
            await cls.hydrate.aio()
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the server still serves everything else
            log.error("the Modal class %s.%s is not reachable (%s: %s); deploy it with `modal deploy -m "
                      "gpu_runtime.modal_app`, and see `signal doctor`", APP_NAME, CLASS_NAME, type(exc).__name__, exc)

    async def call(self, request: Call[A], pool: PoolKey | None = None, progress: Progress | None = None,
                   ticket: int | None = None, sent: Callable[[], None] | None = None) -> A:
        # `progress` is never called: a call's answer comes back whole from `.remote()`, so a streamed sample's text
        # reaches the client as one chunk after it (docs/MODAL.md). Nor is `sent`: concurrent .remote() calls may
        # arrive in any order, and a container that does not know the run yet (cold) takes the first ticket it sees
        # as the run's start, so the run's next call goes only once this one is answered (docs/ORDERING.md).
        if pool is None:
            if request.method != Method.RUNTIME_STATE:
                raise BadInput(f"{request.method} needs the run's pool on Modal", field="pool")
            return request.result(await self._every_pool(request.method))
        key = str(pool)  # what names the container's variant, and its instance here
        await self._agree(key)
        if isinstance(request, DeleteRun):
            answer = await self._invoke(key, "delete_run", request.run_id)
        else:
            params = request.to_dict() | ({} if ticket is None else {"ticket": ticket})
            answer = await self._guarded(key, request.method.value, params)
        if "error" in answer:
            raise SignalError.from_dict(get_object(answer, "error"))
        return request.result(get_object(answer, "result"))

    async def _guarded(self, pool: str, method: str, params: JSONObject) -> Mapping[str, object]:
        """One call, unless it failed with its container twice in a row (a poison pill: WORKER_FAILED, not retryable,
        not sent); such a failure is counted, an answer ends the count."""
        key = call_key(params)
        if self.deaths.poisoned(key):
            raise poison_pill(method)
        try:
            answer = await self._invoke(pool, "call", method, params)
        except WorkerFailed as failed:
            if key is not None and _with_its_container(failed.__cause__) and self.deaths.died([key]):
                raise poison_pill(method) from failed.__cause__
            raise
        self.deaths.answered(key)
        return answer

    async def _agree(self, pool: str) -> None:
        """A deployment can lag the server's code: before a pool's first call, its contract version is asked for."""
        if pool in self._agreed:
            return
        answer = await self._invoke(pool, "call", "ping", {})
        check_contract(opt_object(answer, "result"), f"deployed on Modal as {APP_NAME}.{CLASS_NAME}",
                       "deploy this server's code with `modal deploy -m gpu_runtime.modal_app`")
        self._agreed.add(pool)

    async def close(self) -> None:
        # Nothing to stop on Modal: each pool's container scales down after its window, and commits as it goes.
        with self._lock:
            pools, self.pools = list(self.pools.values()), {}
        if self.local:  # offline the "containers" live in this process: wind their engines down, as a scale-down does
            for instance in pools:
                engine = getattr(instance, "engine", None)
                if engine is not None:
                    engine.scheduler.close()

    # ---- pools ----------------------------------------------------------------------------------

    def instance(self, pool: str) -> Obj:
        """The pool's instance of the class: its GPU applied, cached (every `with_options` is its own variant)."""
        with self._lock:
            found = self.pools.get(pool)
            if found is None:
                found = self.pools[pool] = self._lookup().with_options(gpu=pool_gpu(pool))(pool=pool, options=self.options)
            return found

    def _lookup(self) -> Any:
        with self._lookup_lock:
            if self._cls is None:
                self._cls = self.lookup()
            return self._cls

    async def _invoke(self, pool: str, name: str, *args: JSON) -> Mapping[str, object]:
        instance = await anyio.to_thread.run_sync(self.instance, pool)
        method = getattr(instance, name)
        try:
            if self.local:
                wire = json.loads(json.dumps(args))  # what the wire would carry: nothing passes by reference
                answer = await anyio.to_thread.run_sync(self._local_call, pool, method, wire)
                return as_object(json.loads(json.dumps(answer)), "answer")
            # Shielded: a caller that goes away must not cancel a call the container may already have applied.
            return as_object(await asyncio.shield(method.remote.aio(*args)), "answer")
        except SignalError:
            raise
        except Exception as exc:  # noqa: BLE001 - Modal's own failures (a lost container, a timeout): retryable
            raise WorkerFailed(f"the Modal pool {pool!r} failed: {type(exc).__name__}: {exc}") from exc

    def _local_call(self, pool: str, method: Any, args: list[JSON]) -> object:
        # `.local()` neither locks nor remembers that @modal.enter ran until it returns: the first call enters alone.
        if pool not in self._entered:
            with self._lock:
                entering = self._entering.setdefault(pool, threading.Lock())
            with entering:
                if pool not in self._entered:
                    answer: object = method.local(*args)
                    self._entered.add(pool)
                    return answer
        return method.local(*args)

    async def _every_pool(self, method: str) -> JSONObject:
        """ping / runtime_state: each pool this server has called answers for itself; none is started for it."""
        with self._lock:
            pools = sorted(self.pools)
        answers: JSONObject = {}
        for pool in pools:
            answer = await self._invoke(pool, "call", method, {})
            answers[pool] = as_json(answer.get("result", answer.get("error")))
        return {"backend": "modal", "pools": answers}


def _with_its_container(failure: BaseException | None) -> bool:
    """Whether a failed call failed where it ran (its container lost, timed out, or raising): not Modal's errors on
    this side of the wire (credentials, connection, lookup), after which the call may never have reached one."""
    from modal import exception as modal_errors

    return not isinstance(failure, (modal_errors.AuthError, modal_errors.ConnectionError, modal_errors.InvalidError,
                                    modal_errors.NotFoundError, modal_errors.VersionError))
