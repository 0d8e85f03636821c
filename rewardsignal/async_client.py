"""AsyncSignalClient: the same methods as SignalClient, each answering an awaitable. A call is numbered when the
method is called, not when it is awaited, so AsyncRun calls gathered apply in the order they were made."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import httpx

from rewardsignal.answer_types import Awaiting
from rewardsignal.artifacts import ARCHIVE_ACCEPT, check_download, unpack
from rewardsignal.calls import Call
from rewardsignal.client_base import ClientBase
from rewardsignal.runs import AsyncRun
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

# Answers that hand out runs: the async client learns the server's limits with them, so that an AsyncRun's
# calls are numbered (and a large batch split) when they are made, without a request of their own first.
RUN_OPERATIONS = {"CreateRun", "GetRun", "ListRuns"}


class AsyncSignalClient(ClientBase, Awaiting):
    _run_type = AsyncRun

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
        return self._send(self._order.number(call))

    def _run_all(self, calls: list[Call], combine: Callable[[list[Any]], Any]) -> Coroutine[Any, Any, Any]:
        for call in calls:
            self._order.number(call)

        async def together() -> Any:
            return combine(list(await asyncio.gather(*(self._send(call) for call in calls))))

        return together()

    async def _send(self, call: Call) -> Any:
        try:
            return await self._attempts(call)
        finally:
            self._order.answered(call)

    async def _attempts(self, call: Call) -> Any:
        attempt, began = 1, time.monotonic()
        while True:
            try:
                response = await self._http.post(self.url, json=request_body(call), headers=self._headers())
                answer = read_answer(call, response)
                if call.operation in RUN_OPERATIONS and self._limits is None:
                    self._limits = await self._send(Call("Limits", {}, "limits"))
                return answer
            except MAYBE_RETRIED as error:
                delay = retry_delay(call, attempt, error, time.monotonic() - began, self.max_attempts, self.retry_backoff)
                if delay is None:
                    if isinstance(error, httpx.HTTPError):
                        raise unreachable(self.url, error) from error
                    raise
            await asyncio.sleep(delay)
            attempt += 1

    async def _download(self, url: str, directory: str | os.PathLike[str]) -> Path:
        with tempfile.TemporaryFile() as archive:
            try:
                async with self._http.stream("GET", self._download_url(url), headers=self._headers() | ARCHIVE_ACCEPT) as response:
                    if response.status_code != 200:
                        await response.aread()
                    check_download(response, url)
                    async for chunk in response.aiter_bytes():
                        archive.write(chunk)
            except httpx.HTTPError as error:
                raise unreachable(self.url, error) from error
            return await asyncio.to_thread(unpack, archive, directory)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSignalClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
