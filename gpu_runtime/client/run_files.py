"""A run's artifacts, pulled to a local directory: everything needed to re-derive it, and nothing more.

What is pulled (the run's directory, docs/CHECKPOINTS.md): `config.json`, `manifest.jsonl`, `journal/`, the newest snapshot
under `lora_adapters/` (older ones are redundant: the journal covers them), and `checkpoints/`. Half-written
folders (names starting with '.') are left behind. From these files alone the run is re-derived: put them
under a data directory's `runs/{user_id}/{run_id}/` and an Engine restores it (snapshot + journal replay; the
journal reaches back only to the oldest kept snapshot, so the seed alone replays a run only before its first snapshot).

Where the files come from is a `RunFiles`: the local data directory, or a Modal Volume read from outside the
container (the runtime need not be running to pull, which is what "pull before teardown" wants). No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from gpu_runtime.client.persistence import find_run_dir
from gpu_runtime.errors import BadInput, RunNotFound

PULL_RECORD = "pull.json"  # written beside the pulled files: each one's size and sha256, and where it came from
_SNAPSHOT = re.compile(r"lora_adapters/step_(\d+)/")


class RunFiles(Protocol):
    source: str  # said in pull.json

    def list(self) -> list[str]: ...  # every file of the run, as a POSIX path relative to its directory

    def read(self, path: str) -> Iterator[bytes]: ...


def select_artifacts(paths: list[str]) -> list[str]:
    """The files worth pulling, from a listing of the run's directory."""
    whole = [p for p in paths if not any(part.startswith(".") for part in PurePosixPath(p).parts)]
    snapshots = [int(m.group(1)) for p in whole if (m := _SNAPSHOT.match(p))]
    newest = f"lora_adapters/step_{max(snapshots)}/" if snapshots else None
    chosen = []
    for path in whole:
        top = PurePosixPath(path).parts[0]
        if path in ("config.json", "manifest.jsonl") or top in ("journal", "checkpoints"):
            chosen.append(path)
        elif top == "lora_adapters" and newest is not None and path.startswith(newest):
            chosen.append(path)
    return sorted(chosen)


@dataclass(frozen=True)
class PulledFile:
    path: str
    size: int
    sha256: str


def pull_run(files: RunFiles, dest: Path) -> list[PulledFile]:
    """Copy the run's artifacts into `dest` (created; refused when it holds anything), all or nothing."""
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BadInput(f"{dest} already exists and is not empty; pull into a new directory", field="dir")
    listing = files.list()
    if "config.json" not in listing:
        raise RunNotFound(f"{files.source} holds no run (no config.json)", field="run_id")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.pull-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        pulled: list[PulledFile] = []
        for path in select_artifacts(listing):
            target = tmp / path
            target.parent.mkdir(parents=True, exist_ok=True)
            digest, size = hashlib.sha256(), 0
            with open(target, "wb") as out:
                for chunk in files.read(path):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            pulled.append(PulledFile(path, size, digest.hexdigest()))
        (tmp / PULL_RECORD).write_text(json.dumps({"source": files.source, "files": [asdict(f) for f in pulled]}, indent=2) + "\n")
        if dest.exists():
            dest.rmdir()  # empty (checked above)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return pulled


class LocalRunFiles:
    """A run in this machine's data directory (the local backend)."""

    def __init__(self, data_dir: Path, run_id: str) -> None:
        root = find_run_dir(Path(data_dir), run_id)
        if root is None:
            raise RunNotFound(f"run {run_id!r} not found under {Path(data_dir) / 'runs'}", field="run_id")
        self.root = root
        self.source = str(root)

    def list(self) -> list[str]:
        return [p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()]

    def read(self, path: str) -> Iterator[bytes]:
        with open(self.root / path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                yield chunk


class VolumeRunFiles:
    """A run on a Modal Volume (`runs/{user_id}/{run_id}/` at the Volume's root), read with Modal's client:
    needs Modal credentials, not the runtime."""

    def __init__(self, volume_name: str, user_id: str, run_id: str) -> None:
        import modal

        self.volume = modal.Volume.from_name(volume_name)
        self.prefix = f"runs/{user_id}/{run_id}"
        self.source = f"modal volume {volume_name}:/{self.prefix}"

    def list(self) -> list[str]:
        from modal.types import FileEntryType

        try:
            entries = self.volume.listdir(self.prefix, recursive=True)
        except Exception as exc:  # noqa: BLE001 - modal's NotFoundError and its kin
            raise RunNotFound(f"{self.source}: {exc}", field="run_id") from None
        files = [e.path.lstrip("/") for e in entries if e.type == FileEntryType.FILE]
        return [PurePosixPath(p).relative_to(self.prefix).as_posix() for p in files]

    def read(self, path: str) -> Iterator[bytes]:
        yield from self.volume.read_file(f"{self.prefix}/{path}")
