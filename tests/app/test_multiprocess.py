"""Several server processes, one runtime: `signal runtime` on the data directory's socket, two uvicorn servers
(one of them `--workers 2`) started at once on one database. Calls on one run alternate between the servers and
apply in order; a subscriber on one server sees the metrics made through the other; migrations and the admin's
bootstrap ran once. On SQLite (make test) and PostgreSQL (make test-postgres) alike."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import websockets
from websockets.typing import Subprotocol

from app.db import Database
from app.services.keys import KeyService
from app.services.login_links import LoginLinkService
from app.services.users import UserService
from app.settings import Settings
from rewardsignal import SignalClient
from rewardsignal.operations import document
from tests.helpers.live_server import TINY_MODEL, free_port, write_catalog

REPO = Path(__file__).resolve().parents[2]
BATCH = [{"text": "one run, two servers, one order"}]
CSRF = re.compile(r'"X-CSRF-Token": "([^"]+)"')  # every dashboard page's hx-headers
STARTUP_S = 240  # three Python processes and the runtime's torch import, on two busy cores


@dataclass
class Process:
    """A child process whose output lines are collected, so a test waits for a line instead of sleeping."""

    popen: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def start(cls, args: list[str], env: dict[str, str], cwd: Path) -> Process:
        popen = subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        process = cls(popen)
        threading.Thread(target=process._collect, args=(popen.stdout,), daemon=True).start()
        return process

    def _collect(self, stream: IO[str]) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line.rstrip("\n"))
                self.changed.notify_all()
        self.popen.wait()  # reaped before the last notice, so a waiter sees that it exited
        with self.changed:
            self.changed.notify_all()

    def wait_for_line(self, pattern: str, count: int = 1, timeout: float = STARTUP_S) -> None:
        def seen() -> bool:
            return sum(bool(re.search(pattern, line)) for line in self.lines) >= count or self.popen.poll() is not None

        with self.changed:
            if not self.changed.wait_for(seen, timeout) or self.popen.poll() is not None:
                raise AssertionError(f"waiting for {pattern!r}; output so far:\n" + "\n".join(self.lines[-40:]))

    @property
    def output(self) -> str:
        with self.changed:
            return "\n".join(self.lines)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()  # SIGTERM: uvicorn shuts down gracefully; the runtime snapshots and exits
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@dataclass
class Cluster:
    data_dir: Path
    env: dict[str, str]
    runtime: Process
    servers: dict[str, Process]  # "a": uvicorn --workers 2, "b": one process
    urls: dict[str, str]

    def admin_key(self) -> str:
        keys = re.findall(r"SIGNAL_API_KEY=(\S+)", "\n".join(server.output for server in self.servers.values()))
        assert len(keys) == 1, f"the first start's admin key was printed {len(keys)} times"
        return keys[0]


def _env(data_dir: Path, tiny_model_dir: str) -> dict[str, str]:
    """The servers' and the runtime's settings, as an operator sets them: environment variables only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIGNAL_") or k in ("SIGNAL_DATABASE_URL", "SIGNAL_THREADS")}
    env.update({
        "SIGNAL_DATA_DIR": str(data_dir), "SIGNAL_MODELS_FILE": str(write_catalog(data_dir / "models.yaml", tiny_model_dir)),
        "SIGNAL_DEFAULT_MODEL": TINY_MODEL, "SIGNAL_DEVICE": "cpu", "SIGNAL_BOOTSTRAP_ADMIN": "true",
        "SIGNAL_LOG_LEVEL": "info", "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false",
    })
    return env


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    data_dir = tmp_path_factory.mktemp("multi")
    env = _env(data_dir, tiny_model_dir)
    # The runtime first, alone: the servers must connect to it, not start their own.
    runtime = Process.start([sys.executable, "-m", "app.cli", "runtime"], env, data_dir)
    processes = [runtime]
    try:
        runtime.wait_for_line(r"signal runtime: serving .*runtime\.sock")
        ports = {"a": free_port(), "b": free_port()}
        uvicorn = [sys.executable, "-m", "uvicorn", "app.server:create_app", "--factory", "--host", "127.0.0.1"]
        # Both at once on an empty database: migrations and the first start's bootstrap race, and must run once.
        servers = {"a": Process.start([*uvicorn, "--port", str(ports["a"]), "--workers", "2"], env, data_dir),
                   "b": Process.start([*uvicorn, "--port", str(ports["b"])], env, data_dir)}
        processes += servers.values()
        servers["a"].wait_for_line("Application startup complete", count=2)
        servers["b"].wait_for_line("Application startup complete")
        yield Cluster(data_dir, env, runtime, servers, {name: f"http://127.0.0.1:{port}" for name, port in ports.items()})
    finally:
        for process in reversed(processes):
            process.stop()


