"""Durability by journal (issue 6 §4): eviction and reload, kill -9 of the worker at each failpoint,
retried request ids, torn journal tails, and snapshots in today's (format 1) layout.

Every check compares against one reference: the same script of calls on a run that never stopped,
trained in-process (`reference`). Each call here runs alone in its tick, so "the same" is bitwise:
weights, pending gradients, AdamW state, and each call's result down to the last float.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import signal
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.client.persistence import write_json
from gpu_runtime.client.runtime_client import RuntimeClient
from gpu_runtime.compute import optim_tick, slot_adamw
from gpu_runtime.contract import CONTRACT_VERSION, RuntimeOptions
from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.journal import HEADER, JOURNAL_FILE
from gpu_runtime.engine.run_state import RunConfig
from gpu_runtime.errors import FailedPrecondition, WorkerFailed
from tests.helpers.engine_tools import BATCH

LORA = {"r": 4, "alpha": 8, "dropout": 0.1}  # dropout on: replay must redraw the same masks
SEED = 7
# The script every test follows, or a prefix of it: fb, step, fb, step, fb, step, each with its request id.
CALLS: list[tuple[str, dict[str, Any]]] = []
for _i, (_batch, _adam) in enumerate([(BATCH[:2], {"learning_rate": 1e-2}),
                                      (BATCH[2:], {"learning_rate": 5e-3, "weight_decay": 0.01}),
                                      (BATCH[1:3], {"learning_rate": 1e-2, "beta1": 0.8})], start=1):
    CALLS.append(("forward_backward", {"batch": _batch, "request_id": f"fb-{_i}"}))
    CALLS.append(("optim_step", {"adam": _adam, "request_id": f"opt-{_i}"}))


@dataclass
class Captured:
    """A run's trainable state, by PEFT parameter name."""

    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    optimizer: dict[str, dict[str, torch.Tensor]]


def capture(engine: Engine, run_id: str) -> Captured:
    engine.run_info(run_id)  # restores it if it is not resident
    state = engine.runs[run_id]
    named = state.named_parameters()
    names = list(named)
    optimizer = {names[i]: {k: v.clone() for k, v in moments.items()}
                 for i, moments in state.optimizer.state_dict()["state"].items()}
    return Captured(
        weights={n: p.detach().clone() for n, p in named.items()},
        grads={n: None if p.grad is None else p.grad.detach().clone() for n, p in named.items()},
        optimizer=optimizer,
    )


def assert_same(actual: Captured, expected: Captured, grads: bool = True) -> None:
    assert actual.weights.keys() == expected.weights.keys()
    for name in expected.weights:
        assert torch.equal(actual.weights[name], expected.weights[name]), f"weights differ: {name}"
    if grads:
        for name in expected.grads:
            a, e = actual.grads[name], expected.grads[name]
            if e is None or not e.any():  # no gradients, or none yet materialised
                assert a is None or not a.any(), f"unexpected gradient: {name}"
            else:
                assert a is not None and torch.equal(a, e), f"gradients differ: {name}"
    assert actual.optimizer.keys() == expected.optimizer.keys()
    for name, state in expected.optimizer.items():
        assert actual.optimizer[name].keys() == state.keys(), name
        for key, tensor in state.items():
            assert torch.equal(actual.optimizer[name][key], tensor), f"AdamW {key} differs: {name}"


def without_replayed(result: dict[str, Any]) -> dict[str, Any]:
    """The call's outcome: without the replay flag, and without its compute_seconds (a timing, never the same twice)."""
    return {k: v for k, v in result.items() if k not in ("replayed", "compute_seconds")}


def do(engine: Engine, run_id: str, index: int) -> dict[str, Any]:
    method, params = CALLS[index]
    result = engine.call(method, run_id=run_id, **params)
    return {k: v for k, v in result.items() if k != "compute_seconds"}  # a timing, never the same twice


