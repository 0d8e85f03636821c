"""Atomic writes and the on-disk layout of a run: a reader never sees a half-written file or directory."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.contract.checks import check_id as check_id  # the rule lives in the contract
from gpu_runtime.contract.json_types import CANONICAL


def write_json(path: Path, data: Any) -> None:
    """Write JSON through a temporary file and os.replace, so the old or the new file is whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: Path, before_swap: Callable[[], None] | None = None) -> Iterator[Path]:
    """Yield a temporary directory beside `path`; on success it becomes `path` (replacing an old one), its files and
    its name fsync'd first, so `path` is whole or absent, never half-written. A crash between moving the old one aside
    and renaming the new one in leaves `.{name}.old-…`: `sweep_temporaries` puts it back at the next start.
    `before_swap` is a failpoint's hook (tests/faults/test_interrupted_saves.py)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        # rename() cannot replace a non-empty directory: move the old one aside first.
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex}")
        if path.exists():
            os.rename(path, old)
            if before_swap is not None:
                before_swap()
        os.rename(tmp, path)
        fsync_dir(path.parent)  # the new name survives a power cut too
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then each directory, deepest first."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What atomic_dir, atomic_file and write_json leave when a crash interrupts them: `.{name}.tmp-{hex}` (being
# written) and `.{name}.old-{hex}` (a replaced directory moved aside, not yet removed).
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]+$")


@dataclass
class Swept:
    removed: int = 0  # temporaries deleted
    removed_bytes: int = 0
    restored: int = 0  # replaced directories put back, their replacement never having been renamed in


def sweep_temporaries(root: Path) -> Swept:
    """Remove what interrupted atomic writes left under `root`. A `.{name}.old-…` whose `name` is missing was moved
    aside by a save that died before renaming its replacement in: it is whole, so it goes back. Call only while no
    write is under way (at a runtime's start: one runtime holds a data directory)."""
    swept = Swept()
    for directory, subdirs, files in os.walk(root):
        for name in [*subdirs, *files]:
            match = TEMPORARY.match(name)
            if match is None:
                continue
            path, target = Path(directory) / name, Path(directory) / match["name"]
            if name in subdirs:
                subdirs.remove(name)  # not walked into
            if match["kind"] == "old" and not target.exists():
                os.rename(path, target)
                swept.restored += 1
                continue
            swept.removed += 1
            if path.is_dir():
                swept.removed_bytes += dir_size(path)
                shutil.rmtree(path, ignore_errors=True)
            else:
                swept.removed_bytes += path.stat().st_size
                path.unlink(missing_ok=True)
    return swept


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def sha256_json(data: Any) -> str:
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def last_manifest_step(path: Path) -> int:
    """The step of manifest.jsonl's last step line (0 if none): replay adds the lines a crash cut off."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 64 * 1024))
            tail = fh.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(tail):
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a torn or partial first line of the tail
        if isinstance(entry, dict) and isinstance(entry.get("step"), int) and "adam" in entry:
            step: int = entry["step"]
            return step
    return 0


def append_manifest(path: Path, entry: Mapping[str, Any]) -> None:
    """manifest.jsonl is append-only: one line per event, never rewritten (not fsync'd: the journal is what is
    durable). One O_APPEND write of the line's bytes, as "a" mode writes them, without a text file object per line
    (half its cost: an optim_step writes one line)."""
    line = memoryview((CANONICAL.encode(entry) + "\n").encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        while line:
            line = line[os.write(fd, line):]
    finally:
        os.close(fd)


class RunPaths:
    """Where a run's files live: runs/{user_id}/{run_id}/…"""

    def __init__(self, data_dir: Path, user_id: str, run_id: str) -> None:
        self.root = Path(data_dir) / "runs" / user_id / run_id

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.jsonl"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def adapters(self) -> Path:
        return self.root / "lora_adapters"

    def adapter_step(self, step: int) -> Path:
        return self.adapters / f"step_{step}"

    def checkpoint(self, mode: str, step: int) -> Path:
        return self.root / "checkpoints" / f"{mode}_step_{step}"

    def saved_steps(self) -> list[int]:
        if not self.adapters.is_dir():
            return []
        steps = [int(p.name[5:]) for p in self.adapters.iterdir() if re.fullmatch(r"step_\d+", p.name)]
        return sorted(steps)

    def prune_steps(self, keep: int) -> None:
        for step in self.saved_steps()[:-keep] if keep > 0 else []:
            shutil.rmtree(self.adapter_step(step), ignore_errors=True)


def find_run_dir(data_dir: Path, run_id: str) -> Path | None:
    # Run ids are globally unique, so the user directory is found by looking.
    runs = Path(data_dir) / "runs"
    matches = [p for p in runs.glob(f"*/{run_id}") if (p / "config.json").exists()]
    if matches:
        return matches[0]
    legacy = _undashed(run_id)
    found = [p for p in runs.glob(f"*/{legacy}") if (p / "config.json").exists()] if legacy else []
    return _adopt_legacy(found[0]) if found else None


_DASHED_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_HEX_ID = re.compile(r"^[0-9a-f]{32}$")


def _undashed(value: str) -> str | None:
    return value.replace("-", "") if _DASHED_UUID.match(value) else None


def _dashed(value: str) -> str:
    return str(uuid.UUID(value)) if _HEX_ID.match(value) else value


def _adopt_legacy(root: Path) -> Path:
    """A run written when ids were 32 hex characters (the database's ids became dashed UUIDs, migration 0003):
    move it to runs/{dashed user}/{dashed run} and rewrite its config, once, on first use."""
    config = read_json(root / "config.json")
    config["run_id"], config["user_id"] = _dashed(config["run_id"]), _dashed(config["user_id"])
    target: Path = root.parent.parent / config["user_id"] / config["run_id"]
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(root, target)
    write_json(target / "config.json", config)
    return target
