"""SignalClient: every method blocks until its answer, and a Run's `*_async` methods answer futures, sent from a
thread pool in the order they were made (pipelining.py)."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import httpx

from rewardsignal.answer_types import Blocking
from rewardsignal.artifacts import ARCHIVE_ACCEPT, check_download, unpack
from rewardsignal.calls import Call
from rewardsignal.client_base import ClientBase
from rewardsignal.pipelining import gathered
from rewardsignal.runs import Run
from rewardsignal.transport import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RETRY_BACKOFF,
    DEFAULT_TIMEOUT,
    MAYBE_RETRIED,
    read_answer,
    request_body,
    retry_delay,
    unreachable,
)

if TYPE_CHECKING:
    import os

    from rewardsignal.results import ModelInfo

DEFAULT_MAX_IN_FLIGHT = 32  # the sync client's threads for pipelined calls (its futures); more queue, in order


class SignalClient(ClientBase, Blocking):
    _run_type = Run

    def __init__(self, api_key: str | None = None, base_url: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                 retry_backoff: float = DEFAULT_RETRY_BACKOFF) -> None:
        super().__init__(api_key, base_url, max_attempts, retry_backoff)
        self._http = httpx.Client(timeout=timeout, transport=transport)
        self._executor: ThreadPoolExecutor | None = None  # made at the first pipelined call
        self._executor_lock = threading.Lock()  # pipelined calls may be made from several threads at once
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
        self._order.number(call, pipelined)
        if pipelined:
            return self._pool().submit(self._send, call)
        return self._send(call)

    def _run_all(self, calls: list[Call], combine: Callable[[list[Any]], Any]) -> Any:
        # A split batch's parts go together, so they are numbered (pipelined) whenever there is more than one.
        pipelined = getattr(self._pipelining, "on", False) or len(calls) > 1
        for call in calls:
            self._order.number(call, pipelined)
        if len(calls) == 1 and not getattr(self._pipelining, "on", False):
            return combine([self._send(calls[0])])
        # The parts go together, so a later call (numbered after them) never waits on the server for a part
        # that this client has not sent yet.
        together = gathered([self._pool().submit(self._send, call) for call in calls], combine)
        return together if getattr(self._pipelining, "on", False) else together.result()

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
        with self._executor_lock:
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
            self._order.answered(call)

    def _attempts(self, call: Call) -> Any:
        attempt, began = 1, time.monotonic()
        while True:
            try:
                response = self._http.post(self.url, json=request_body(call), headers=self._headers())
                return read_answer(call, response)
            except MAYBE_RETRIED as error:
                delay = retry_delay(call, attempt, error, time.monotonic() - began, self.max_attempts, self.retry_backoff)
                if delay is None:
                    if isinstance(error, httpx.HTTPError):
                        raise unreachable(self.url, error) from error
                    raise
            time.sleep(delay)
            attempt += 1

    def _download(self, url: str, directory: str | os.PathLike[str]) -> Path:
        with tempfile.TemporaryFile() as archive:
            try:
                with self._http.stream("GET", self._download_url(url), headers=self._headers() | ARCHIVE_ACCEPT) as response:
                    check_download(response, url)
                    for chunk in response.iter_bytes():
                        archive.write(chunk)
            except httpx.HTTPError as error:
                raise unreachable(self.url, error) from error
            return unpack(archive, directory)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)  # pipelined calls still in flight finish first
        self._http.close()

    def __enter__(self) -> SignalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
