"""DATA_DIR/server.json: the URL of the server that serves this data directory, for `signal login-link`.

The server writes `{url, pid}` at start and removes it at a clean shutdown. A reader trusts it only while that
pid lives: a server that was killed leaves the file behind, and several servers may share a data directory
(the last one started is named; when it stops, readers fall back to the settings).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE_NAME = "server.json"


def path_in(data_dir: Path) -> Path:
    return data_dir / FILE_NAME


def record(data_dir: Path, url: str) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    target = path_in(data_dir)
    partial = target.with_name(f".{FILE_NAME}.{os.getpid()}")
    partial.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(partial, target)  # a reader sees the old file or the new one, never half of one


def forget(data_dir: Path) -> None:
    """Remove the file if it still names this process (another server may have started since)."""
    target = path_in(data_dir)
    if _read(target).get("pid") == os.getpid():
        target.unlink(missing_ok=True)


def running_url(data_dir: Path) -> tuple[str | None, str]:
    """The URL of the live server recorded in `data_dir`, or None and why there is none."""
    target = path_in(data_dir)
    recorded = _read(target)
    url, pid = recorded.get("url"), recorded.get("pid")
    if not isinstance(url, str) or not isinstance(pid, int):
        return None, f"no running server has recorded its URL in {target}"
    if not _alive(pid):
        return None, f"the server recorded in {target} (pid {pid}) is no longer running"
    return url, f"the server recorded in {target} (pid {pid})"


def _read(target: Path) -> dict[str, object]:
    try:
        data = json.loads(target.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: asks whether the process exists, sends nothing
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True
