"""One tick's journals are fsync'd together (gpu_runtime/engine/journal.py `sync_all`): each journal's error stays its own,
and every other journal is durable: its records read back from a fresh open."""

from __future__ import annotations

import errno
import os
from collections import deque
from pathlib import Path

import pytest

from gpu_runtime.engine import journal as journal_module
from gpu_runtime.engine.journal import Journal, sync_all


@pytest.mark.parametrize("disk", ["slow", "quick"])  # fsyncs through the pool's threads, or inline one by one
@pytest.mark.parametrize("journals", [1, 3, 12])  # alone, a tick's few, more than the pool's threads
def test_sync_all_makes_every_journal_durable_and_reports_each_failure_as_its_own(
        tmp_path: Path, journals: int, disk: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # what the last fsyncs took is what chooses: a disk's milliseconds, or tmpfs's microseconds
    seconds = 5e-3 if disk == "slow" else 1e-6
    monkeypatch.setattr(journal_module, "_fsyncs", deque([seconds] * 9, maxlen=9))
    assert journal_module._fsyncs_quick() == (disk == "quick")
    opened = [Journal(tmp_path / f"run-{i}") for i in range(journals)]
    for i, journal in enumerate(opened):
        for n in range(i + 1):
            journal.append({"type": "forward_backward", "run": i, "n": n})
    broken = journals // 2
    opened[broken]._file.close()
    read_end, write_end = os.pipe()
    opened[broken]._file = open(write_end, "wb", buffering=0)  # a pipe: its fsync fails (EINVAL), as a bad disk's would

    errors = sync_all(opened)

    assert [i for i, error in enumerate(errors) if error is not None] == [broken]
    error = errors[broken]
    assert error is not None and error.errno == errno.EINVAL
    assert opened[broken].synced_seq == 0  # not durable: abandon cuts it back to here
    for i, journal in enumerate(opened):
        if i == broken:
            continue
        assert journal.synced_seq == i + 1 and journal.synced_bytes == journal.path.stat().st_size
        assert Journal(journal.directory).read() == [{"type": "forward_backward", "run": i, "n": n}
                                                     for n in range(i + 1)]
    opened[broken]._file.close()
    os.close(read_end)
    opened[broken]._file = None
    for journal in opened:
        journal.close()