def create(engine: Engine, run_id: str, tiny_model_dir: str) -> None:
    engine.create_run(run_id, "u1", tiny_model_dir, LORA, seed=SEED)


@dataclass
class Reference:
    results: list[dict[str, Any]]  # of each call of CALLS
    after: list[Captured]  # the run's state after each call of CALLS
    config: RunConfig
    module_order: list[str]  # the targeted layers in the base's module order (PEFT's parameter order)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """CALLS on a run that is never evicted, stopped or restored."""
    engine = Engine(tmp_path_factory.mktemp("reference"), device="cpu")
    create(engine, "ref", tiny_model_dir)
    results, after = [], []
    for index in range(len(CALLS)):
        results.append(do(engine, "ref", index))
        after.append(capture(engine, "ref"))
    state = engine.runs["ref"]
    order = [name for name, _ in engine.residency.bases[state.base_model].model.named_modules() if name in state.weights]
    return Reference(results, after, copy.deepcopy(state.config), order)


# ---- eviction ---------------------------------------------------------------------------------


def test_eviction_then_reload_gives_identical_weights_and_optimizer(
    tmp_path: Path, tiny_model_dir: str, reference: Reference
) -> None:
    engine = Engine(tmp_path, device="cpu", options=RuntimeOptions(resident_runs=1))
    create(engine, "a", tiny_model_dir)
    for index in range(3):  # fb, step, fb: "a" holds pending gradients when it is evicted
        assert do(engine, "a", index) == reference.results[index]

    create(engine, "b", tiny_model_dir)  # one resident run allowed: "a" goes
    state = engine.runtime_state()
    assert [r["run_id"] for r in state["resident_runs"]] == ["b"]
    assert state["evicted_runs"] == ["a"] and state["evictions"] == 1
    snapshot = tmp_path / "runs" / "u1" / "a" / "lora_adapters" / "step_1" / "snapshot.json"
    meta = json.loads(snapshot.read_text())
    assert meta["pending_included"] is True and meta["seq"] == 3 and meta["pending"]["calls"] == 1
    for index in range(2):  # "b" trains meanwhile, on the same base
        do(engine, "b", index)

    # "a" comes back on its next call (and "b" goes), pending gradients and AdamW moments included.
    for index in range(3, len(CALLS)):
        assert do(engine, "a", index) == reference.results[index]
        if index == 3:
            state = engine.runtime_state()
            assert [r["run_id"] for r in state["resident_runs"]] == ["a"]
            assert state["evicted_runs"] == ["b"] and state["evictions"] == 2
    assert_same(capture(engine, "a"), reference.after[-1])
    assert_same(capture(engine, "b"), reference.after[1])  # and "b" reloads as it was left


def test_an_eviction_snapshot_is_synced_as_it_is_written(tmp_path: Path, tiny_model_dir: str) -> None:
    # On Modal, after_sync commits the Volume: an eviction's snapshot must not wait for the next call's tick.
    synced: list[int] = []  # the snapshots written by each after_sync
    engine = Engine(tmp_path, device="cpu", options=RuntimeOptions(resident_runs=1),
                    after_sync=lambda: synced.append(engine.totals.snapshots))
    create(engine, "a", tiny_model_dir)
    do(engine, "a", 0)  # a forward_backward: "a" holds pending gradients, and no snapshot yet
    assert engine.totals.snapshots == 0
    create(engine, "b", tiny_model_dir)  # one resident run allowed: "a" is evicted after this call's answer
    assert engine.totals.evictions == 1 and engine.totals.snapshots == 1
    assert synced[-1] == 1  # synced after the eviction's snapshot, with no call since


# ---- kill -9 of the worker -------------------------------------------------------------------

