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
from pathlib import Path
from typing import Any, TypedDict

from gpu_runtime.contract import CONTRACT_VERSION
from gpu_runtime.errors import FailedPrecondition

RUNTIME_SOCKET = "runtime.sock"  # in the data directory: one runtime per data directory
RUNTIME_LOCK = "runtime.lock"  # flock'd by the runtime serving the socket, so a second one refuses
LOCK_HELD = "runtime_lock"  # the `field` of that refusal, which a server that started a runtime waits out
# Answered by the transport's reader thread, never the tick, with a `Heartbeat`. A runtime that answers it is alive,
# however long its tick; one that does not is hung.
HEARTBEAT = "heartbeat"


class Heartbeat(TypedDict):
    tick: int  # the number of the last tick that ended
    tick_seconds: float  # how long the current tick has run (0 between ticks)


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), allow_nan=True).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("a protocol message must be a JSON object")
    return message


def runtime_socket(data_dir: str | Path) -> Path:
    return Path(data_dir).resolve() / RUNTIME_SOCKET


def runtime_lock(data_dir: str | Path) -> Path:
    return Path(data_dir).resolve() / RUNTIME_LOCK


def greeting(pid: int) -> dict[str, Any]:
    """The runtime's first line on every channel: it is up, who it is, and which contract it speaks."""
    return {"ready": True, "pid": pid, "contract": CONTRACT_VERSION}


def check_contract(greeted: dict[str, Any], where: str, fix: str) -> None:
    """Refuse a runtime that speaks another contract version (a detached runtime outlives its server, and a
    Modal deployment can lag the server's code): the calls' shapes would not agree."""
    version = greeted.get("contract", 1)  # runtimes before the typed contract sent none
    if version != CONTRACT_VERSION:
        raise FailedPrecondition(f"the runtime {where} speaks contract version {version}, this server {CONTRACT_VERSION}: "
                                 f"{fix}", field="runtime")
