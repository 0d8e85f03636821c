"""Checkpoints on the run page and their downloads (issue 18 §8, bug 7). Downloads stream as they are read, no
temporary file, the plain tar's length said up front; `Accept: application/x-tar` gets the tar, anything else keeps
the .tar.gz older SDKs open with "r:gz". The page explains each kind with its size before saving, and gives a "how to
load this" snippet for each kind saved, which runs as shown."""

from __future__ import annotations

import html
import io
import itertools
import json
import os
import re
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import LiveServer
from tests.web.conftest import Visitor, api_key_for

BATCH = [{"input": "The quick brown fox", "output": " jumps over the lazy dog."}]
BIG_FLOATS = 80_000_000  # a 320 MB tensor: past the 300 MB the issue asks for
START_S = 2.0  # seconds from the request to its first bytes, at most (issue 18: "starts within 2 s")
# Files this process opens for writing while `watching` is set (the server runs in this process, in a thread).
WRITES: list[str] = []
watching = threading.Event()
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not watching.is_set() or event not in ("open", "tempfile.mkstemp", "tempfile.mkdtemp"):
        return
    if event != "open":
        WRITES.append(f"{event} {args[0]}")
        return
    path, mode, flags = args
    if (isinstance(mode, str) and set(mode) & set("wax+")) or (isinstance(flags, int) and flags & WRITE_FLAGS):
        WRITES.append(str(path))


sys.addaudithook(_audit)  # hooks cannot be removed: it records nothing unless `watching` is set


@pytest.fixture(scope="module")
def checkpoint(live_server: LiveServer) -> tuple[str, Any, Path]:
    """A key and an adapter checkpoint holding, besides its own files, a sparse 320 MB safetensors file."""
    key = api_key_for(live_server, "downloads@example.com")
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, seed=5)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    saved = run.save_state(mode="adapter")
    folder = Path(saved.checkpoint_path)
    header = json.dumps({"big.weight": {"dtype": "F32", "shape": [BIG_FLOATS], "data_offsets": [0, 4 * BIG_FLOATS]}})
    big = folder / "big.safetensors"
    with big.open("wb") as file:
        file.write(len(header).to_bytes(8, "little") + header.encode())
        file.truncate(8 + len(header) + 4 * BIG_FLOATS)  # sparse: no 320 MB written to this disk
    return key, saved, folder


