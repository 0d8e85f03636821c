"""Unpacking a checkpoint archive: with tarfile's "data" filter where Python has it, and with the SDK's own check on
Pythons without it (3.11 before 3.11.4, as Debian 12 ships), the same files land and the same members are refused."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from rewardsignal import artifacts


def archive(members: list[tuple[str, bytes | None, bytes]]) -> io.BytesIO:
    """A tar of (name, file data or None for a folder, kind: tarfile's type byte)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buffer.seek(0)
    return buffer


@pytest.fixture(params=["data_filter", "own_check"])
def unpacking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "own_check":  # stands in for an older Python: the standard library's attribute, not ours
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile.data_filter")
    return str(request.param)


def test_plain_files_and_folders_land_without_the_top_folder(unpacking: str, tmp_path: Path) -> None:
    tar = archive([("ckpt", None, tarfile.DIRTYPE), ("ckpt/adapter", None, tarfile.DIRTYPE),
                   ("ckpt/adapter/weights.bin", b"\x00\x01weights", tarfile.REGTYPE),
                   ("ckpt/meta.json", b'{"step": 3}', tarfile.REGTYPE)])
    target = artifacts.unpack(tar, tmp_path / "out")
    assert (target / "adapter" / "weights.bin").read_bytes() == b"\x00\x01weights"
    assert (target / "meta.json").read_text() == '{"step": 3}'
    assert sorted(p.name for p in target.iterdir()) == ["adapter", "meta.json"]


@pytest.mark.parametrize("name, kind", [("ckpt/../../escape.txt", tarfile.REGTYPE), ("ckpt/link", tarfile.SYMTYPE)])
def test_a_member_pointing_outside_is_refused(unpacking: str, tmp_path: Path, name: str, kind: bytes) -> None:
    tar = archive([("ckpt", None, tarfile.DIRTYPE), (name, b"x" if kind == tarfile.REGTYPE else None, kind)])
    with pytest.raises(tarfile.TarError):
        artifacts.unpack(tar, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "out" / "link").exists()
