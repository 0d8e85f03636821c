"""Drive a local worker process (`python -m gpu_runtime.worker`) from the server.

No torch here, directly or indirectly: the server imports this module and must stay light.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from gpu_runtime.errors import SignalError, WorkerFailed
from gpu_runtime.protocol import decode, encode

REPO_ROOT = str(Path(__file__).resolve().parent.parent)


class WorkerClient:
    """Blocking, thread-safe client: one call at a time (a lock serialises them)."""

    def __init__(
        self,
        data_dir: str,
        device: str = "auto",
        max_batch_size: int = 64,
        keep_steps: int = 3,
        allow_downloads: bool = False,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        log_path: str | None = None,
        start_timeout: float = 300.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.data_dir = str(data_dir)
        self.device = device
        self.max_batch_size = max_batch_size
        self.keep_steps = keep_steps
        self.allow_downloads = allow_downloads
        self.python = python
        self.env = dict(env or {})  # laid over os.environ
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._dead = False
        self._next_id = 0
        self._lock = threading.RLock()

    # ---- lifecycle -----------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._process is not None and not self._dead and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.alive and self._process is not None else None

    def start(self) -> None:
        """Spawn the worker and wait until it says it is ready (no model is loaded yet). Idempotent."""
        with self._lock:
            if self.alive:
                return
            self._stop(graceful=False)
            self._spawn()

    def restart(self) -> None:
        """Stop this worker (killing it if need be) and start a fresh one; runs restore from disk lazily."""
        with self._lock:
            self._stop(graceful=True)
            self._spawn()

    def close(self) -> None:
        """Stop the worker: close its stdin so it exits, then kill it after `stop_timeout`."""
        with self._lock:
            self._stop(graceful=True)

    def __enter__(self) -> "WorkerClient":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls ----------------------------------------------------------------------------

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Run one engine method in the worker; raise the SignalError it sent, or WorkerFailed."""
        with self._lock:
            if not self.alive:
                self.start()
            assert self._process is not None and self._process.stdin is not None
            self._next_id += 1
            request_id = self._next_id
            try:
                self._process.stdin.write(encode({"id": request_id, "method": method, "params": params}))
                self._process.stdin.flush()
            except (BrokenPipeError, OSError):
                raise self._failed(method) from None
            response = self._read_message(method)
            if response.get("id") != request_id:
                self._stop(graceful=False)
                raise WorkerFailed(f"worker answered request {response.get('id')} while {request_id} ({method}) was expected")
            if "error" in response:
                raise SignalError.from_dict(response["error"])
            return response["result"]

    # ---- internals ------------------------------------------------------------------------

    def _command(self) -> list[str]:
        command = [self.python, "-m", "gpu_runtime.worker", "--data-dir", self.data_dir, "--device", self.device]
        command += ["--max-batch-size", str(self.max_batch_size), "--keep-steps", str(self.keep_steps)]
        return command + (["--allow-downloads"] if self.allow_downloads else [])

    def _environment(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        # The worker must import this very gpu_runtime, whatever the server's working directory.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def _spawn(self) -> None:
        log: IO[bytes] | None = open(self.log_path, "ab") if self.log_path else None
        try:
            # stderr goes to our stderr or the log file, never a pipe nobody drains.
            # A session of its own: Ctrl-C on the server does not kill a call mid-step.
            self._process = subprocess.Popen(
                self._command(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self._environment(),
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        finally:
            if log is not None:
                log.close()
        self._dead = False
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], self.start_timeout)
        if not ready:
            self._stop(graceful=False)
            raise WorkerFailed(f"worker did not become ready within {self.start_timeout:.0f} s")
        message = self._read_message("start")
        if not message.get("ready"):
            self._stop(graceful=False)
            raise SignalError.from_dict(message.get("error") or {"message": "worker refused to start"})

    def _read_message(self, method: str) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        while True:
            line = self._process.stdout.readline()
            if not line:
                raise self._failed(method)
            try:
                return decode(line)
            except ValueError:
                # Only the worker writes here; a stray line is reported, not fatal.
                print(f"gpu_runtime worker: ignoring non-protocol line {line[:200]!r}", file=sys.stderr)

    def _failed(self, method: str) -> WorkerFailed:
        assert self._process is not None
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait()
        self._dead = True
        # The log's path stays on the server: this message travels to API clients.
        print(f"gpu_runtime worker exited with code {code} during {method}; its log: {self.log_path or 'stderr'}",
              file=sys.stderr)
        return WorkerFailed(f"worker process exited with code {code} during {method}")

    def _stop(self, graceful: bool) -> None:
        process, self._process = self._process, None
        self._dead = False
        if process is None:
            return
        if process.poll() is None and graceful and process.stdin is not None:
            try:
                process.stdin.close()  # EOF ends the worker's request loop
                process.wait(timeout=self.stop_timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
