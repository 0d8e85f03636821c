"""The local runtime process (also `python -m gpu_runtime.worker`): one Engine, requests in on stdin, answers out on stdout, many in flight.

    python -m gpu_runtime.runtime_process --data-dir D [--device auto] [--options JSON] [--allow-downloads] [--socket [--spawned]]

With --socket (`signal runtime`) it serves the data directory's Unix socket instead (D/runtime.sock, guarded
by an flock on D/runtime.lock, so a second runtime on D refuses): any number of server processes connect,
each greeted with the ready line, and their calls share the one engine (per-run order across them is the
servers' tickets, see scheduler.py). --spawned: started by a server that found no runtime; it reports
readiness (or that another runtime holds the lock) on stdout, and exits once its last client has gone.

Protocol (gpu_runtime/client/protocol.py): one JSON object per line each way; every request has an id and
its answer carries it back, in whatever order the scheduler finishes them. A reader thread queues
requests; the main thread runs the engine's ticks. At end of input the runtime finishes what it
has, snapshots every run that changed, and exits. Only protocol messages reach the real stdout;
everything else (library prints, warnings, tqdm) goes to stderr, so nothing can corrupt the channel.

Failpoints for the crash tests: SIGNAL_RUNTIME_FAULTS=before_journal,after_journal,during_snapshot
kills the process (SIGKILL) at that point, as a power cut would; die_in_prepare kills it while preparing any call
whose request id starts with "poison" (a call that crashes the runtime each time it is sent). enospc_journal and
enospc_snapshot raise ENOSPC at that write instead (tests/faults/test_disk_full.py). hold_decode stops a decode group
with a sample whose request id starts with "hold" after its first chunk, until a cancel (tests/faults/test_deadlines.py);
hold_streams does so with every streamed sample, once it has sent its first chunk, and hold_v1 with every /v1 sample.
during_save kills it once a checkpoint's or a named snapshot's files are written, before they are renamed in place;
during_swap once an existing one of that name is moved aside, before its replacement is renamed in
(tests/faults/test_interrupted_saves.py).
during_compaction kills it once a snapshot has deleted the first journal segment it made redundant, before the rest
(tests/gpu_runtime/test_journal_compaction.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import IO, Any

from gpu_runtime.client.protocol import (
    HEARTBEAT,
    LOCK_HELD,
    LineWriter,
    answer_message,
    decode,
    encode,
    greeting,
    read_call,
    runtime_lock,
    runtime_socket,
)
from gpu_runtime.contract import Result
from gpu_runtime.contract.json_types import JSONObject, as_json
from gpu_runtime.errors import BadInput, FailedPrecondition, SignalError


def claim_stdout() -> IO[bytes]:
    """Keep the real stdout for the protocol; point fd 1 and sys.stdout at stderr."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


# A server connects within moments of the runtime it spawned saying ready; one that never does has died.
FIRST_CLIENT_SECONDS = 60.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpu_runtime.runtime_process", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--options", default="{}", help="RuntimeOptions as a JSON object")
    parser.add_argument("--allow-downloads", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch's CPU threads (SIGNAL_THREADS); "
                        "default: torch's own")
    parser.add_argument("--socket", action="store_true", help="serve DATA_DIR/runtime.sock to many servers")
    parser.add_argument("--spawned", action="store_true", help="with --socket: started by a server; report "
                        "readiness on stdout, exit when the last client leaves")
    parser.add_argument("--first-client-seconds", type=float, default=FIRST_CLIENT_SECONDS,
                        help="with --spawned: exit if no client has connected by then (the server that started "
                        "us died first)")
    return parser.parse_args(argv)


CLOSE_SECONDS = 30.0  # how long a closing channel waits for a client that stopped reading its last answers


