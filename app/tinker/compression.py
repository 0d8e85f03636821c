"""Request bodies in Tinker's encodings: identity, or zstd (what the SDK sends for forward_backward when client/config
answers `proto_compress_fwdbwd: true`). A zstd body is decompressed as a stream and stops one byte past
SIGNAL_MAX_REQUEST_BYTES: a few kilobytes that would expand past the bound (a zstd bomb) are a 413, never a
buffer of the claimed size."""

from __future__ import annotations

import zstandard
from starlette.requests import Request

from app.errors import BadInput, PayloadTooLarge

ENCODINGS = ("identity", "", "zstd")


async def request_body(request: Request, limit: int) -> bytes:
    raw = await request.body()
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ENCODINGS:
        raise BadInput(f"Content-Encoding {encoding!r} is not supported (zstd or identity)", field="body")
    if encoding != "zstd":
        return raw
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
            body = reader.read(limit + 1)
    except zstandard.ZstdError as exc:
        raise BadInput(f"the body is not valid zstd: {exc}", field="body") from None
    if len(body) > limit:
        raise PayloadTooLarge(f"the body decompresses past SIGNAL_MAX_REQUEST_BYTES ({limit} bytes)", field="body")
    return body
