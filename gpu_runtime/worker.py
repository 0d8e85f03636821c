"""The local runtime process: one Engine, requests in on stdin, answers out on stdout, many in flight.

    python -m gpu_runtime.worker --data-dir D [--device auto] [--options JSON] [--allow-downloads]

Protocol (gpu_runtime/protocol.py): one JSON object per line each way; every request has an id and
its answer carries it back, in whatever order the scheduler finishes them. A reader thread queues
requests; the main thread runs the engine's ticks. At end of input the runtime finishes what it
has, snapshots every run that changed, and exits. Only protocol messages reach the real stdout;
everything else (library prints, warnings, tqdm) goes to stderr, so nothing can corrupt the channel.

Failpoints for the crash tests: SIGNAL_RUNTIME_FAULTS=before_journal,after_journal,during_snapshot
kills the process (SIGKILL) at that point, as a power cut would.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from typing import IO, Any

from gpu_runtime.errors import BadInput, SignalError
from gpu_runtime.protocol import decode, encode


def claim_stdout() -> IO[bytes]:
    """Keep the real stdout for the protocol; point fd 1 and sys.stdout at stderr."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpu_runtime.worker", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--options", default="{}", help="RuntimeOptions as a JSON object")
    parser.add_argument("--allow-downloads", action="store_true")
    return parser.parse_args(argv)


class Channel:
    """Answers to the protocol stream, one whole line at a time, from any thread."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        try:
            line = encode(message)
        except (TypeError, ValueError) as exc:  # a result that is not JSON-able is a bug: say so, typed
            line = encode({"id": message.get("id"), "error": {"type": "InternalError", "code": "INTERNAL",
                                                              "message": f"unserialisable answer: {exc}", "field": None}})
        with self.lock:
            self.stream.write(line)

    def replier(self, request_id: Any) -> Any:
        return lambda message: self.send({"id": request_id, **message})


def read_requests(engine: Any, channel: Channel) -> None:
    """The reader thread: parse each line and hand it to the engine; at EOF, close the queue."""
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            request = decode(line)
        except ValueError as exc:
            channel.send({"id": None, "error": BadInput(f"request is not a JSON object: {exc}", field="request").to_dict()})
            continue
        engine.submit(request.get("method"), request.get("params") or {}, channel.replier(request.get("id")))
    engine.scheduler.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    protocol = claim_stdout()
    # Imported only now, so anything torch & co print at import goes to stderr.
    from gpu_runtime.contract import RuntimeOptions
    from gpu_runtime.engine import Engine

    faults = {f for f in os.environ.get("SIGNAL_RUNTIME_FAULTS", "").split(",") if f}
    try:
        options = RuntimeOptions.from_dict(json.loads(args.options))
        engine = Engine(args.data_dir, args.device, options, args.allow_downloads, faults=faults)
    except (SignalError, ValueError) as exc:
        error = exc if isinstance(exc, SignalError) else BadInput(str(exc), field="options")
        protocol.write(encode({"ready": False, "error": error.to_dict()}))
        return 2
    channel = Channel(protocol)
    channel.send({"ready": True, "pid": os.getpid()})
    threading.Thread(target=read_requests, args=(engine, channel), name="requests", daemon=True).start()
    engine.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
