"""The worker's wire format: one JSON object per line, each way.

request  {"id": 7, "method": "forward_backward", "params": {...}}
response {"id": 7, "result": {...}}  or  {"id": 7, "error": SignalError.to_dict()}
progress {"id": 7, "chunk": {...}}  (a streamed sample's SampleChunk, any number before its response)
first line from the worker: {"ready": true, "pid": 123, "contract": 2}  (or {"ready": false, "error": {...}})
The same lines travel over a pipe (a child runtime) or the data directory's Unix socket (`signal runtime`),
where the runtime greets each connection with the ready line. No torch here: the server imports this module.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from gpu_runtime.contract import CONTRACT_VERSION, Call, Result, parse_call
from gpu_runtime.contract.json_types import COMPACT, JSON, JSONObject
from gpu_runtime.errors import BadInput, FailedPrecondition, SignalError

RUNTIME_SOCKET = "runtime.sock"  # in the data directory: one runtime per data directory
RUNTIME_LOCK = "runtime.lock"  # flock'd by the runtime serving the socket, so a second one refuses
LOCK_HELD = "runtime_lock"  # the `field` of that refusal, which a server that started a runtime waits out
# Answered by the transport's reader thread, never the tick, with a `Heartbeat`. A runtime that answers it is alive,
# however long its tick; one that does not is hung.
HEARTBEAT = "heartbeat"


class Heartbeat(TypedDict):
    tick: int  # the number of the last tick that ended
    tick_seconds: float  # how long the current tick has run (0 between ticks)


def encode(message: Mapping[str, JSON]) -> bytes:
    return COMPACT.encode(message).encode() + b"\n"  # NaN and Infinity as json.dumps writes them (allow_nan)


def decode(line: bytes) -> Mapping[str, object]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a protocol message must be a JSON object")
    return message


def split_ticket(params: Mapping[str, object]) -> tuple[dict[str, object], int | None]:
    """The call's arguments without its `ticket`, and the ticket (a positive integer, or None)."""
    ticket = params.get("ticket")
    if ticket is not None and (type(ticket) is not int or ticket < 1):
        raise BadInput(f"ticket must be a positive integer, got {ticket!r}", field="ticket")
    return {k: v for k, v in params.items() if k != "ticket"}, ticket


def read_call(method: Any, params: Any) -> tuple[Call, int | None]:
    """A request's call, typed and validated, and its ticket (the call's place in its run's order across servers):
    what the runtime's edges (runtime_process, modal_app) hand the engine."""
    if not isinstance(params, dict):
        raise BadInput("params must be an object of the method's arguments", field="params")
    args, ticket = split_ticket(params)
    return parse_call(method, args), ticket


def answer_message(answer: Result | SignalError) -> JSONObject:
    """An engine's answer as the wire carries it: {"result": …} or {"error": …}."""
    if isinstance(answer, SignalError):
        return {"error": answer.to_dict()}
    return {"result": answer.to_dict()}


def runtime_socket(data_dir: str | Path) -> Path:
    return Path(data_dir).resolve() / RUNTIME_SOCKET


def runtime_lock(data_dir: str | Path) -> Path:
    return Path(data_dir).resolve() / RUNTIME_LOCK


def greeting(pid: int) -> JSONObject:
    """The runtime's first line on every channel: it is up, who it is, and which contract it speaks."""
    return {"ready": True, "pid": pid, "contract": CONTRACT_VERSION}


def check_contract(greeted: Mapping[str, object], where: str, fix: str) -> None:
    """Refuse a runtime that speaks another contract version (a detached runtime outlives its server, and a
    Modal deployment can lag the server's code): the calls' shapes would not agree."""
    version = greeted.get("contract", 1)  # runtimes before the typed contract sent none
    if version != CONTRACT_VERSION:
        raise FailedPrecondition(f"the runtime {where} speaks contract version {version}, this server {CONTRACT_VERSION}: "
                                 f"{fix}", field="runtime")


# What a writer holds queued before its callers wait for room: enough for a few large batches, never the whole
# memory. Waiting happens in the caller, outside every lock, so a full pipe never blocks a heartbeat or a reader.
WRITER_QUEUE_BYTES = 64 * 1024 * 1024


class LineWriter:
    """Protocol lines to one stream, written by a thread of their own, in the order they were queued.

    Neither side of the channel ever writes while holding a lock another thread needs: a peer that stops reading
    (its own reader blocked writing to us) would otherwise stall both processes for good. `urgent` lines
    (heartbeats and their answers) go ahead of queued ones, between whole lines. `written` runs once a line is out
    (or could not go); `failed` gets the ids of the lines that could not be written once the stream breaks."""

    def __init__(self, stream: Any, name: str, failed: Any = None, limit_bytes: int = WRITER_QUEUE_BYTES) -> None:
        self.stream = stream
        self.limit_bytes = limit_bytes
        self._failed = failed
        self._lines: deque[tuple[Any, bytes, Any]] = deque()
        self._urgent: deque[tuple[Any, bytes, Any]] = deque()
        self._queued_bytes = 0
        self._closing = False
        self.broken = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"writer-{name}", daemon=True)
        self._thread.start()

    def put(self, line: bytes, request_id: Any = None, urgent: bool = False, written: Any = None) -> bool:
        """Queue one whole line; False when the stream has broken or closed (nothing will be written)."""
        with self._changed:
            if self.broken or self._closing:
                return False
            (self._urgent if urgent else self._lines).append((request_id, line, written))
            self._queued_bytes += len(line)
            self._changed.notify_all()
        return True

    def wait_for_room(self, timeout: float | None = None) -> None:
        """Back-pressure for a caller with a large line: wait (holding no lock) until the queue has drained below its
        bound. The line itself is never refused for size; the server bounds request bodies."""
        with self._changed:
            self._changed.wait_for(lambda: self._queued_bytes < self.limit_bytes or self.broken, timeout)

    def close(self) -> None:
        """End of input for the peer once every queued line is out: the stream is closed after the last."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _next(self) -> tuple[Any, bytes, Any] | None:
        with self._changed:
            self._changed.wait_for(lambda: bool(self._urgent or self._lines or self._closing))
            if self._urgent:
                return self._urgent.popleft()
            if self._lines:
                return self._lines.popleft()
            return None

    def _run(self) -> None:
        while (item := self._next()) is not None:
            request_id, line, written = item
            try:
                rest = memoryview(line)
                while rest:  # a raw socket or pipe may take part of a large line at a time
                    count = self.stream.write(rest)
                    rest = rest[count:] if count is not None else rest[:0]
                self.stream.flush()
            except (OSError, ValueError):  # the peer has gone (ValueError: the file was closed under us)
                self._break(item)
                return
            with self._changed:
                self._queued_bytes -= len(line)
                self._changed.notify_all()
            if written is not None:
                written()
        try:
            self.stream.close()
        except OSError:
            pass

    def _break(self, item: tuple[Any, bytes, Any]) -> None:
        with self._changed:
            self.broken = True
            lost = [item, *self._urgent, *self._lines]
            self._urgent.clear()
            self._lines.clear()
            self._queued_bytes = 0
            self._changed.notify_all()
        for _, _, written in lost:
            if written is not None:
                written()
        if self._failed is not None:
            self._failed([request_id for request_id, _, _ in lost if request_id is not None])