# failpoint → the index in CALLS of the call the worker dies in (a snapshot is due at step 2).
FAILPOINTS = {
    "before_journal": 2,  # fb-2 computed, not journaled: lost, and the client is told so
    "after_journal": 2,  # fb-2 journaled and fsync'd, never answered: the retry is answered from the journal
    "during_snapshot": 3,  # opt-2 applied and journaled, killed while writing the step-2 snapshot
    # No failpoint of its own: fb-2 acknowledged by the worker that then dies during_snapshot (another
    # run's), so kill -9 comes between this run's forward_backward and its optim_step.
    "between_fb_and_step": 3,
}
CRASH_OPTIONS = RuntimeOptions(snapshot_every_steps=2)


@dataclass
class Crash:
    answered: list[dict[str, Any]]  # what the worker answered for this run before it died (CALLS[2:dies])
    failure: str | None  # the WorkerFailed message of the call it died in (None: no call was in flight)
    exit_code: int | None


@dataclass
class Crashes:
    data: Path
    client: RuntimeClient  # its worker died at every failpoint in turn; the next call respawns it without faults
    runs: dict[str, Crash]


@pytest.fixture(scope="module")
def crashes(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crashes]:
    """One run per failpoint: fb-1 and opt-1 journaled, then a worker that dies at the failpoint.

    One client throughout, as the server holds one: each crash is answered WorkerFailed, and the next
    start respawns the worker with whatever `env` the client has then (the next failpoint, or none).
    """
    root = tmp_path_factory.mktemp("crashes")
    data = root / "data"
    first = Engine(data, device="cpu", options=CRASH_OPTIONS)
    for run_id in FAILPOINTS:
        create(first, run_id, tiny_model_dir)
        do(first, run_id, 0)
        do(first, run_id, 1)
    for state in first.runs.values():
        state.journal.close()
    del first  # dropped without a shutdown: what a crash leaves is the journal, no snapshot

    client = RuntimeClient(str(data), device="cpu", options=CRASH_OPTIONS, log_path=str(root / "worker.log"))
    runs: dict[str, Crash] = {}
    try:
        for failpoint in ("before_journal", "after_journal", "during_snapshot"):
            client.env = {"SIGNAL_RUNTIME_FAULTS": failpoint}
            client.start()  # the last worker is dead: a new one, with this failpoint
            bystander: list[dict[str, Any]] = []
            if failpoint == "during_snapshot":
                method, params = CALLS[2]
                bystander.append(client.call(method, run_id="between_fb_and_step", **params))
            answered, dies, failure = [], FAILPOINTS[failpoint], None
            for index in range(2, dies):
                method, params = CALLS[index]
                answered.append(client.call(method, run_id=failpoint, **params))
            process = client._process
            assert process is not None
            method, params = CALLS[dies]
            try:
                client.call(method, run_id=failpoint, **params)
            except WorkerFailed as exc:
                failure = exc.message
            runs[failpoint] = Crash(answered, failure, process.wait())
            if bystander:
                runs["between_fb_and_step"] = Crash(bystander, None, process.wait())
        client.env = {}  # the next call starts a worker without failpoints
        yield Crashes(data, client, runs)
    finally:
        client.close()


