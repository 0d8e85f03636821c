"""The poison-pill guard (issue 19 §1): a call in flight through POISON_DEATHS runtime deaths in a row is not sent
again; it answers WORKER_FAILED with `retryable: false`.

The count is kept where every client of one runtime meets: with a `path` (the data directory's), in a small JSON
file that each server process reads when it changed (one stat per call) and rewrites, under a file lock, only when a
runtime dies with calls in flight or such a call is answered. An SDK's retry lands on whichever server process
accepts its connection (`uvicorn --workers N`), so a count per process would let a poison pill kill the runtime
once more in each. Without a path (a private runtime), the count lives in memory. Torch-free: the server imports it.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from gpu_runtime.errors import WorkerFailed

POISON_DEATHS = 2  # a call in flight through this many runtime deaths in a row is not sent again (a poison pill)
REMEMBERED_DEATHS = 4096  # calls whose deaths are remembered, the oldest forgotten first

CallKey = tuple[str, str, str]  # (run id, user id, request id): one client's call, however often it is sent


def call_key(params: Mapping[str, object]) -> CallKey | None:
    """The key of a call the client may send again with the same request id; None for calls without one."""
    request_id = params.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        return None
    return (str(params.get("run_id") or ""), str(params.get("user_id") or ""), request_id)


def poison_pill(method: str) -> WorkerFailed:
    return WorkerFailed(f"the runtime died twice in a row with this {method} in flight; it is not sent again (a call "
                        "that crashes the runtime would take it down for everyone each time): change the call, or "
                        "report it", retryable=False)


class Deaths:
    """Each call key's runtime deaths in a row (answered: forgotten). Thread-safe; with `path`, shared by processes."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._seen: tuple[int, int] | None = None  # the file's (inode, mtime) when last read
        self._lock = threading.Lock()

    def poisoned(self, key: CallKey | None) -> bool:
        """Whether `key` was in flight through POISON_DEATHS deaths in a row: it is not to be sent again."""
        if key is None:
            return False
        with self._lock:
            self._refresh()
            return self._counts.get(_name(key), 0) >= POISON_DEATHS

    def died(self, keys: Iterable[CallKey]) -> set[CallKey]:
        """Count one runtime death for each of `keys` (the calls in flight in it); those that are now poison pills."""
        keys = set(keys)
        if not keys:
            return set()
        with self._lock, self._shared():
            for key in keys:
                name = _name(key)
                self._counts[name] = self._counts.pop(name, 0) + 1
            while len(self._counts) > REMEMBERED_DEATHS:
                self._counts.popitem(last=False)
            self._write()
            poisoned = {key for key in keys if self._counts[_name(key)] >= POISON_DEATHS}
        for key in poisoned:
            print(f"gpu_runtime runtime: call {key} was in flight through {POISON_DEATHS} runtime deaths in a row; it "
                  "is not sent again", file=sys.stderr)
        return poisoned

    def answered(self, key: CallKey | None) -> None:
        """`key` was answered: its deaths in a row are over (a write only for a call that had died with a runtime)."""
        if key is None:
            return
        with self._lock:
            self._refresh()  # a death another process counted is ended by this answer too
            if _name(key) not in self._counts:  # the usual case: nothing written
                return
            with self._shared():
                if self._counts.pop(_name(key), None) is not None:
                    self._write()

    # ---- the shared file ---------------------------------------------------------------------

    @contextmanager
    def _shared(self) -> Iterator[None]:
        """The file locked against other processes, and read afresh (under self._lock)."""
        if self.path is None:
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._seen = None
                self._refresh()
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _refresh(self) -> None:
        if self.path is None:
            return
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self._counts, self._seen = OrderedDict(), None
            return
        seen = (stat.st_ino, stat.st_mtime_ns)  # replaced whole on every write: a new inode
        if seen == self._seen:
            return
        try:
            counts = json.loads(self.path.read_text())
        except (OSError, ValueError):  # unreadable: counted afresh, as a server that never saw a death would
            counts = {}
        self._counts = OrderedDict((str(k), int(v)) for k, v in counts.items()) if isinstance(counts, dict) else \
            OrderedDict()
        self._seen = seen

    def _write(self) -> None:
        if self.path is None:
            return
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(self._counts))
        os.replace(temporary, self.path)  # whole or not at all: a reader never sees half a file
        self._seen = None


def _name(key: CallKey) -> str:
    return json.dumps(list(key))
