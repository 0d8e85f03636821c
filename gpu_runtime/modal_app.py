"""The Modal transport: one warm container per pool, running the same Engine as the local runtime process.

    modal deploy -m gpu_runtime.modal_app        # once, and after every upgrade

A pool is (base model, GPU configuration, quantization), named by its key (gpu_runtime.client.allocation.pool_key).
The server looks the class up by name, picks the pool's GPU with `with_options(gpu=...)`, and calls
`Pool(pool=key, options=...).call.remote.aio(method, params)`. Each distinct key is its own container
(`max_containers=1`): every run on that pool shares one base and its co-batched passes.

This is a thin shell. The container's engine thread runs ticks (`serve_forever`), the methods (sync:
under `@modal.concurrent` Modal runs them in threads) submit to it and wait, and the Volume is
committed once per tick, after the journal fsyncs and before any answer of that tick goes out: an
acknowledged forward_backward or optim_step is on the Volume. Snapshots an eviction writes between calls
are committed at once. Calls that write files the journal does not cover (create_run, save_state, load_state,
delete_checkpoint, close_run, delete_run) commit before they answer.

Offline (`modal.is_local()`: tests run the class through `.local()`, with no Volume and no credentials)
a commit only records what it covers, so a test can check that every acknowledged record was committed
first. torch and the engine are imported inside the container's methods only; this module never
imports the web stack.
"""

# No `from __future__ import annotations`: Modal reads the class parameters' annotations as real types.
import json
import os
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import modal

from gpu_runtime.client.modal_names import APP_NAME, HF_SECRET_NAME, VOLUME_NAME
from gpu_runtime.client.protocol import answer_message, read_call
from gpu_runtime.contract.json_types import JSONObject, as_json_object
from gpu_runtime.errors import SignalError

VOLUME_PATH = "/data"  # runs/, models/ (safetensors cache) and hf-cache/: the data directory

# The container's own settings (read at `@modal.enter`): offline tests point these at a temporary directory and CPU.
DATA_DIR_ENV = "SIGNAL_MODAL_DATA_DIR"
DEVICE_ENV = "SIGNAL_MODAL_DEVICE"
DOWNLOADS_ENV = "SIGNAL_MODAL_ALLOW_DOWNLOADS"  # "0": no Hub downloads (a container has the Hub; offline tests do not)

# Fixed at deploy time (with_options carries only the GPU): an idle pool keeps its base warm this long, then scales down.
SCALEDOWN_WINDOW_S = int(os.environ.get("SIGNAL_MODAL_SCALEDOWN_WINDOW_S", "600"))
STARTUP_TIMEOUT_S = 30 * 60  # a first start downloads the base's weights into the Volume
CALL_TIMEOUT_S = 60 * 60  # one call (a long sample, a merged save_state) may take this long
MAX_CONCURRENT_INPUTS = 64  # calls in flight in one container: the scheduler co-batches them

# The same pins as pyproject.toml's runtime dependencies (a test checks they agree).
IMAGE_PACKAGES = (
    "torch==2.13.0",
    "transformers==5.24.0",
    "peft==0.21.2",
    "bitsandbytes==0.50.2",
    "accelerate==1.16.0",
    "safetensors==0.8.0",
    "gguf==0.19.0",
    "sentencepiece==0.2.3",
    "tqdm==4.70.1",
    "numpy==2.4.6",
    "huggingface_hub==2.4.0",
)

# Files written outside the journal: committed before the call answers.
COMMIT_AFTER = frozenset({"create_run", "save_state", "load_state", "delete_checkpoint", "close_run", "delete_run"})
JOURNALED = frozenset({"forward_backward", "optim_step"})

image = (
    modal.Image.debian_slim(python_version="3.11")
    .pip_install(*IMAGE_PACKAGES)
    .env({"HF_HOME": f"{VOLUME_PATH}/hf-cache", "PYTHONUNBUFFERED": "1"})
    .add_local_python_source("gpu_runtime")
)
volume = modal.Volume.from_name(VOLUME_NAME, create_if_missing=True)
hf_secret = modal.Secret.from_name(HF_SECRET_NAME)

app = modal.App(APP_NAME)


class VolumeCommits:
    """Commits the Volume; offline (no Volume there) it only records what each commit covered."""

    def __init__(self, offline: bool) -> None:
        self.offline = offline
        self.count = 0
        self.journals: dict[str, int] = {}  # run → journal records covered by the last commit
        self.acknowledged: list[tuple[str, str, int]] = []  # offline: (run, method, its records committed at the answer)
        self.engine: Any = None
        self._lock = threading.Lock()
        self._committing = threading.Lock()  # one commit RPC at a time (the engine thread's and the methods')

    def commit(self) -> None:
        with self._committing:
            runs = dict(self.engine.residency.runs) if self.engine is not None else {}
            covered = {run_id: state.seq for run_id, state in runs.items()}  # on disk, fsync'd, as the commit begins
            if not self.offline:
                volume.commit()
            with self._lock:
                self.count += 1
                self.journals.update(covered)

    def acknowledge(self, run_id: str, method: str) -> None:
        """Offline only: note how many of the run's records were committed when this call was answered."""
        with self._lock:
            self.acknowledged.append((run_id, method, self.journals.get(run_id, 0)))


