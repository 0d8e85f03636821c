"""A bounded journal (issue 34 #17): each snapshot starts a new segment and deletes the segments before the oldest
kept snapshot, so a long run's journal holds about `keep_snapshots` snapshot periods of records; a restore from what
is left, or from what a crash in the middle of the deletion leaves, gives the run that never stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.client.runtime_client import RuntimeClient
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.journal import JOURNAL_FILE, Journal, JournalGap, segment_name
from gpu_runtime.errors import WorkerFailed
from tests.helpers.engine_tools import BATCH, assert_same_weights, lora_weights

LORA = {"r": 4, "alpha": 8, "dropout": 0.1}
SEED = 7
PERIOD, KEEP = 2, 2  # a snapshot every 2 steps, the newest 2 kept
OPTIONS = RuntimeOptions(snapshot_every_steps=PERIOD, keep_snapshots=KEEP)


def step(caller: Any, run_id: str, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One forward_backward and one optim_step, with request ids (as the SDK sends), answers without their timing."""
    fb = caller.call("forward_backward", run_id=run_id, batch=BATCH[index % 3:][:2], request_id=f"fb-{index}")
    opt = caller.call("optim_step", run_id=run_id, adam={"learning_rate": 1e-2}, request_id=f"opt-{index}")
    return ({k: v for k, v in fb.items() if k not in ("compute_seconds", "replayed")},
            {k: v for k, v in opt.items() if k not in ("compute_seconds", "replayed")})


def journal_dir(data: Path, run_id: str) -> Path:
    return data / "runs" / "u1" / run_id / "journal"


