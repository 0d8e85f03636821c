"""The data directory's runtime over its Unix socket, shaped like the parts of a child process (`Popen`) that
the runtime client uses, so one client drives either; and reading one protocol message off a stream."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpu_runtime.client.protocol import check_contract, decode
from gpu_runtime.contract.json_types import get_int
from gpu_runtime.errors import FailedPrecondition


class RuntimeConnection:
    """A connection to the runtime serving a data directory's socket, with the parts of Popen the client uses:
    closing `stdin` half-closes it (the runtime answers what it has, then closes its side), `poll` is None
    until then, `pid` is the runtime's."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.stdin = _HalfCloser(sock)
        self.stdout = _EndWatcher(sock, self)
        self.returncode: int | None = None
        self.ended = threading.Event()

    @classmethod
    def open(cls, path: Path, deadline: float) -> RuntimeConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            # A runtime still loading its engine has accepted nothing yet: its greeting says it is up.
            ready, _, _ = select.select([sock], [], [], max(deadline - time.monotonic(), 0))
            greeting = read_message(sock.makefile("rb", buffering=0)) if ready else None
        except BaseException:
            sock.close()
            raise
        if not greeting or not greeting.get("ready"):
            sock.close()
            raise ConnectionRefusedError(f"the runtime on {path} closed the connection before greeting")
        try:
            check_contract(greeting, f"on {path} (pid {greeting['pid']})",
                           f"stop it (kill {greeting['pid']}) and start `signal runtime` from this checkout, or let "
                           "`signal serve` start one")
        except FailedPrecondition:
            sock.close()
            raise
        return cls(sock, get_int(greeting, "pid"))

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired("runtime connection", timeout or 0)
        return self.returncode or 0

    def kill(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end at once
        except OSError:
            self.end()

    def end(self) -> None:
        if self.returncode is None:
            self.returncode = 0
            self.sock.close()
        self.ended.set()


class _HalfCloser:
    def __init__(self, sock: socket.socket) -> None:
        self.file = sock.makefile("wb")
        self.sock = sock

    def write(self, data: bytes) -> int:
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.shutdown(socket.SHUT_WR)  # end of our input: the runtime answers what we sent, then closes
        except OSError:
            pass


class _EndWatcher:
    def __init__(self, sock: socket.socket, connection: RuntimeConnection) -> None:
        self.file = sock.makefile("rb")
        self.connection = connection

    def readline(self) -> bytes:
        try:
            line = self.file.readline()
        except OSError:
            line = b""
        if not line:
            self.connection.end()
        return line


def read_message(stream: Any) -> Mapping[str, object] | None:
    """The next protocol message, or None at end of stream."""
    while True:
        line = stream.readline()
        if not line:
            return None
        try:
            return decode(line)
        except ValueError:
            # Only the runtime writes here; a stray line is reported, not fatal.
            print(f"gpu_runtime runtime: ignoring non-protocol line {line[:200]!r}", file=sys.stderr)