@app.cls(
    image=image, volumes={VOLUME_PATH: volume}, secrets=[hf_secret],
    max_containers=1,  # one warm container per pool: its runs share the base
    retries=0,  # a re-run input is harmless (request ids) but a lost container is the caller's to retry
    scaledown_window=SCALEDOWN_WINDOW_S, startup_timeout=STARTUP_TIMEOUT_S, timeout=CALL_TIMEOUT_S,
)
@modal.concurrent(max_inputs=MAX_CONCURRENT_INPUTS)
class Pool:
    pool: str = modal.parameter()  # the pool key: every run on it shares this container
    options: str = modal.parameter(default="{}")  # RuntimeOptions as canonical JSON (the server's settings)

    @modal.enter()
    def start(self) -> None:
        # The base loads now (offline: with its first run); runs restore lazily from the Volume, on their first call.
        from gpu_runtime.client.allocation import PoolKey
        from gpu_runtime.contract import RuntimeOptions
        from gpu_runtime.engine.engine import Engine

        self.commits = VolumeCommits(offline=modal.is_local())
        # A pool on N GPUs starts N ranks now, kept for the container's life (docs/MULTIGPU.md): rank i on GPU i.
        ranks = PoolKey.parse(self.pool).gpu.count
        self.engine = Engine(
            os.environ.get(DATA_DIR_ENV, VOLUME_PATH),
            os.environ.get(DEVICE_ENV, "auto"),
            RuntimeOptions.from_dict({**json.loads(self.options), "local_ranks": ranks}),
            allow_downloads=os.environ.get(DOWNLOADS_ENV, "1") != "0",
            after_sync=self.commits.commit,
        )
        self.commits.engine = self.engine
        if not self.commits.offline:
            self._load_base()
        self.ticks = threading.Thread(target=self.engine.serve_forever, name=f"pool {self.pool}", daemon=True)
        self.ticks.start()

    @modal.method()
    def call(self, method: str, params: Mapping[str, object]) -> JSONObject:
        """One engine call: {"result": ...} or {"error": {type, code, message, field}}, as plain JSON data."""
        answer = self._submit(method, params)
        if method in COMMIT_AFTER and "result" in answer:
            self.commits.commit()
        if method in JOURNALED and "result" in answer and self.commits.offline:
            self.commits.acknowledge(str(params.get("run_id")), method)  # the tests check its record was committed
        return answer

    @modal.method()
    def delete_run(self, run_id: str) -> JSONObject:
        """Drop the run from memory, remove its files and commit: the pool deletes, or an eviction could write them back."""
        answer = self._submit("delete_run", {"run_id": run_id})
        self.commits.commit()
        return answer

    @modal.exit()
    def stop(self) -> None:
        # Scaling down: finish what is queued, snapshot what changed, and commit it.
        self.engine.scheduler.close()
        self.ticks.join(timeout=CALL_TIMEOUT_S)
        self.commits.commit()

    def _load_base(self) -> None:
        # The key's first part is the catalogue's name, which on Modal is the hub id the runs load (no local paths
        # there). Best effort: a base that fails here fails its first call too, with a typed error the caller sees.
        from gpu_runtime.client.allocation import PoolKey

        base = PoolKey.parse(self.pool).base_model
        try:
            self.engine.residency.base(base)
        except Exception as exc:  # noqa: BLE001
            print(f"pool {self.pool}: base {base!r} did not load at start: {type(exc).__name__}: {exc}", file=sys.stderr)

    def _submit(self, method: str, params: Mapping[str, object]) -> JSONObject:
        try:
            call, ticket = read_call(method, params)
        except SignalError as exc:
            return answer_message(exc)
        answered: Future[Any] = Future()  # the call's result or its SignalError
        self.engine.submit(call, answered.set_result, ticket=ticket)
        return _plain(answer_message(answered.result()))


def _plain(answer: JSONObject) -> JSONObject:
    """The answer as JSON would carry it: what the server gets is what a pipe would have given it."""
    try:
        return as_json_object(json.loads(json.dumps(answer)), "answer")
    except (TypeError, ValueError) as exc:
        return {"error": {"type": "InternalError", "code": "INTERNAL", "message": f"unserialisable answer: {exc}",
                          "field": None}}
