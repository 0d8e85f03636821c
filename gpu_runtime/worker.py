"""The local worker: one Engine answering JSON-line requests on stdin/stdout, one at a time.

    python -m gpu_runtime.worker --data-dir D --device auto --max-batch-size 64 --keep-steps 3 [--allow-downloads]

Only protocol messages reach the real stdout; everything else (library prints, warnings, tqdm)
goes to stderr, so nothing can corrupt the channel.
"""

from __future__ import annotations

import argparse
import json
import inspect
import os
import sys
import traceback
from typing import IO, Any

from gpu_runtime.errors import BadInput, InternalError, SignalError
from gpu_runtime.protocol import decode, encode


def claim_stdout() -> IO[bytes]:
    """Keep the real stdout for the protocol; point fd 1 and sys.stdout at stderr."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpu_runtime.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--options", default="{}", help="RuntimeOptions as JSON")
    parser.add_argument("--allow-downloads", action="store_true")
    return parser.parse_args(argv)


def handle(engine: Any, methods: tuple[str, ...], line: bytes) -> dict[str, Any]:
    request_id = None
    try:
        request = decode(line)
        request_id = request.get("id")
        method, params = request.get("method"), request.get("params") or {}
        if method not in methods:
            raise BadInput(f"unknown method {method!r}; the worker answers {list(methods)}", field="method")
        if not isinstance(params, dict):
            raise BadInput("params must be an object", field="params")
        function = getattr(engine, method)
        try:
            inspect.signature(function).bind(**params)
        except TypeError as exc:
            raise BadInput(f"{method}: {exc}", field="params") from None
        result = function(**params)
        encode({"result": result})  # fail here, typed, if the result is not JSON-able
        return {"id": request_id, "result": result}
    except SignalError as exc:
        return {"id": request_id, "error": exc.to_dict()}
    except ValueError as exc:  # unparseable request line
        if request_id is None:
            return {"id": None, "error": BadInput(f"request is not a JSON object: {exc}", field="request").to_dict()}
        return _internal(request_id, exc)
    except Exception as exc:  # noqa: BLE001 - the worker must outlive any one request
        return _internal(request_id, exc)


def _internal(request_id: Any, exc: BaseException) -> dict[str, Any]:
    traceback.print_exc(file=sys.stderr)
    return {"id": request_id, "error": InternalError(f"{type(exc).__name__}: {exc}").to_dict()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = claim_stdout()
    # Imported only now, so anything torch & co print at import goes to stderr.
    from gpu_runtime.engine import PUBLIC_METHODS, Engine

    try:
        from gpu_runtime.contract import RuntimeOptions

        options = RuntimeOptions.from_dict(json.loads(args.options))
        engine = Engine(args.data_dir, args.device, options.max_batch_size, 3, args.allow_downloads)
    except SignalError as exc:
        protocol.write(encode({"ready": False, "error": exc.to_dict()}))
        return 2
    protocol.write(encode({"ready": True, "pid": os.getpid()}))
    for line in sys.stdin.buffer:
        if line.strip():
            protocol.write(encode(handle(engine, PUBLIC_METHODS, line)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
