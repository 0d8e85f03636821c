"""A directory as a tar archive, produced as it is read, with its exact length known before the first byte.

Checkpoint downloads (issue 18, bug 7) stream this instead of writing a .tar.gz to a temporary file first: a 0.5 GB
merged checkpoint starts at once, and the Content-Length lets the browser's download bar show progress. The
headers are tarfile's own (`TarInfo.tobuf`), so any tar reader opens the result; only the layout (a header, the
data padded to 512 bytes, two zero blocks, padding to a 10 KiB record) is written here.
"""

from __future__ import annotations

import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20  # bytes read and sent at a time
# gzip at level 1: model weights barely compress, and a higher level only makes the download wait on the CPU.
GZIP_LEVEL = 1


@dataclass(frozen=True)
class Member:
    header: bytes
    path: Path | None  # None: a directory
    size: int


@dataclass(frozen=True)
class TarStream:
    """`members` listed once, up front: `size` is what `chunks` yields, exactly, unless a file changes meanwhile."""

    members: tuple[Member, ...]

    @classmethod
    def of_directory(cls, source: Path, top: str) -> TarStream:
        """`source`'s directories and regular files under one top-level folder `top`, in sorted order; links and
        other special files are left out (a checkpoint has none)."""
        paths = [source, *sorted(source.rglob("*"))]
        members = []
        for path in paths:
            stat = path.lstat()
            name = top if path == source else f"{top}/{path.relative_to(source).as_posix()}"
            info = tarfile.TarInfo(name)
            info.mtime = int(stat.st_mtime)
            if path.is_dir() and not path.is_symlink():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                members.append(Member(info.tobuf(tarfile.PAX_FORMAT), None, 0))
            elif path.is_file() and not path.is_symlink():
                info.size, info.mode = stat.st_size, 0o644
                members.append(Member(info.tobuf(tarfile.PAX_FORMAT), path, stat.st_size))
        return cls(tuple(members))

    @property
    def size(self) -> int:
        body = sum(len(m.header) + _padded(m.size) for m in self.members) + 2 * tarfile.BLOCKSIZE
        return _padded(body, tarfile.RECORDSIZE)

    def chunks(self) -> Iterator[bytes]:
        """The archive's bytes; a file that shrank since the listing ends the stream early (the client sees fewer
        bytes than the Content-Length), one that grew is cut at its listed size."""
        sent = 0
        for member in self.members:
            yield member.header
            sent += len(member.header)
            if member.path is None:
                continue
            left = member.size
            with member.path.open("rb") as file:
                while left:
                    chunk = file.read(min(CHUNK, left))
                    if not chunk:
                        raise OSError(f"{member.path} shrank while it was being sent")
                    left -= len(chunk)
                    yield chunk
            pad = _padded(member.size) - member.size
            sent += member.size + pad
            if pad:
                yield bytes(pad)
        yield bytes(self.size - sent)  # the two end blocks and the record's padding

    def gzipped(self) -> Iterator[bytes]:
        """The same archive as a gzip stream (its length is unknown until the end)."""
        return gzip_chunks(self.chunks())


def gzip_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # 16+: a gzip header and trailer
    for chunk in chunks:
        if out := compressor.compress(chunk):
            yield out
    yield compressor.flush()


def _padded(size: int, unit: int = tarfile.BLOCKSIZE) -> int:
    return -(-size // unit) * unit