class Channel:
    """Answers to the protocol stream, one whole line at a time, from any thread, written by a thread of their own:
    the request reader answers a heartbeat or a refusal without ever waiting on a client that is not reading."""

    def __init__(self, stream: IO[bytes] | socket.SocketIO) -> None:
        self.writer = LineWriter(stream, "answers")
        self.unanswered = 0  # requests handed to the engine whose answer is not yet written
        self.answered = threading.Condition()

    def send(self, message: JSONObject, written: Any = None, urgent: bool = False) -> None:
        try:
            line = encode(message)
        except (TypeError, ValueError) as exc:  # a result that is not JSON-able is a bug: say so, typed
            line = encode({"id": message.get("id"), "error": {"type": "InternalError", "code": "INTERNAL",
                                                              "message": f"unserialisable answer: {exc}", "field": None}})
        if not self.writer.put(line, urgent=urgent, written=written) and written is not None:
            written()  # the client has gone: its call was applied (and journaled) all the same

    def replier(self, request_id: Any) -> Any:
        with self.answered:
            self.unanswered += 1

        def written() -> None:
            with self.answered:
                self.unanswered -= 1
                self.answered.notify_all()

        def reply(answer: Result | SignalError) -> None:
            self.send({"id": request_id, **answer_message(answer)}, written)

        return reply

    def progress(self, request_id: Any) -> Any:
        """A streamed call's chunks, each a line {"id", "chunk"} before its answer."""
        return lambda chunk: self.send({"id": request_id, "chunk": chunk.to_dict()})

    def wait_answered(self) -> None:
        with self.answered:
            self.answered.wait_for(lambda: self.unanswered == 0)

    def close(self) -> None:
        """After the last answer: the stream closes once every queued line is out."""
        self.writer.close()
        self.writer.join(CLOSE_SECONDS)


def read_requests(engine: Any, channel: Channel, stream: IO[bytes]) -> None:
    """Parse each line of `stream` and hand it to the engine, until end of input."""
    for line in stream:
        if not line.strip():
            continue
        try:
            request = decode(line)
        except ValueError as exc:
            channel.send({"id": None, "error": BadInput(f"request is not a JSON object: {exc}", field="request").to_dict()})
            continue
        if request.get("method") == HEARTBEAT:  # on this thread: it must answer while a tick runs
            channel.send({"id": as_json(request.get("id")), "result": engine.heartbeat()}, urgent=True)
            continue
        reply = channel.replier(request.get("id"))
        params = request.get("params") or {}
        try:
            call, ticket = read_call(request.get("method"), params)
        except SignalError as exc:
            if isinstance(params, dict):  # never queued: its ticket is released, not waited for
                engine.scheduler.release_ticket(params.get("run_id"), params.get("ticket"))
            reply(exc)
            continue
        engine.submit(call, reply, channel.progress(request.get("id")), ticket)


def read_stdin(engine: Any, channel: Channel) -> None:
    """The pipe's reader thread: at end of input (the server closed it), close the queue."""
    read_requests(engine, channel, sys.stdin.buffer)
    engine.scheduler.close()