@pytest.mark.parametrize("failpoint", list(FAILPOINTS))
def test_kill_9_then_restart_and_retry_gives_the_uninterrupted_weights(
    crashes: Crashes, reference: Reference, failpoint: str
) -> None:
    crash, dies, client = crashes.runs[failpoint], FAILPOINTS[failpoint], crashes.client
    assert [without_replayed(answer) for answer in crash.answered] == reference.results[2:dies]
    assert crash.exit_code == -signal.SIGKILL
    if failpoint == "between_fb_and_step":
        assert crash.failure is None
    else:
        method, _ = CALLS[dies]
        assert crash.failure is not None and f"exited with code -9 during {method}" in crash.failure

    method, params = CALLS[dies]
    retried = client.call(method, run_id=failpoint, **params)  # the same request id, as the SDK retries
    assert without_replayed(retried) == reference.results[dies]
    info = client.call("run_info", run_id=failpoint)
    if failpoint == "before_journal":  # never journaled: applied now, for the first time
        assert "replayed" not in retried
        assert (info["step"], info["pending_forward_backward"]) == (1, 1)
    elif failpoint == "after_journal":  # journaled before the kill: answered from the journal, not applied again
        assert retried["replayed"] is True
        assert (info["step"], info["pending_forward_backward"]) == (1, 1)
    elif failpoint == "during_snapshot":  # journaled before the snapshot began: not stepped twice
        assert retried["replayed"] is True
        assert (info["step"], info["pending_forward_backward"]) == (2, 0)
        adapters = crashes.data / "runs" / "u1" / failpoint / "lora_adapters"
        assert not (adapters / "step_2").exists()  # the half-written snapshot never became one
    else:  # the acknowledged fb-2 was replayed from the journal into the gradients opt-2 applies
        assert "replayed" not in retried
        assert (info["step"], info["pending_forward_backward"]) == (2, 0)

    for index in range(dies + 1, len(CALLS)):
        method, params = CALLS[index]
        assert without_replayed(client.call(method, run_id=failpoint, **params)) == reference.results[index]
    saved = client.call("save_state", run_id=failpoint, mode="state")
    assert saved["step"] == 3
    assert_same(read_saved_state(Path(saved["checkpoint_path"])), reference.after[-1], grads=False)


# A stand-in for the worker, for the client's own bookkeeping: ready at once, answers in order;
# "hold" is answered only with the next call.
FAKE_WORKER = f"""
CONTRACT = {CONTRACT_VERSION}
""" + """
import json, os, sys
out = sys.stdout.buffer
out.write(json.dumps({"ready": True, "pid": os.getpid(), "contract": CONTRACT}).encode() + b"\\n")
out.flush()
held = []
for line in sys.stdin.buffer:
    request = json.loads(line)
    held.append(request["id"])
    if request["method"] != "hold":
        for request_id in held:
            out.write(json.dumps({"id": request_id, "result": {"pid": os.getpid()}}).encode() + b"\\n")
        out.flush()
        held = []
"""