def test_after_many_snapshots_the_journal_holds_only_records_after_the_oldest_kept_one(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    engine = Engine(tmp_path, device="cpu", options=OPTIONS)
    engine.create_run("r", "u1", tiny_model_dir, LORA, seed=SEED)
    sizes: dict[int, int] = {}
    for index in range(1, 14):  # 13 steps: 6 snapshots, 4 of them pruned, then one step the journal alone holds
        step(engine, "r", index)
        state = engine.runs["r"]
        kept = state.snapshot_positions()
        assert len(kept) == min(index // PERIOD, KEEP)
        journal = state.journal
        if kept:  # from the first snapshot on, nothing older than the oldest kept one stays
            assert journal.first_seq == kept[-1][0]
        assert journal.next_seq - journal.first_seq <= KEEP * PERIOD * 2  # two records a step
        assert len(journal.segments()) <= KEEP + 1
        sizes[index] = journal.size_bytes
    assert state.seq == 26 and journal.first_seq == 20  # the snapshots at records 20 (step 10) and 24 (step 12) kept
    assert [seq for seq, _ in journal.segments()] == [20, 24]
    assert not (journal_dir(tmp_path, "r") / JOURNAL_FILE).exists()
    # Bounded: past the first periods the bytes stop growing (they would reach 26 records' without compaction).
    assert max(sizes[i] for i in range(6, 14)) <= 1.1 * max(sizes[i] for i in range(1, 6))
    for state in engine.runs.values():
        state.journal.close()

    # A crash now (no shutdown snapshot): the newest snapshot plus what the journal kept is the same run, bitwise.
    restarted = Engine(tmp_path, device="cpu", options=OPTIONS)
    assert restarted.run_info("r")["step"] == 13  # step 13 replayed from the journal after the step-12 snapshot
    assert_same_weights(lora_weights(restarted, "r"), lora_weights(engine, "r"))
    assert step(restarted, "r", 14) == step(engine, "r", 14)


def test_a_journal_from_before_segments_replays_then_compacts_at_the_next_snapshot(
    tmp_path: Path, tiny_model_dir: str
) -> None:
    reference = Engine(tmp_path / "reference", device="cpu")
    first = Engine(tmp_path / "data", device="cpu", options=RuntimeOptions(snapshot_every_steps=100))
    for engine in (reference, first):
        engine.create_run("r", "u1", tiny_model_dir, LORA, seed=SEED)
    for index in range(1, 4):  # one records.log of 6 records, no snapshot: the layout before segments
        assert step(first, "r", index) == step(reference, "r", index)
    first.runs["r"].journal.close()
    assert [path.name for _, path in Journal(journal_dir(tmp_path / "data", "r")).segments()] == [JOURNAL_FILE]

    second = Engine(tmp_path / "data", device="cpu", options=OPTIONS)
    assert step(second, "r", 4) == step(reference, "r", 4)  # replayed from records.log, then step 4 and its snapshot
    assert [path.name for _, path in second.runs["r"].journal.segments()] == [segment_name(8)]
    assert second.runs["r"].journal.size_bytes == 0  # the snapshot covers every record
    assert_same_weights(lora_weights(second, "r"), lora_weights(reference, "r"))


def test_segments_that_do_not_follow_on_are_refused_naming_the_gap(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for n in range(3):
        journal.append({"type": "optim_step", "n": n})
    journal.compact(keep_from=0)  # a new segment from record 3; records.log stays (nothing kept is after it)
    journal.append({"type": "optim_step", "n": 3})
    journal.close()
    assert [seq for seq, _ in journal.segments()] == [0, 3]
    assert [r["n"] for r in Journal(tmp_path).read()] == [0, 1, 2, 3]

    (tmp_path / segment_name(3)).rename(tmp_path / segment_name(5))  # records 3 and 4 lost outside any crash
    with pytest.raises(JournalGap, match="records.5.log starts at record 5, but the segments before it end at record 3"):
        Journal(tmp_path).read()


def test_a_crash_during_compaction_loses_nothing_acknowledged(tmp_path: Path, tiny_model_dir: str) -> None:
    options = RuntimeOptions(snapshot_every_steps=PERIOD, keep_snapshots=1)
    reference = Engine(tmp_path / "reference", device="cpu", options=options)
    reference.create_run("r", "u1", tiny_model_dir, LORA, seed=SEED)
    data = tmp_path / "data"
    client = RuntimeClient(str(data), device="cpu", options=options, log_path=str(tmp_path / "worker.log"),
                           env={"SIGNAL_RUNTIME_FAULTS": "during_compaction"})
    try:
        client.call("create_run", run_id="r", user_id="u1", base_model=tiny_model_dir, lora=LORA, seed=SEED)
        assert step(client, "r", 1) == step(reference, "r", 1)
        fb = client.call("forward_backward", run_id="r", batch=BATCH[2:][:2], request_id="fb-2")
        # opt-2 is journaled and its step-2 snapshot written; the worker dies once records.log is deleted.
        with pytest.raises(WorkerFailed, match="exited with code -9 during optim_step"):
            client.call("optim_step", run_id="r", adam={"learning_rate": 1e-2}, request_id="opt-2")
        segments = [path.name for _, path in Journal(journal_dir(data, "r")).segments()]
        assert segments == [segment_name(4)]  # the compaction got as far as the failpoint

        client.env = {}  # the retry starts a worker without the failpoint; the run comes back from what is on disk
        retried = client.call("optim_step", run_id="r", adam={"learning_rate": 1e-2}, request_id="opt-2")
        assert retried["replayed"] is True  # acknowledged to the journal before the crash: never stepped twice
        expected_fb, expected_opt = step(reference, "r", 2)
        assert {k: v for k, v in fb.items() if k != "compute_seconds"} == expected_fb
        assert {k: v for k, v in retried.items() if k not in ("compute_seconds", "replayed")} == expected_opt
        for index in range(3, 6):  # and trains on as the run that never crashed, through two more compactions
            assert step(client, "r", index) == step(reference, "r", index)
        assert client.call("run_info", run_id="r")["step"] == 5
    finally:
        client.close()
    # The shutdown snapshot (step 5, record 10) is the one kept: every older segment went.
    assert [seq for seq, _ in Journal(journal_dir(data, "r")).segments()] == [10]
    assert_same_weights(lora_weights(Engine(data, device="cpu"), "r"), lora_weights(reference, "r"))
