"""Checkpoints as `Artifact`s, and fetching one's files: the archive from this client's own server, checked, then
unpacked safely."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from rewardsignal.errors import AuthenticationError, NotFoundError, ServerError, error_for_code
from rewardsignal.results import CheckpointResult, Result

# Checkpoint downloads ask for the plain tar: model weights barely compress, and the server can then say its length.
ARCHIVE_ACCEPT = {"Accept": "application/x-tar"}


class Downloads(Protocol):
    """What an Artifact needs of its client (ClientBase has it): the download itself, blocking or awaitable."""

    def _download(self, url: str, directory: str | os.PathLike[str]) -> Any: ...


class Artifact(CheckpointResult):
    """A checkpoint (what save_state and checkpoints() return): its fields, and `download(dir)`, which fetches
    its files from the server as an archive and unpacks them into `dir` (awaitable on the async client)."""

    def __init__(self, info: Result, client: Downloads) -> None:
        super().__init__(info)
        self._client = client

    def download(self, directory: str | os.PathLike[str]) -> Any:
        return self._client._download(self["download_url"], directory)


def on_own_server(base_url: str, url: str) -> str:
    """The key is only ever sent to this client's server: a URL naming another origin (the server's
    SIGNAL_PUBLIC_URL, say, seen through a tunnel) is fetched at the same path on `base_url`."""
    mine, theirs = urlsplit(base_url), urlsplit(urljoin(base_url + "/", url))
    if (theirs.scheme, theirs.netloc) == (mine.scheme, mine.netloc):
        return theirs.geturl()
    return urlunsplit((mine.scheme, mine.netloc, theirs.path, theirs.query, ""))


def check_download(response: httpx.Response, url: str) -> None:
    """Raise the typed error for a download that did not answer 200 (its body read first)."""
    if response.status_code == 200:
        return
    if not response.is_stream_consumed:
        response.read()
    message = f"download of {url} answered HTTP {response.status_code}: {response.text[:200]}"
    code = response.headers.get("x-signal-error-code")  # the server's typed errors name their code
    if code:
        raise error_for_code(code, message)
    cls = {401: AuthenticationError, 403: AuthenticationError, 404: NotFoundError}.get(response.status_code, ServerError)
    raise cls(message)


def unpack(archive: IO[bytes], directory: str | os.PathLike[str]) -> Path:
    """Unpack a checkpoint archive into `directory`, without its one top-level folder; only plain files and
    folders inside `directory` (tarfile's "data" filter refuses links out, absolute paths and devices)."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    archive.seek(0)
    with tarfile.open(fileobj=archive, mode="r:*") as tar:  # a plain tar, or a .tar.gz from older servers
        members = []
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 2:
                continue  # the top-level folder itself
            member.name = str(Path(*parts[1:]))
            members.append(member)
        if hasattr(tarfile, "data_filter"):
            tar.extractall(target, members=members, filter="data")
        else:
            extract_plain(tar, members, target)
    return target


def extract_plain(tar: tarfile.TarFile, members: list[tarfile.TarInfo], target: Path) -> None:
    """What the "data" filter allows, for Pythons without it (3.11 before 3.11.4, Debian 12's 3.11.2): folders and
    regular files inside `target` only; a link, a device, an absolute path or a `..` is refused, naming the member."""
    root = target.resolve()
    for member in members:
        path = (root / member.name).resolve()
        if Path(member.name).is_absolute() or ".." in Path(member.name).parts or not path.is_relative_to(root):
            raise tarfile.TarError(f"archive member {member.name!r} points outside the download folder")
        if member.isdir():
            path.mkdir(parents=True, exist_ok=True)
        elif member.isreg():
            path.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # a regular file's data
            with source, open(path, "wb") as out:
                shutil.copyfileobj(source, out)
        else:
            raise tarfile.TarError(f"archive member {member.name!r} is not a plain file or folder")
