"""Order and fairness: calls on one run apply in arrival order, a user who floods the queue does not
hold back another's single call (and is not starved), and a long sample does not block short calls.
In-process ticks show what each tick did; the worker process shows the same through RuntimeClient."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.client.runtime_client import RuntimeClient
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.engine.engine import Engine
from tests.helpers.engine_tools import BATCH, result_of, submit

LORA = {"r": 4, "alpha": 8}




def tick_until(engine: Engine, futures: list[Future[dict[str, Any]]], most: int) -> int:
    """Ticks run until every future is answered (at most `most`); returns how many it took."""
    for ticks in range(1, most + 1):
        engine.tick()
        if all(f.done() for f in futures):
            return ticks
    raise AssertionError(f"not answered within {most} ticks")




@pytest.fixture
def flooded(tmp_path: Path, tiny_model_dir: str) -> Engine:
    engine = Engine(tmp_path, device="cpu", tick_tokens=128, decode_chunk_seconds=0.001)
    for run_id in ("a1", "a2", "a3", "a4"):
        engine.create_run(run_id, "flooder", tiny_model_dir, LORA)
    engine.create_run("b1", "bystander", tiny_model_dir, LORA)
    return engine


def test_a_flooding_user_does_not_hold_back_anothers_single_call(flooded: Engine) -> None:
    flood = []
    for i in range(5):  # 20 calls on four runs: training on two, long samples on two
        flood += [submit(flooded, "forward_backward", run_id=run_id, batch=BATCH) for run_id in ("a1", "a2")]
        flood += [submit(flooded, "sample", run_id=run_id, prompts=["hello"], max_tokens=24, seed=i)
                  for run_id in ("a3", "a4")]
    flooded.tick()
    assert flooded.runtime_state()["queue_depth"]["flooder"] >= 16
    single = submit(flooded, "forward_backward", run_id="b1", batch=BATCH[:1])
    assert tick_until(flooded, [single], most=2) <= 2
    assert result_of(single)["num_examples"] == 1
    assert sum(f.done() for f in flood) < 10  # most of the flood is still queued behind it

    tick_until(flooded, flood, most=400)  # and the flooder is not starved: all 20 complete
    assert all("result" in f.result(timeout=0) for f in flood)
    assert [flooded.run_info(r)["pending_forward_backward"] for r in ("a1", "a2")] == [5, 5]


def test_a_short_call_completes_while_a_long_sample_decodes(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", decode_chunk_seconds=0.001)
    engine.create_run("sampler", "u1", tiny_model_dir, LORA)
    engine.create_run("trainer", "u2", tiny_model_dir, LORA)
    long = submit(engine, "sample", run_id="sampler", prompts=["hello"] * 4, max_tokens=200, seed=0)
    engine.tick()
    assert engine.runtime_state()["decode_groups"][0]["runs"] == ["sampler"]
    short = submit(engine, "forward_backward", run_id="trainer", batch=BATCH[:1])
    stats = engine.tick()
    assert short.done() and not long.done()
    assert stats.base_passes == 1 and stats.decode_passes >= 1  # the same tick trained and decoded
    assert result_of(short)["num_examples"] == 1
    tick_until(engine, [long], most=400)
    assert [len(seq[0]["tokens"]) for seq in result_of(long)["sequences"]] == [200] * 4


def test_a_runs_optim_step_waits_for_its_own_sample(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path, device="cpu", decode_chunk_seconds=0.001)
    engine.create_run("r1", "u1", tiny_model_dir, LORA)
    engine.forward_backward("r1", BATCH)
    reference = Engine(tmp_path / "reference", device="cpu")
    reference.create_run("r1", "u1", tiny_model_dir, LORA)
    expected = reference.sample("r1", ["hello"], max_tokens=30, temperature=0)["sequences"]

    finished: list[str] = []
    sample = submit(engine, "sample", run_id="r1", prompts=["hello"], max_tokens=30, temperature=0)
    step = submit(engine, "optim_step", run_id="r1", adam={"learning_rate": 0.5})
    sample.add_done_callback(lambda _: finished.append("sample"))
    step.add_done_callback(lambda _: finished.append("optim_step"))
    tick_until(engine, [sample, step], most=100)
    assert finished == ["sample", "optim_step"]
    assert result_of(sample)["sequences"] == expected  # sampled with the weights from before the step
    assert result_of(step)["step"] == 1


# ---- the same rules across the worker process ---------------------------------------------------


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[RuntimeClient]:
    root = tmp_path_factory.mktemp("scheduling-worker")
    options = RuntimeOptions(tick_tokens=128, decode_chunk_seconds=0.005)
    client = RuntimeClient(str(root / "data"), device="cpu", options=options, log_path=str(root / "worker.log"))
    client.start()
    for run_id, user in (("w1", "u1"), ("w2", "u2"), ("w3", "u3"), ("flood", "flooder"), ("one", "bystander")):
        client.call("create_run", run_id=run_id, user_id=user, base_model=tiny_model_dir, lora=LORA)
    yield client
    client.close()


def test_per_run_order_holds_under_concurrent_submission(worker: RuntimeClient) -> None:
    start = threading.Barrier(3)
    futures: dict[str, list[tuple[str, Future[dict[str, Any]]]]] = {}

    def script(run_id: str) -> None:
        start.wait(timeout=60)
        calls = []
        for _ in range(3):  # pipelined: nothing waits for an answer before sending the next call
            calls.append(("fb", worker.submit("forward_backward", run_id=run_id, batch=BATCH[:2])))
            calls.append(("fb", worker.submit("forward_backward", run_id=run_id, batch=BATCH[2:])))
            calls.append(("step", worker.submit("optim_step", run_id=run_id, adam={"learning_rate": 1e-2})))
        futures[run_id] = calls

    threads = [threading.Thread(target=script, args=(run_id,)) for run_id in ("w1", "w2", "w3")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for run_id, calls in futures.items():
        results = [(kind, future.result(timeout=300)) for kind, future in calls]
        # Had any step overtaken its forward_backwards, it would fail (no gradients) or skip a number.
        assert [r["step"] for kind, r in results if kind == "step"] == [1, 2, 3], run_id
        assert [r["step"] for kind, r in results if kind == "fb"] == [0, 0, 1, 1, 2, 2], run_id
        assert worker.call("run_info", run_id=run_id)["step"] == 3


def test_a_flood_through_the_worker_does_not_delay_a_single_call(worker: RuntimeClient) -> None:
    order: list[str] = []
    lock = threading.Lock()

    def record(name: str) -> Any:
        def done(_: Future[dict[str, Any]]) -> None:
            with lock:
                order.append(name)
        return done

    flood = [worker.submit("forward_backward", run_id="flood", batch=BATCH) for _ in range(20)]
    for i, future in enumerate(flood):
        future.add_done_callback(record(f"flood-{i}"))
    single = worker.submit("forward_backward", run_id="one", batch=BATCH[:1])
    single.add_done_callback(record("single"))
    wait([single, *flood], timeout=300)
    assert single.result()["num_examples"] == 1
    # One run's calls go one per tick, so a FIFO would answer the single call 21st; fair turns answer it
    # in the tick after it arrived.
    assert order.index("single") <= 2
    assert [f.result()["num_examples"] for f in flood] == [4] * 20
    assert worker.call("run_info", run_id="flood")["pending_forward_backward"] == 20


def test_a_short_call_completes_while_the_worker_decodes_a_long_sample(worker: RuntimeClient) -> None:
    long = worker.submit("sample", run_id="w1", prompts=["hello"] * 4, max_tokens=200, seed=1)
    for _ in range(200):  # bounded: until the runtime reports the sample's decode group
        if worker.call("runtime_state")["decode_groups"]:
            break
    else:
        raise AssertionError("the sample never started decoding")
    short = worker.call("forward_backward", run_id="w2", batch=BATCH[:1], timeout=300)
    assert short["num_examples"] == 1
    assert not long.done()
    assert [len(seq[0]["tokens"]) for seq in long.result(timeout=300)["sequences"]] == [200] * 4