def take_lock(path: Path) -> IO[str]:
    """Hold `path` (flock) for this process's life, our pid in it; FailedPrecondition when another runtime does."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise FailedPrecondition(f"a runtime (pid {holder}) already serves {path.parent}: it holds {path}",
                                 field=LOCK_HELD) from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


class SocketServer:
    """The runtime on the data directory's Unix socket: one Channel per connected server process."""

    def __init__(self, path: Path, exit_when_unused: bool) -> None:
        self.path = path
        self.exit_when_unused = exit_when_unused
        path.unlink(missing_ok=True)  # a dead runtime's socket: we hold the lock, so nobody else serves it
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(128)  # bound before the engine loads: clients connect now, greeted once it is up
        self.connections: set[socket.socket] = set()
        self.channels: set[Channel] = set()  # drained before the process exits: their answers are written by a thread
        self.lock = threading.Lock()
        self.stopped = False
        self.ever_connected = False

    def start(self, engine: Any) -> None:
        threading.Thread(target=self._accept, args=(engine,), name="accept", daemon=True).start()

    def stop(self, engine: Any) -> None:
        """Take no new calls: stop listening, stop reading; calls already taken are answered, then the engine stops."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            connections = list(self.connections)
        self.listener.close()
        self.path.unlink(missing_ok=True)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        engine.scheduler.close()

    def stop_if_never_used(self, engine: Any) -> None:
        with self.lock:
            never_used = not self.ever_connected
        if never_used:
            print(f"signal runtime: no server connected to {self.path}; exiting", file=sys.stderr, flush=True)
            self.stop(engine)

    def _accept(self, engine: Any) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # stopped
            with self.lock:
                if self.stopped:  # stopped for want of clients as this one arrived: it reconnects or respawns
                    connection.close()
                    return
                self.connections.add(connection)
                self.ever_connected = True
            threading.Thread(target=self._serve, args=(engine, connection), name="client", daemon=True).start()

    def _serve(self, engine: Any, connection: socket.socket) -> None:
        channel = Channel(connection.makefile("wb", buffering=0))
        with self.lock:
            self.channels.add(channel)
        channel.send(greeting(os.getpid()))
        try:
            read_requests(engine, channel, connection.makefile("rb"))
        except OSError:
            pass  # the connection broke: what it sent is still answered (into the void)
        channel.wait_answered()  # the client closed its side: answer what it sent, then close ours
        channel.close()
        connection.close()
        with self.lock:
            self.connections.discard(connection)
            self.channels.discard(channel)
            unused = not self.connections
        if unused and self.exit_when_unused:
            self.stop(engine)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server: SocketServer | None = None
    if args.socket:
        try:
            lock = take_lock(runtime_lock(args.data_dir))  # noqa: F841 - held until the process exits
        except FailedPrecondition as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            if args.spawned:  # the server that started us connects to that runtime instead
                sys.stdout.buffer.write(encode({"ready": False, "error": exc.to_dict()}))
            return 3
        server = SocketServer(runtime_socket(args.data_dir), exit_when_unused=args.spawned)
    protocol = claim_stdout()
    # Imported only now, so anything torch & co print at import goes to stderr.
    from gpu_runtime.contract import RuntimeOptions
    from gpu_runtime.engine.engine import Engine

    if args.threads:  # before the engine loads anything: a CPU runtime's speed on a shared machine depends on it
        import torch

        torch.set_num_threads(args.threads)
    faults = {f for f in os.environ.get("SIGNAL_RUNTIME_FAULTS", "").split(",") if f}
    try:
        options = RuntimeOptions.from_dict(json.loads(args.options))
        engine = Engine(args.data_dir, args.device, options, args.allow_downloads, faults=faults)
    except (SignalError, ValueError) as exc:
        error = exc if isinstance(exc, SignalError) else BadInput(str(exc), field="options")
        if server is None or args.spawned:
            protocol.write(encode({"ready": False, "error": error.to_dict()}))
        print(f"error: {error.message}", file=sys.stderr)
        return 2
    channels: list[Channel] = []
    if server is None:
        channel = Channel(protocol)
        channels.append(channel)
        channel.send(greeting(os.getpid()))
        threading.Thread(target=read_stdin, args=(engine, channel), name="requests", daemon=True).start()
    else:
        serve_socket(server, engine, protocol if args.spawned else None, args.first_client_seconds)
    engine.serve_forever()
    if server is not None:
        with server.lock:
            channels = list(server.channels)
    for channel in channels:  # the last answers are queued on writer threads: out before the process ends
        channel.close()
    return 0


def serve_socket(server: SocketServer, engine: Any, spawner: IO[bytes] | None, first_client_seconds: float) -> None:
    """Greet clients from now on; SIGTERM and SIGINT stop the runtime between ticks, never inside one."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        # In a thread: the handler runs on the engine's thread, which may hold the scheduler's lock.
        signal.signal(signum, lambda *_: threading.Thread(target=server.stop, args=(engine,)).start())
    server.start(engine)
    if spawner is not None:
        spawner.write(encode(greeting(os.getpid())))
        spawner.close()
        timer = threading.Timer(first_client_seconds, server.stop_if_never_used, args=(engine,))
        timer.daemon = True
        timer.start()
    print(f"signal runtime: serving {server.path} (pid {os.getpid()})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