def test_a_worker_killed_between_calls_fails_only_the_calls_sent_to_it(tmp_path: Path) -> None:
    """The call that respawns a dead worker is not failed by the dead one's reader cleaning up late."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    launcher = tmp_path / "python"  # the client runs `python -m gpu_runtime.runtime_process …`: this python runs the fake
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    launcher.chmod(0o755)
    client = RuntimeClient(str(tmp_path), python=str(launcher))
    try:
        client.start()
        old = client._process
        assert old is not None
        in_flight = client.submit("hold")  # sent to the worker about to die
        with client._lock:  # its reader cannot clean up before the next call is sent
            reader = next(t for t in threading.enumerate() if t.name == f"worker-reader-{old.pid}")
            os.kill(old.pid, signal.SIGKILL)
            old.wait()
            retried = client.submit("hold")  # respawns the worker: sent to the new one
        reader.join()  # the dead worker's reader has failed what was sent to it
        with pytest.raises(WorkerFailed):
            in_flight.result(timeout=60)
        assert not retried.done()
        answer = client.call("ping", timeout=60)
        assert answer["pid"] == client.pid != old.pid
        assert retried.result(timeout=60) == answer
    finally:
        client.close()


def read_saved_state(directory: Path) -> Captured:
    """What save_state(mode="state") wrote, as `capture` shows a run."""
    weights = load_file(str(directory / "adapter_model.safetensors"))
    payload = torch.load(directory / "optimizer_state.pt", weights_only=True)
    names = payload["param_names"]
    optimizer = {names[i]: s for i, s in payload["optimizer"]["state"].items()}
    return Captured(weights=weights, grads={n: None for n in weights}, optimizer=optimizer)


# ---- retried request ids ----------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1], ids=["forward_backward", "optim_step"])
def test_a_retried_request_id_is_not_applied_twice(
    tmp_path: Path, tiny_model_dir: str, reference: Reference, index: int
) -> None:
    engine = Engine(tmp_path, device="cpu")
    create(engine, "r", tiny_model_dir)
    for i in range(index + 1):
        do(engine, "r", i)

    def check_retry(engine: Engine) -> None:
        again = do(engine, "r", index)
        assert again["replayed"] is True and without_replayed(again) == reference.results[index]
        info = engine.run_info("r")
        assert (info["step"], info["pending_forward_backward"]) == ((0, 1) if index == 0 else (1, 0))
        if index == 0:
            assert info["pending_tokens"] == reference.results[0]["num_tokens"]
        assert_same(capture(engine, "r"), reference.after[index])

    check_retry(engine)  # while resident
    engine.close_run("r")
    check_retry(engine)  # restored from the snapshot close_run wrote (it keeps the answered ids)
    restarted = Engine(tmp_path, device="cpu")
    check_retry(restarted)  # in a new runtime
    for i in range(index + 1, len(CALLS)):
        assert do(restarted, "r", i) == reference.results[i]
    assert_same(capture(restarted, "r"), reference.after[-1])


def test_a_duplicate_queued_behind_its_first_attempt_is_answered_from_it(
    tmp_path: Path, tiny_model_dir: str, reference: Reference
) -> None:
    """A client that retries before the first attempt was answered: both wait in the run's queue."""
    engine = Engine(tmp_path, device="cpu")
    create(engine, "r", tiny_model_dir)
    futures: list[Future[dict[str, Any]]] = []
    for index in (0, 0, 1, 1):
        method, params = CALLS[index]
        future: Future[dict[str, Any]] = Future()
        engine.submit_message(method, {"run_id": "r", **params}, future.set_result)
        futures.append(future)
    while not all(f.done() for f in futures):
        engine.tick()
    answers = [f.result() for f in futures]
    assert all("result" in a for a in answers), answers
    first_fb, second_fb, first_step, second_step = (a["result"] for a in answers)
    assert "replayed" not in first_fb and second_fb["replayed"] is True
    assert "replayed" not in first_step and second_step["replayed"] is True
    assert without_replayed(first_fb) == reference.results[0] and without_replayed(second_fb) == reference.results[0]
    assert without_replayed(first_step) == reference.results[1]
    assert without_replayed(second_step) == reference.results[1]
    assert second_fb["compute_seconds"] == first_fb["compute_seconds"]  # the first attempt's answer, as it was
    info = engine.run_info("r")
    assert (info["step"], info["pending_forward_backward"]) == (1, 0)
    assert_same(capture(engine, "r"), reference.after[1])


