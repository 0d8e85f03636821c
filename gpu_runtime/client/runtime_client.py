"""Drive a local runtime process (`python -m gpu_runtime.runtime_process`) from the server.

Pipelined: many requests are in flight at once, each with an id; a reader thread hands each answer
to the Future of its request, in whatever order the runtime sends them. Thread-safe: any number
of server tasks may `submit` at once. No torch here, directly or indirectly: the server imports this.

Two transports, one protocol: a private child over pipes (the default), or, with `shared=True`, the data
directory's runtime over its Unix socket, shared by every server process on the machine; when none
listens, one is started detached (`--socket --spawned`), and it exits once its last client has gone.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Any, cast

from gpu_runtime.client.connection import RuntimeConnection, read_message
from gpu_runtime.client.poison import POISON_DEATHS, CallKey, Deaths, call_key, poison_pill
from gpu_runtime.client.protocol import HEARTBEAT, LOCK_HELD, LineWriter, check_contract, encode, runtime_socket
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.contract.json_types import as_object
from gpu_runtime.errors import BadInput, FailedPrecondition, SignalError, WorkerFailed

PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # a checkout, or site-packages when installed
DEATHS_FILE = "runtime-deaths.json"  # in the data directory: the poison-pill count every server process shares
__all__ = ["POISON_DEATHS", "RuntimeClient", "call_key", "poison_pill"]
Answer = Future[Mapping[str, object]]  # a call's result object as the runtime wrote it; the caller's Call.result reads it
Chunks = Callable[[Mapping[str, object]], None]  # a streamed call's chunk handler


class RuntimeClient:
    def __init__(
        self,
        data_dir: str,
        device: str = "auto",
        options: RuntimeOptions | None = None,
        allow_downloads: bool = False,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        start_timeout: float = 300.0,
        stop_timeout: float = 30.0,
        shared: bool = False,
        threads: int | None = None,
    ) -> None:
        self.data_dir = str(Path(data_dir).resolve())  # the runtime may not share our working directory
        self.device = device
        self.options = options or RuntimeOptions()
        self.allow_downloads = allow_downloads
        self.python = python
        self.env = dict(env or {})  # laid over os.environ
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.shared = shared  # the data directory's runtime on its socket, not a child of our own
        self.threads = threads  # torch's CPU threads in the runtime; None: torch's own default
        self._process: subprocess.Popen[bytes] | RuntimeConnection | None = None
        self._spawned: list[subprocess.Popen[bytes]] = []  # detached runtimes we started, reaped once they exit
        # request id → (method, its future, the process it was sent to: only that one's death fails it, the call's key)
        self._pending: dict[int, tuple[str, Answer, Any, CallKey | None]] = {}
        self._progress: dict[int, Chunks] = {}  # streamed calls' chunk handlers
        # A call's key → the runtime deaths in a row it was in flight through (answered: forgotten); the data
        # directory's runtime is every server process's, and so is the count (poison.py).
        self._deaths = Deaths(Path(self.data_dir) / DEATHS_FILE if shared else None)
        self._ids = itertools.count(1)
        # Two locks, neither held across I/O to the runtime: `_lock` for starting and stopping it (a start may wait
        # for the runtime's ready line), `_table` for the pending table. Lines go out through `_writer`'s thread, so
        # a runtime that stops reading never blocks the reader, the heartbeat or the watchdog.
        self._lock = threading.RLock()
        self._table = threading.Lock()
        self._writer: LineWriter | None = None
        self.generation = 0  # bumped by every spawn, so a caller can tell "the worker I called" from a new one

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def start(self) -> None:
        """Spawn the runtime and wait until it says it is ready (no model is loaded yet). Idempotent."""
        with self._lock:
            if not self.alive:
                self._stop(graceful=False)
                self._spawn()

    def restart(self, generation: int | None = None) -> None:
        """Replace the runtime; with `generation`, only if that one is still the current one (many callers may ask)."""
        with self._lock:
            if generation is not None and generation != self.generation and self.alive:
                return
            self._stop(graceful=True)
            self._spawn()

    def close(self) -> None:
        """Stop the runtime: close its stdin so it snapshots and exits, then kill it after `stop_timeout`."""
        with self._lock:
            self._stop(graceful=True)

    def __enter__(self) -> RuntimeClient:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls ----------------------------------------------------------------------------

    def submit(self, method: str, progress: Chunks | None = None, **params: Any) -> Future[dict[str, Any]]:
        """`send` for tests and benchmarks: they index the wire's answer as plain data, as json.loads made it."""
        return cast("Future[dict[str, Any]]", self.send(method, progress, **params))

    def send(self, method: str, progress: Chunks | None = None, **params: Any) -> Answer:
        """Send one call; the Future holds its result, or the SignalError the runtime sent, or WorkerFailed.
        `progress` gets a streamed call's chunks, on the reader thread, before the Future is done."""
        future: Answer = Future()
        key = call_key(params)
        with self._table:
            poisoned, request_id = self._deaths.poisoned(key), next(self._ids)
        if poisoned:
            future.set_exception(poison_pill(method))  # not even a fresh runtime gets it again
            return future
        line = encode({"id": request_id, "method": method, "params": params})  # outside every lock: it may be large
        with self._lock:
            if not self.alive:
                self._stop(graceful=False)
                self._spawn()
            process, writer = self._process, self._writer
        assert process is not None and writer is not None
        writer.wait_for_room()  # back-pressure on this caller alone, holding no lock
        with self._table:
            self._pending[request_id] = (method, future, process, key)
            if progress is not None:
                self._progress[request_id] = progress
            # Queued in the order callers submit: a run's next call (its turn ends here) goes out after this one.
            sent = writer.put(line, request_id)
        if not sent:
            self._fail_unsent([request_id], "was not sent")
        return future

    def heartbeat(self) -> Answer:
        """Ask the runtime it is connected to (never a new one) whether it is alive: its reader thread answers,
        however long the current tick runs. WorkerFailed if there is none."""
        future: Answer = Future()
        process, writer = self._process, self._writer  # no lifecycle lock: a start or a stop may hold it for seconds
        if process is None or writer is None or process.poll() is not None:
            future.set_exception(WorkerFailed("no runtime is running"))
            return future
        with self._table:
            request_id = next(self._ids)
            self._pending[request_id] = (HEARTBEAT, future, process, None)
            sent = writer.put(encode({"id": request_id, "method": HEARTBEAT, "params": {}}), request_id, urgent=True)
        if not sent:
            self._fail_unsent([request_id], "could not be sent: the runtime's connection is gone")
        return future

    def _fail_unsent(self, request_ids: list[int], why: str) -> None:
        """Calls whose lines never reached the runtime (its input broke or closed): they fail, typed, unapplied."""
        with self._table:
            entries = [(rid, self._pending.pop(rid, None)) for rid in request_ids]
            for rid, _ in entries:
                self._progress.pop(rid, None)
        for _, entry in entries:
            if entry is not None and entry[1].set_running_or_notify_cancel():
                entry[1].set_exception(WorkerFailed(f"worker process is gone; {entry[0]} {why}"))

    def forget(self, future: Answer) -> None:
        """Drop an unanswered request (a heartbeat that timed out) so its entry does not linger."""
        with self._table:
            for request_id, entry in list(self._pending.items()):
                if entry[1] is future:
                    del self._pending[request_id]

    @property
    def started_by_us(self) -> bool:
        """Whether the runtime in use is a process this client spawned (a child, or a detached one it started), which
        it may kill and replace; a runtime someone started with `signal runtime` is never killed."""
        process = self._process
        if isinstance(process, subprocess.Popen):
            return True
        return process is not None and any(p.pid == process.pid and p.poll() is None for p in self._spawned)

    def kill(self) -> None:
        """SIGKILL the runtime in use (only one this client started): its calls fail WORKER_FAILED, the next respawns.
        Takes no lock: the watchdog calls it when a start, a stop or the runtime itself is stuck."""
        process = self._process
        if process is None or not self.started_by_us:
            return
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def call(self, method: str, timeout: float | None = None, **params: Any) -> dict[str, Any]:
        """Blocking form of `submit`, for tests, benchmarks and the CLI: they index the wire's answer as plain data."""
        return self.submit(method, **params).result(timeout)

    # ---- internals ------------------------------------------------------------------------

    def command(self, extra: list[str] | None = None) -> list[str]:
        command = [self.python, "-m", "gpu_runtime.runtime_process", "--data-dir", self.data_dir, "--device", self.device]
        command += ["--options", encode(self.options.to_dict()).decode().strip()]
        command += ["--threads", str(self.threads)] if self.threads else []
        return command + (["--allow-downloads"] if self.allow_downloads else []) + (extra or [])

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        # The runtime must import this very gpu_runtime, whatever the server's working directory.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def _launch(self, extra: list[str], stdin: Any, timeout: float) -> subprocess.Popen[bytes]:
        """Start the runtime and wait for its ready line; the SignalError it sent if it refused."""
        log: IO[bytes] | None = open(self.log_path, "ab") if self.log_path else None
        try:
            # stderr goes to our stderr or the log file, never a pipe nobody drains.
            # A session of its own: Ctrl-C on the server does not kill a call mid-step.
            process = subprocess.Popen(
                self.command(extra), stdin=stdin, stdout=subprocess.PIPE, stderr=log,
                env=self.environment(), start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        message = read_message(process.stdout) if ready else None
        if not message or not message.get("ready"):
            process.kill()
            process.wait()
            if message is None:
                raise WorkerFailed(f"worker did not become ready within {self.start_timeout:.0f} s")
            raise SignalError.from_dict(as_object(message.get("error") or {"message": "worker refused to start"}, "error"))
        try:
            check_contract(message, f"this server started (pid {process.pid})", "reinstall: the server and its runtime "
                           "come from one checkout")
        except FailedPrecondition:
            process.kill()
            process.wait()
            raise
        return process

    def _connect(self) -> RuntimeConnection:
        """The data directory's runtime over its socket, started (detached) when none listens."""
        path = runtime_socket(self.data_dir)
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                return RuntimeConnection.open(path, deadline)
            except (FileNotFoundError, ConnectionError):
                pass  # nobody listens (none runs, one is stopping, or it died with our connection in its backlog)
            if time.monotonic() > deadline:
                raise WorkerFailed(f"no runtime answered on {path} within {self.start_timeout:.0f} s")
            self._spawned = [p for p in self._spawned if p.poll() is None]
            try:
                spawned = self._launch(["--socket", "--spawned"], subprocess.DEVNULL, max(deadline - time.monotonic(), 1))
            except FailedPrecondition as refusal:
                if refusal.field != LOCK_HELD:
                    raise
                time.sleep(0.1)  # another runtime holds the lock (starting, or finishing its last calls): retry
                continue
            assert spawned.stdout is not None
            spawned.stdout.close()
            self._spawned.append(spawned)

    def _spawn(self) -> None:
        process: subprocess.Popen[bytes] | RuntimeConnection
        if self.shared:
            process = self._connect()
        else:
            process = self._launch([], subprocess.PIPE, self.start_timeout)
        assert process.stdin is not None
        self._writer = LineWriter(process.stdin, str(process.pid), lambda ids: self._fail_unsent(ids, "was not sent"))
        self._process = process
        self.generation += 1
        threading.Thread(target=self._read_answers, args=(process,), name=f"worker-reader-{process.pid}",
                         daemon=True).start()

    def _read_answers(self, process: subprocess.Popen[bytes] | RuntimeConnection) -> None:
        assert process.stdout is not None
        while (message := read_message(process.stdout)) is not None:
            request_id = message.get("id")
            rid = request_id if type(request_id) is int else 0  # ids count from 1: an answer without one finds nothing
            if "chunk" in message:  # a streamed call's progress: its entry stays until the answer
                with self._table:
                    handler = self._progress.get(rid)
                if handler is not None:
                    handler(as_object(message["chunk"], "chunk"))
                continue
            with self._table:
                self._progress.pop(rid, None)
                entry = self._pending.pop(rid, None)
                if entry is not None:
                    self._deaths.answered(entry[3])  # its deaths in a row are over
            if entry is None:
                print(f"gpu_runtime runtime: answer for unknown request {message.get('id')!r}", file=sys.stderr)
                continue
            future = entry[1]
            if not future.set_running_or_notify_cancel():
                continue  # the caller gave up on it (cancelled): the answer has nobody to go to
            try:
                if "error" in message:
                    future.set_exception(SignalError.from_dict(as_object(message["error"], "error")))
                else:
                    future.set_result(as_object(message["result"], "result"))
            except BadInput as malformed:  # not an object: no runtime of ours writes one, and the call says so
                future.set_exception(malformed)
        # End of stream: the process is gone; everything still pending fails, typed.
        try:
            code = process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        with self._table:
            # Only calls sent to this process: a call may already be waiting on its replacement.
            failed = [(rid, entry) for rid, entry in self._pending.items() if entry[2] is process]
            for rid, _ in failed:
                del self._pending[rid]
                self._progress.pop(rid, None)
            poisoned = self._deaths.died(key for _, (_, _, _, key) in failed if key is not None)
        for _, (method, future, _, key) in failed:
            if not future.set_running_or_notify_cancel():
                continue
            # The log's path stays on the server: this message travels to API clients.
            future.set_exception(poison_pill(method) if key in poisoned else
                                 WorkerFailed(f"worker process {_ended(process, code)} during {method}"))
        if failed:
            print(f"gpu_runtime runtime (pid {process.pid}) {_ended(process, code)}; its log: {self.log_path or 'stderr'}",
                  file=sys.stderr)

    def _stop(self, graceful: bool) -> None:
        process, self._process = self._process, None
        writer, self._writer = self._writer, None
        if process is None:
            return
        if process.poll() is None and graceful and writer is not None:
            writer.close()  # EOF once the queued lines are out: the runtime finishes what it has, snapshots, exits
            try:
                process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass
        if process.poll() is None:
            process.kill()
        process.wait()
        if writer is not None:
            writer.close()
            writer.join(1.0)  # a writer stuck on a dead pipe ends when the pipe does
        if process.stdin is not None:
            try:
                process.stdin.close()
            except (OSError, ValueError):
                pass


def _ended(process: subprocess.Popen[bytes] | RuntimeConnection, code: int) -> str:
    # Clients see this in WORKER_FAILED: the pid stays in the server's log (the reader thread's name carries it).
    if isinstance(process, RuntimeConnection):
        return "closed its connection"
    return f"exited with code {code}"