class Chunks:
    """A response's bytes as a file object tarfile's stream mode reads, counting them."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.buffer, self.received = chunks, b"", 0

    def read(self, size: int) -> bytes:
        while len(self.buffer) < size:
            chunk = next(self.chunks, b"")
            if not chunk:
                break
            self.received += len(chunk)
            self.buffer += chunk
        out, self.buffer = self.buffer[:size], self.buffer[size:]
        return out


def files_in(folder: Path, top: str) -> set[str]:
    return {f"{top}/{path.relative_to(folder).as_posix()}" for path in folder.rglob("*") if path.is_file()}


def test_a_large_checkpoint_streams_as_a_plain_tar_with_its_length(live_server: LiveServer,
                                                                   checkpoint: tuple[str, Any, Path]) -> None:
    key, saved, folder = checkpoint
    WRITES.clear()
    watching.set()
    try:
        asked = time.monotonic()
        with httpx.stream("GET", saved.download_url, timeout=60,
                          headers={"Authorization": f"Bearer {key}", "Accept": "application/x-tar"}) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"] == "application/x-tar"
            assert response.headers["content-disposition"].endswith('.tar"')
            length = int(response.headers["content-length"])
            chunks = response.iter_raw(1 << 20)
            first = next(chunks)
            # The bound on a download's start (the old code gzipped the whole checkpoint to a file first).
            started = time.monotonic() - asked
            stream = Chunks(itertools.chain([first], chunks))
            sizes = {}
            with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]  # a read()-only object, as stream mode needs
                for member in tar:
                    if member.isfile():
                        data = tar.extractfile(member)
                        assert data is not None
                        while data.read(1 << 20):
                            pass
                        sizes[member.name] = member.size
            stream.read(1 << 30)  # the end blocks and padding after the last member
    finally:
        watching.clear()
    assert started <= START_S, f"the first bytes came {started:.2f} s after the request"
    top = next(iter(sizes)).split("/")[0]
    assert set(sizes) == files_in(folder, top)  # every file listed
    assert sizes[f"{top}/big.safetensors"] == (folder / "big.safetensors").stat().st_size > 300_000_000
    assert stream.received == length  # the length said up front is the length sent
    assert WRITES == []  # no temporary file, nor any other file, written while it was served


class BigFileAside:
    """The checkpoint without its 320 MB file, for the tests that need only its format (and not 320 MB of work)."""

    def __init__(self, folder: Path) -> None:
        self.big, self.aside = folder / "big.safetensors", folder.parent / "big.safetensors.aside"

    def __enter__(self) -> None:
        self.big.rename(self.aside)

    def __exit__(self, *exc: object) -> None:
        self.aside.rename(self.big)


def test_other_clients_get_a_gzipped_tar(live_server: LiveServer, checkpoint: tuple[str, Any, Path]) -> None:
    key, saved, folder = checkpoint
    with BigFileAside(folder):
        response = httpx.get(saved.download_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        expected = files_in(folder, "top")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/gzip" and response.content[:2] == b"\x1f\x8b"
    assert "content-length" not in response.headers  # gzipped as it is sent: no length up front
    with tarfile.open(fileobj=io.BytesIO(response.content), mode="r:gz") as tar:  # as SDKs before r:* open it
        names = {member.name for member in tar.getmembers() if member.isfile()}
    top = next(iter(names)).split("/")[0]
    assert names == {name.replace("top/", f"{top}/", 1) for name in expected}


def test_the_sdk_downloads_the_plain_tar(checkpoint: tuple[str, Any, Path], tmp_path: Path) -> None:
    _, saved, folder = checkpoint
    with BigFileAside(folder):
        target = saved.download(tmp_path / "unpacked")
        expected = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()} == expected
    assert (target / "adapter_config.json").read_bytes() == (folder / "adapter_config.json").read_bytes()


def snippet(page: str, mode: str) -> str:
    match = re.search(rf'<pre class="code" tabindex="0" id="load-{mode}">(.*?)</pre>', page, re.DOTALL)
    assert match, f"no {mode} snippet"
    return html.unescape(match.group(1))


def test_each_kind_is_explained_with_its_size_and_loads_as_shown(
        live_server: LiveServer, visitor: Visitor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = api_key_for(live_server, visitor.email)
    run = SignalClient(api_key=key, base_url=live_server.url).create_run(lora_r=4, seed=4)
    run.forward_backward(batch=BATCH)
    run.optim_step()
    adapter = run.save_state(mode="adapter")
    run.save_state(mode="merged")
    run.save_state(mode="state", name="resume-here")
    page = visitor.client.get(f"/runs/{run.id}").text

    lines = dict(re.findall(r'<li data-mode="(\w+)"><strong>\w+</strong> \(about ([^)]+)\)', page))
    assert list(lines) == ["adapter", "merged", "state"]
    estimate = float(lines["adapter"].split()[0]) * {"B": 1, "KB": 1e3, "MB": 1e6}[lines["adapter"].split()[1]]
    assert adapter.size_bytes / 2 < estimate < adapter.size_bytes * 2, (lines, adapter.size_bytes)

    assert f'from_checkpoint="signal://{run.id}/state/resume-here"' in snippet(page, "state")
    assert "PeftModel.from_pretrained(base, folder)" in snippet(page, "adapter")
    # The merged snippet, run as a user would paste it: it downloads the checkpoint and transformers loads it.
    monkeypatch.setenv("SIGNAL_API_KEY", key)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(snippet(page, "merged"), scope)  # noqa: S102 - the page's own snippet, run as a user would
    model = scope["model"]
    shown = re.search(r"<dt>Trainable parameters</dt><dd>([\d,]+) of ([\d,]+)</dd>", page)
    assert shown
    lora, total = (int(group.replace(",", "")) for group in shown.groups())
    # The base's own parameters: the LoRA is folded into them, none added (the run's total counts the LoRA's too).
    assert sum(p.numel() for p in model.parameters()) == total - lora  # type: ignore[attr-defined]
    assert Path(str(scope["folder"])).resolve().parent == tmp_path.resolve()  # unpacked where the user ran it