def test_a_retried_optim_step_that_failed_fails_again_and_is_never_applied(
    tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step skipped for a non-finite gradient norm dropped the gradients; its retry is that failure, again."""
    engine = Engine(tmp_path, device="cpu")
    create(engine, "r", tiny_model_dir)
    do(engine, "r", 0)
    with monkeypatch.context() as patch:
        # what the optimizer tick measures
        patch.setattr(optim_tick, "grad_norms", lambda grads: [torch.tensor(math.inf) for _ in grads])
        patch.setattr(slot_adamw, "row_norms", lambda grads: torch.full(grads[0].shape[:1], math.inf))
        with pytest.raises(FailedPrecondition) as first:
            do(engine, "r", 1)
    assert "gradient norm is inf" in first.value.message
    for runtime in (engine, Engine(tmp_path, device="cpu")):  # resident, then restored from the journal
        with pytest.raises(FailedPrecondition) as again:
            do(runtime, "r", 1)
        assert again.value.message == first.value.message
        info = runtime.run_info("r")
        assert (info["step"], info["pending_forward_backward"]) == (0, 0)
        assert all(p.grad is None for p in runtime.runs["r"].parameters())


# ---- torn journal tails -----------------------------------------------------------------------


def _record_offsets(data: bytes) -> list[int]:
    """Where each whole record of a journal file starts."""
    offsets, at = [], 0
    while at + HEADER.size <= len(data):
        length, _ = HEADER.unpack_from(data, at)
        offsets.append(at)
        at += HEADER.size + length
    return offsets


def _cut_inside_payload(data: bytes, last: int) -> bytes:
    return data[: len(data) - 7]


def _cut_inside_header(data: bytes, last: int) -> bytes:
    return data[: last + 3]


def _bad_checksum(data: bytes, last: int) -> bytes:
    flipped = bytearray(data)
    flipped[last + HEADER.size + 10] ^= 0x01
    return bytes(flipped)


def _garbage_after(data: bytes, last: int) -> bytes:
    # A frame whose header was written and whose payload was not (and a few stray bytes).
    return data + HEADER.pack(500, zlib.crc32(b"x" * 500)) + b'{"type":"forw'


TEARS: dict[str, tuple[Callable[[bytes, int], bytes], bool]] = {  # tear → (how, whether fb-2 survives)
    "cut_inside_payload": (_cut_inside_payload, False),
    "cut_inside_header": (_cut_inside_header, False),
    "bad_checksum": (_bad_checksum, False),
    "garbage_after_last_record": (_garbage_after, True),
}


@pytest.mark.parametrize("tear", list(TEARS))
def test_a_torn_journal_tail_restores_to_the_last_whole_record(
    tmp_path: Path, tiny_model_dir: str, reference: Reference, tear: str
) -> None:
    first = Engine(tmp_path, device="cpu")
    create(first, "r", tiny_model_dir)
    for index in range(3):  # fb-1, opt-1, fb-2: three records, no snapshot
        do(first, "r", index)
    for state in first.runs.values():
        state.journal.close()
    del first  # a crash: no shutdown snapshot

    journal = tmp_path / "runs" / "u1" / "r" / "journal" / JOURNAL_FILE
    data = journal.read_bytes()
    offsets = _record_offsets(data)
    assert len(offsets) == 3
    how, survives = TEARS[tear]
    journal.write_bytes(how(data, offsets[-1]))

    restarted = Engine(tmp_path, device="cpu")
    info = restarted.run_info("r")
    whole = 3 if survives else 2
    assert journal.stat().st_size == (len(data) if survives else offsets[-1])  # the torn tail is cut off
    assert (info["step"], info["pending_forward_backward"]) == (1, 1 if survives else 0)
    assert_same(capture(restarted, "r"), reference.after[whole - 1])

    retried = do(restarted, "r", 2)  # the client was never answered for fb-2 if its record was torn
    assert retried.get("replayed", False) is survives
    assert without_replayed(retried) == reference.results[2]
    for index in range(3, len(CALLS)):
        assert do(restarted, "r", index) == reference.results[index]
    assert_same(capture(restarted, "r"), reference.after[-1])
    assert len(_record_offsets(journal.read_bytes())) == len(CALLS)  # appends continue after the cut


# ---- today's snapshots (format 1) -------------------------------------------------------------


def _legacy_key(run_id: str) -> str:
    return "run_" + hashlib.sha256(run_id.encode()).hexdigest()[:16]


def write_legacy_step(root: Path, run_id: str, step: int, captured: Captured, module_order: list[str],
                      config: dict[str, Any]) -> None:
    """lora_adapters/step_N as the runtime before the journal wrote it (PEFT's own adapter files, an
    optimizer_state.pt named by PEFT's in-memory parameters with the adapter's name, in module order)."""
    directory = root / "lora_adapters" / f"step_{step}"
    directory.mkdir(parents=True)
    # get_peft_model_state_dict drops the adapter name from the keys.
    save_file({k: v.contiguous() for k, v in captured.weights.items()}, str(directory / "adapter_model.safetensors"))
    lora = config["lora"]
    (directory / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": config["base_model"], "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
        "peft_type": "LORA", "r": lora["r"], "target_modules": list(reversed(lora["target_modules"])),
        "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False,
    }))
    key = _legacy_key(run_id)
    names = [f"base_model.model.{path}.lora_{m}.weight" for path in module_order for m in "AB"]
    legacy_names = [f"base_model.model.{path}.lora_{m}.{key}.weight" for path in module_order for m in "AB"]
    assert sorted(names) == sorted(captured.optimizer)
    state = {i: captured.optimizer[name] for i, name in enumerate(names)}
    groups = [{"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
               "decoupled_weight_decay": True, "params": list(range(len(names)))}]
    payload = {"step": step, "param_names": legacy_names, "optimizer": {"state": state, "param_groups": groups}}
    torch.save(payload, directory / "optimizer_state.pt")
    torch.save(payload, root / "optimizer_state.pt")


def test_a_format_1_snapshot_restores_and_trains_on(tmp_path: Path, tiny_model_dir: str, reference: Reference) -> None:
    root = tmp_path / "runs" / "u1" / "old"
    config = {**reference.config, "run_id": "old"}
    write_json(root / "config.json", config)
    write_json(root / "manifest.json", {"run_id": "old", "user_id": "u1", "lora": config["lora"], "steps": []})
    assert reference.module_order != sorted(reference.module_order)  # so the optimizer state is renumbered
    write_legacy_step(root, "old", 1, reference.after[1], reference.module_order, config)
    write_legacy_step(root, "old", 2, reference.after[3], reference.module_order, config)

    engine = Engine(tmp_path, device="cpu")
    info = engine.run_info("old")
    assert (info["step"], info["pending_forward_backward"]) == (2, 0)
    assert_same(capture(engine, "old"), reference.after[3])
    for index in (4, 5):
        assert do(engine, "old", index) == reference.results[index]
    assert_same(capture(engine, "old"), reference.after[-1])

    # A crash now: the format-1 snapshot plus the journal written since bring it back.
    for state in engine.runs.values():
        state.journal.close()
    del engine
    restarted = Engine(tmp_path, device="cpu")
    assert restarted.run_info("old")["step"] == 3
    assert_same(capture(restarted, "old"), reference.after[-1])
    restarted.shutdown()  # and a format-2 snapshot supersedes it
    meta = json.loads((root / "lora_adapters" / "step_3" / "snapshot.json").read_text())
    assert meta["format"] == 2 and meta["seq"] == 2
    assert_same(capture(Engine(tmp_path, device="cpu"), "old"), reference.after[-1])


# ---- what a crash leaves beside the journal -----------------------------------------------------


def test_a_crash_before_the_manifest_line_and_a_half_written_snapshot_are_repaired(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    first = Engine(tmp_path, device="cpu")
    create(first, "r", tiny_model_dir)
    for index in range(4):  # fb-1, opt-1, fb-2, opt-2
        do(first, "r", index)
    for state in first.runs.values():
        state.journal.close()
    del first  # a crash: no shutdown snapshot
    root = tmp_path / "runs" / "u1" / "r"
    manifest = root / "manifest.jsonl"
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join(lines[:-1]) + "\n")  # step 2 was journaled; its manifest line never written
    debris = root / "lora_adapters" / ".step_2.tmp-0123abcd"
    debris.mkdir(parents=True)
    (debris / "adapter_model.safetensors").write_bytes(b"half a file")

    restarted = Engine(tmp_path, device="cpu")
    assert restarted.run_info("r")["step"] == 2
    steps = [json.loads(line)["step"] for line in manifest.read_text().splitlines() if '"adam"' in line]
    assert steps == [1, 2]
    assert json.loads(manifest.read_text().splitlines()[-1]) == json.loads(lines[-1])  # the same line, rebuilt
    assert not debris.exists()
