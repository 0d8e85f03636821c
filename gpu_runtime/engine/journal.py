"""A run's write-ahead journal: append-only records, fsync'd before the call they record is answered.

Each record is framed as [length: u32][crc32: u32][JSON payload], so a record torn by a crash (a
short frame, or a checksum that does not match) is detected on open; it and anything after it
are dropped and the file is truncated to the last whole record. Records are numbered from 0 in
the order they were appended (their `seq`); snapshots name the seq they cover.

The journal is a run of segment files: `records.log` holds the records from seq 0 (a journal written before segments
is that one file), `records.{S}.log` those from seq S. `compact`, after a snapshot, starts a new segment at the next
seq and deletes the segments wholly before the oldest kept snapshot, oldest first: a crash at any point leaves a
contiguous run of segments that still reaches back to every kept snapshot, so restore replays the same records.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import struct
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpu_runtime.contract.json_types import COMPACT, JSON

HEADER = struct.Struct("<II")
JOURNAL_FILE = "records.log"  # the segment from seq 0, and the whole journal before segments
_SEGMENT = re.compile(r"records\.(\d+)\.log")


def segment_name(first_seq: int) -> str:
    return JOURNAL_FILE if first_seq == 0 else f"records.{first_seq}.log"


class JournalGap(RuntimeError):
    """Segments that do not follow on from each other: records were lost outside any crash the journal survives."""


class Journal:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._file: Any = None
        self._dirty = False
        self._opened = False
        self.first_seq = 0  # the oldest record held: those before it went with compaction
        self.segment_seq = 0  # the first record of the segment appends go to
        self.next_seq = 0
        self.synced_bytes = 0  # the active segment's durable length: a failed write is cut back to it (`abandon`)
        self.synced_seq = 0  # records durable in the whole journal

    @property
    def path(self) -> Path:
        """The segment appends go to."""
        return self.directory / segment_name(self.segment_seq)

    def segments(self) -> list[tuple[int, Path]]:
        """(first seq, file) of every segment on disk, oldest first."""
        found = []
        for path in self.directory.glob("records*.log"):
            match = _SEGMENT.fullmatch(path.name)
            if path.name == JOURNAL_FILE or match:
                found.append((int(match.group(1)) if match else 0, path))
        return sorted(found)

    def read(self) -> list[Mapping[str, object]]:
        """Every whole record held, in order, from seq `first_seq`; a torn tail is cut off the last segment (only the
        last is ever written to). Call before the first append."""
        segments = self.segments()
        records: list[Mapping[str, object]] = []  # as json.loads made them: record_from_dict reads them
        self.first_seq = segments[0][0] if segments else 0
        good = 0
        for index, (start, path) in enumerate(segments):
            if start != self.first_seq + len(records):
                raise JournalGap(f"journal {self.directory}: {path.name} starts at record {start}, but the segments "
                                 f"before it end at record {self.first_seq + len(records)}")
            data = path.read_bytes()
            good = _read_frames(data, records)
            if good < len(data):
                if index < len(segments) - 1:
                    raise JournalGap(f"journal {self.directory}: {path.name} is torn at byte {good}, and later "
                                     "segments follow it")
                print(f"journal {path}: dropped a torn tail of {len(data) - good} bytes after record "
                      f"{self.first_seq + len(records)}", file=sys.stderr)
                with open(path, "r+b") as fh:
                    fh.truncate(good)
                    os.fsync(fh.fileno())
        self._opened = True
        self.segment_seq = segments[-1][0] if segments else 0
        self.next_seq = self.synced_seq = self.first_seq + len(records)
        self.synced_bytes = good
        return records

    def append(self, record: Mapping[str, JSON]) -> int:
        """Write one record (not yet durable: `sync` makes it so); return its seq."""
        if not self._opened:
            self.read()
        if self._file is None:
            created = not self.path.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a write that fails (a full disk) leaves no bytes in a Python buffer to be written later,
            # when the call it records has been answered as failed.
            self._file = open(self.path, "ab", buffering=0)
            if created:
                _fsync_dir(self.directory)  # the file's name must survive a crash too
        payload = COMPACT.encode(record).encode()
        self._dirty = True  # from here a failure leaves the file longer than synced_bytes: `abandon` cuts it back
        frame = memoryview(HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        while frame:
            frame = frame[self._file.write(frame):]
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self._dirty = True
        return seq

    def sync(self) -> None:
        if self._dirty and self._file is not None:
            started = time.perf_counter()
            os.fsync(self._file.fileno())
            _fsyncs.append(time.perf_counter() - started)  # from the pool's threads too: a deque's append is thread-safe
            self._dirty = False
            self.synced_bytes, self.synced_seq = self._file.tell(), self.next_seq

    def abandon(self) -> None:
        """After a failed append or fsync: cut the file back to its last synced length and close it. The records
        since then are gone, so no call answered as failed becomes durable, and no torn frame hides later ones."""
        if self._file is not None:
            try:
                os.ftruncate(self._file.fileno(), self.synced_bytes)
                os.fsync(self._file.fileno())
            finally:
                self._file.close()
                self._file = None
        self._dirty = False
        self.next_seq = self.synced_seq

    def compact(self, keep_from: int, removed: Callable[[Path], None] | None = None) -> None:
        """After a snapshot: later records go to a new segment from `next_seq`, and the segments holding only records
        before `keep_from` (the oldest kept snapshot's seq) are deleted, oldest first. `removed` is a failpoint's hook,
        called after each deletion."""
        if not self._opened:
            self.read()
        self.sync()  # the segment left behind is whole and durable: only the newest segment ever has a torn tail
        if self.next_seq > self.segment_seq:
            if self._file is not None:
                self._file.close()
                self._file = None
            self.segment_seq, self.synced_bytes = self.next_seq, 0
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as fh:  # created now, so the segment before it can go at once
                os.fsync(fh.fileno())
            _fsync_dir(self.directory)  # the new segment's name is durable before any older one is deleted
        segments = self.segments()
        gone = 0
        for (_, path), (following, _) in zip(segments, segments[1:], strict=False):
            if following > keep_from:
                break
            path.unlink()
            self.first_seq, gone = following, gone + 1
            if removed is not None:
                removed(path)
        if gone:
            _fsync_dir(self.directory)

    def close(self) -> None:
        if self._file is not None:
            self.sync()
            self._file.close()
            self._file = None

    @property
    def size_bytes(self) -> int:
        """Every segment's bytes: what the journal holds on disk."""
        return sum(path.stat().st_size for _, path in self.segments()) if self.directory.exists() else 0


SYNC_THREADS = 8  # journals fsync'd at once; more wait for a free thread
# an fsync quicker than this (tmpfs, a drive with power-loss protection) costs less than handing it to a thread and
# waiting for it (~30-300 us a journal on a busy host): such journals are synced one after another, inline
INLINE_FSYNC_S = 50e-6
# the last fsyncs' seconds on this process's disk; their median decides (a preempted fsync on a busy host is one
# outlier, not a slow disk); none yet: concurrently
_fsyncs: deque[float] = deque(maxlen=9)


def _fsyncs_quick() -> bool:
    return len(_fsyncs) == _fsyncs.maxlen and statistics.median(_fsyncs) < INLINE_FSYNC_S


def sync_all(journals: Sequence[Journal]) -> list[OSError | None]:
    """`sync` every journal, concurrently: os.fsync releases the GIL and the file system commits concurrent fsyncs
    together (8 journals on ext4 under load: ~1 ms against ~33 ms one after another). Each journal's own error.
    Where the last fsyncs were quick, one after another on this thread."""
    if len(journals) <= 1 or _fsyncs_quick():
        return [_sync_one(journal) for journal in journals]
    return list(_pool().map(_sync_one, journals))


def _sync_one(journal: Journal) -> OSError | None:
    try:
        journal.sync()
    except OSError as exc:
        return exc
    return None


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="journal-sync")
        return _POOL


def _forget_pool() -> None:
    """In a forked child: the parent's threads are not there, so the next sync starts a pool of its own."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _read_frames(data: bytes, records: list[Mapping[str, object]]) -> int:
    """Append each whole record framed in `data` to `records`; the length of the whole ones."""
    good = 0
    while good + HEADER.size <= len(data):
        length, crc = HEADER.unpack_from(data, good)
        payload = data[good + HEADER.size : good + HEADER.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        try:
            records.append(json.loads(payload))
        except ValueError:
            break
        good += HEADER.size + length
    return good


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