def test_migrations_and_the_first_start_ran_once_and_every_server_uses_the_one_runtime(cluster: Cluster) -> None:
    key = cluster.admin_key()  # exactly one process bootstrapped the admin
    run = SignalClient(api_key=key, base_url=cluster.urls["a"]).create_run(lora_r=4)
    run.forward_backward(batch=BATCH)
    for url in cluster.urls.values():
        body = httpx.post(f"{url}/graphql", json={"query": "{ runtime }"}, headers={"Authorization": f"Bearer {key}"},
                          timeout=120).json()
        assert "errors" not in body
        assert run.id in {r["run_id"] for r in body["data"]["runtime"]["resident_runs"]}
    for server in cluster.servers.values():
        assert "signal runtime: serving" not in server.output  # no server started a runtime of its own
    # A second runtime on the same data directory refuses, naming the one that runs.
    second = subprocess.run([sys.executable, "-m", "app.cli", "runtime"], env=cluster.env, cwd=cluster.data_dir,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode != 0
    assert f"a runtime (pid {cluster.runtime.popen.pid}) already serves" in second.stderr


def test_calls_on_one_run_alternate_between_servers_and_apply_in_order(cluster: Cluster) -> None:
    key = cluster.admin_key()
    clients = {name: SignalClient(api_key=key, base_url=url) for name, url in cluster.urls.items()}
    run = clients["a"].create_run(lora_r=4, seed=3)
    handles = {name: client.get_run(run.id) for name, client in clients.items()}
    reference = clients["b"].create_run(lora_r=4, seed=3)  # the same run trained through one server only

    losses, steps, expected = [], [], []
    for step in range(4):
        first, second = ("a", "b") if step % 2 == 0 else ("b", "a")
        losses.append(handles[first].forward_backward(batch=BATCH).loss)
        steps.append(handles[second].optim_step(learning_rate=0.05).step)
        expected.append(reference.forward_backward(batch=BATCH).loss)
        reference.optim_step(learning_rate=0.05)
    assert steps == [1, 2, 3, 4]
    assert losses == expected and losses[-1] < losses[0]

    # Calls in flight on both servers at once: each applied once, in one order, then one step for all of them.
    with ThreadPoolExecutor(6) as pool:
        concurrent = list(pool.map(lambda name: handles[name].forward_backward(batch=BATCH), ["a", "b"] * 3))
    assert [result.step for result in concurrent] == [4] * 6
    assert handles["b"].optim_step().step == 5
    assert {name: client.get_run(run.id).step for name, client in clients.items()} == {"a": 5, "b": 5}
    assert len(clients["a"].get_run(run.id).metrics(name="loss:mean")) == 4 + 6


def test_a_sessions_numbers_order_its_calls_across_server_processes(cluster: Cluster) -> None:
    # Pipelined calls of one session on two server processes: seq 2 (optim_step) reaches server b first and waits
    # there until seq 1 (forward_backward), sent to server a, holds its ticket (run_sessions, call_order.py).
    key = cluster.admin_key()
    client = SignalClient(api_key=key, base_url=cluster.urls["a"])
    run, reference = client.create_run(lora_r=4, seed=5), client.create_run(lora_r=4, seed=5)
    ref_fb, ref_opt = reference.forward_backward(batch=BATCH), reference.optim_step(learning_rate=0.05)
    session = uuid.uuid4().hex

    def call(server: str, operation: str, variables: dict[str, Any]) -> dict[str, Any]:
        body = httpx.post(f"{cluster.urls[server]}/graphql", json={"query": document(operation), "variables": variables},
                          headers={"Authorization": f"Bearer {key}"}, timeout=300).json()
        assert "errors" not in body, body
        return dict(body["data"])

    with ThreadPoolExecutor(1) as pool:
        later = pool.submit(call, "b", "OptimStep", {"runId": run.id, "adam": {"learningRate": 0.05},
                                                     "seq": 2, "session": session})
        cluster.servers["b"].wait_for_line(rf"run {run.id}: call 2 of session {session} waits for call 1")
        fb = call("a", "ForwardBackward", {"runId": run.id, "batch": BATCH, "seq": 1, "session": session})
        opt = later.result(timeout=300)
    assert fb["forwardBackward"]["step"] == 0 and opt["optimStep"]["step"] == 1
    assert fb["forwardBackward"]["loss"] == pytest.approx(ref_fb.loss, abs=1e-6)
    assert opt["optimStep"]["gradNorm"] == pytest.approx(ref_opt.grad_norm, rel=1e-6) and ref_opt.grad_norm > 0
    # Admitted because server a's ticket for seq 1 was seen, not after the bound as an unknown session's start.
    assert f"session {session} unknown" not in cluster.servers["b"].output


async def test_a_subscriber_on_one_server_sees_metrics_made_through_the_other(cluster: Cluster) -> None:
    key = cluster.admin_key()
    run = SignalClient(api_key=key, base_url=cluster.urls["a"]).create_run(lora_r=4)
    trainer = {name: SignalClient(api_key=key, base_url=url).get_run(run.id) for name, url in cluster.urls.items()}
    async with _subscription(cluster.urls["b"], key, run.id) as ws:
        await _prime(ws, trainer["b"])
        # Now through the other server (both of its processes, in turn): every event reaches the watcher.
        made: list[tuple[str, Any]] = []
        for _ in range(2):
            made.append(("forward_backward", await asyncio.to_thread(trainer["a"].forward_backward, batch=BATCH)))
            made.append(("optim_step", await asyncio.to_thread(trainer["a"].optim_step)))
        seen = [await _event(ws, timeout=60) for _ in made]
    for (kind, result), event in zip(made, seen):
        assert event is not None and event["kind"] == kind, (kind, event)
        if kind == "forward_backward":
            assert event["loss"] == result.loss and event["numTokens"] == result.num_tokens
        else:
            assert event["step"] == result.step and event["gradNorm"] == result.grad_norm


def test_a_playground_stream_posted_to_one_server_opens_once_on_another(cluster: Cluster) -> None:
    link, key = asyncio.run(_login_link_and_key(cluster, "play@example.com"))
    run = SignalClient(api_key=key, base_url=cluster.urls["a"]).create_run(lora_r=4)
    with httpx.Client(timeout=120) as browser:  # one cookie jar: the session cookie goes to either port
        page = browser.get(f"{cluster.urls['a']}{link}")
        token, csrf = re.search(r'name="token" value="([^"]+)"', page.text), CSRF.search(page.text)
        assert page.status_code == 200 and token and csrf, page.text
        signed = browser.post(f"{cluster.urls['a']}/auth/link", data={"token": token.group(1)},
                              headers={"X-CSRF-Token": csrf.group(1), "HX-Request": "true"})
        assert signed.status_code == 204, signed.text
        csrf = CSRF.search(browser.get(f"{cluster.urls['a']}/keys").text)  # signing in made a fresh session token
        assert csrf
        answer = browser.post(f"{cluster.urls['a']}/playground/stream", headers={"X-CSRF-Token": csrf.group(1)},
                              data={"model": f"run:{run.id}", "prompt": "Hello", "max_tokens": "3"})
        assert answer.status_code == 200, answer.text
        url = answer.text.split('data-stream="')[1].split('"')[0]
        # The POST's process kept it in the database: the other server streams it, and it opens once.
        with browser.stream("GET", f"{cluster.urls['b']}{url}", headers={"Accept": "text/event-stream"}) as events:
            lines = list(events.iter_lines())
        assert "event: done" in lines, lines
        assert browser.get(f"{cluster.urls['a']}{url}").status_code == 404


async def _login_link_and_key(cluster: Cluster, email: str) -> tuple[str, str]:
    """A sign-in path and an API key of `email`, made on the servers' database as `signal login-link` makes one."""
    settings = Settings(data_dir=cluster.data_dir)
    db = Database(settings.resolved_database_url)
    try:
        user, _ = await UserService(db).get_or_create(email)
        link = await LoginLinkService(db, settings.login_link_ttl_s).mint(user)
        return f"/auth/link?token={link}", (await KeyService(db).create(user, "test"))[0]
    finally:
        await db.dispose()


@pytest.mark.skipif(os.environ.get("SIGNAL_TEST_DATABASE") != "postgres", reason="LISTEN/NOTIFY is PostgreSQL's")
async def test_live_metrics_survive_a_dropped_listen_connection(cluster: Cluster, request: pytest.FixtureRequest) -> None:
    key = cluster.admin_key()
    run = SignalClient(api_key=key, base_url=cluster.urls["a"]).create_run(lora_r=4)
    async with _subscription(cluster.urls["b"], key, run.id) as ws:
        await _prime(ws, SignalClient(api_key=key, base_url=cluster.urls["b"]).get_run(run.id))
        # Drop every server's LISTEN connection, as a network blip or a database restart would.
        database = cluster.env["SIGNAL_DATABASE_URL"].rsplit("/", 1)[-1]
        killed = request.getfixturevalue("postgres_cluster").psql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE datname = '{database}' AND query LIKE 'LISTEN%' AND pid <> pg_backend_pid()", database)
        assert int(killed) == 6  # two per server process: the metric feed's and Tinker's futures' (app/pg_listen.py)
        cluster.servers["b"].wait_for_line("live metrics: .*LISTEN connection (closed|lost)", timeout=60)
        trainer = SignalClient(api_key=key, base_url=cluster.urls["a"]).get_run(run.id)
        result = await asyncio.to_thread(trainer.forward_backward, batch=BATCH)
        event = await _event(ws, timeout=60)
    assert event is not None and event["kind"] == "forward_backward" and event["loss"] == result.loss


@contextlib.asynccontextmanager
async def _subscription(url: str, key: str, run_id: str) -> AsyncIterator[Any]:
    async with websockets.connect(url.replace("http", "ws") + "/graphql", subprotocols=[Subprotocol("graphql-transport-ws")]) as ws:
        await ws.send(json.dumps({"type": "connection_init", "payload": {"Authorization": f"Bearer {key}"}}))
        assert json.loads(await ws.recv())["type"] == "connection_ack"
        await ws.send(json.dumps({"id": "1", "type": "subscribe",
                                  "payload": {"query": document("Metrics"), "variables": {"runId": run_id}}}))
        yield ws


async def _prime(ws: Any, local_run: Any) -> None:
    """The subscription has no acknowledgement: it is live once a call through its own server shows up."""
    for _ in range(20):
        await asyncio.to_thread(local_run.forward_backward, batch=BATCH)
        if await _event(ws, timeout=5) is not None:
            return
    raise AssertionError("the subscription never saw a call made through its own server")


async def _event(ws: Any, timeout: float) -> dict[str, Any] | None:
    """The subscription's next event, or None if none comes within `timeout`."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = json.loads(await asyncio.wait_for(ws.recv(), left))
        except TimeoutError:
            return None
        if message["type"] == "next":
            assert not message["payload"].get("errors"), message
            return message["payload"]["data"]["metrics"]
        assert message["type"] not in ("error", "complete"), message
    return None

