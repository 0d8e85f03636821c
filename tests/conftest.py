"""Fixtures shared by every test directory. Heavy imports stay inside fixtures: app tests never pay for torch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from gpu_runtime.engine.engine import Engine
    from tests.helpers.live_server import LiveServer
    from tests.helpers.postgres import Cluster

# One torch intra-op thread in the test process and in every server, runtime and script it starts (they inherit the
# environment): on CI's 2 shared cores, OpenMP's thread per core mostly spins waiting for threads the OS preempted.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The runtime sets torch's threads from SIGNAL_THREADS (default: the cores), over OMP_NUM_THREADS: 1 here too, else a
# 200-token stream of the tiny model takes 70 s instead of 8 s on 2 loaded cores.
os.environ.setdefault("SIGNAL_THREADS", "1")

# `SIGNAL_TEST_DATABASE=postgres` (make test-postgres): every server, CLI and service a test starts uses a fresh
# PostgreSQL database per module, through SIGNAL_DATABASE_URL, as production configures it; else SQLite.
ON_POSTGRES = os.environ.get("SIGNAL_TEST_DATABASE", "sqlite") == "postgres"


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """One PostgreSQL server for the whole session, started on first use; cluster-wide roles made once."""
    from tests.helpers import postgres

    if not postgres.available():
        # CI installs PostgreSQL (.ci/run); elsewhere a machine without it skips, and says so.
        if os.environ.get("CI") or ON_POSTGRES:
            raise RuntimeError("PostgreSQL's binaries are not installed (apt-get install postgresql)")
        pytest.skip("PostgreSQL binaries not installed")
    with postgres.Cluster.start() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def postgres_url(postgres_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """The asyncpg URL of a fresh database on the session's server, dropped after the module."""
    name = postgres_cluster.create_database(request.module.__name__.rsplit(".", 1)[-1])
    yield postgres_cluster.url(name)
    postgres_cluster.drop_database(name)


@pytest.fixture(scope="module", autouse=True)
def _test_database(request: pytest.FixtureRequest) -> Iterator[None]:
    if not ON_POSTGRES:
        yield
        return
    url = request.getfixturevalue("postgres_url")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIGNAL_DATABASE_URL", url)
        yield


@pytest.fixture(scope="module", autouse=True)
def _tinker_sessions_closed() -> Iterator[None]:
    """Every tinker client session a module opens (a ServiceClient's, in a test or a fixture) is closed when the
    module ends. An open one keeps its heartbeat task on tinker's event loop thread, which outlives the module's
    server and, two minutes later, logs "Session heartbeat failed … Tinker is down" every ten seconds until pytest
    exits. Closing only cancels the tasks (no request), so it may come after the server has stopped."""
    try:
        from tinker.lib.internal_client_holder import InternalClientHolder
    except ImportError:  # the tinker extra is not installed: no test here opens a session
        yield
        return
    opened: list[InternalClientHolder] = []
    init = InternalClientHolder.__init__

    def recorded(self: InternalClientHolder, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InternalClientHolder, "__init__", recorded)
        yield
    for holder in opened:
        holder.close()  # idempotent: a client the test closed itself is left as it is


@pytest.fixture
def fresh_database(request: pytest.FixtureRequest) -> Iterator[None]:
    """A database of the test's own, for what only happens on an empty one (the first start's admin). On SQLite a
    fresh data dir is one already; on PostgreSQL the module's is shared, so this makes another."""
    if not ON_POSTGRES:
        yield
        return
    cluster = request.getfixturevalue("postgres_cluster")
    name = cluster.create_database(request.node.name[:30])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SIGNAL_DATABASE_URL", cluster.url(name))
        yield
    cluster.drop_database(name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama with SmolLM2's tokenizer, built once per session; returns its path."""
    from tests.helpers.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-model")
    return build_tiny_model(root / "tiny-llama", tokenizer_cache=root / "smollm2-tokenizer")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    """An Engine on a fresh data directory, on CPU."""
    from gpu_runtime.engine.engine import Engine

    yield Engine(tmp_path / "data", device="cpu")


@pytest.fixture(scope="module")
def live_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real Signal server (uvicorn on loopback, a real worker, SQLite) with the tiny model, per test module."""
    from tests.helpers.live_server import LiveServer, settings_for

    server = LiveServer.start(settings_for(tmp_path_factory.mktemp("signal-data"), tiny_model_dir))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def streaming_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server whose decode chunks are a token or two, so a stream of a few tokens comes in several chunks
    (the /v1 and playground stream tests)."""
    from tests.helpers.live_server import LiveServer, settings_for, write_catalog
    from tests.helpers.tiny_model import with_context

    data_dir = tmp_path_factory.mktemp("signal-stream")
    # Also the tiny model with room for 512+ tokens after a prompt (issue 18's playground check asks for that many).
    long_model = with_context(tiny_model_dir, tmp_path_factory.mktemp("tiny-long") / "tiny-llama", 1024)
    server = LiveServer.start(settings_for(data_dir, tiny_model_dir, decode_chunk_seconds=0.001,
                                           models_file=write_catalog(data_dir / "models-long.yaml", tiny_model_dir,
                                                                     long_model)))
    yield server
    server.stop()


@pytest.fixture
def key(live_server: LiveServer) -> str:
    """The API key of a fresh user on the live server."""
    return live_server.new_user()


TOOL_FAMILIES = ("hermes", "llama3_json", "gpt_oss")


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server with the tiny model under each tool template of tests/fixtures/chat_templates too, as base
    models `tiny-{family}` (SmolLM2's own template takes no tools): the /v1 tool and agent tests'."""
    import yaml

    from tests.helpers.live_server import LiveServer, settings_for, write_catalog
    from tests.helpers.tiny_model import with_chat_template

    data_dir = tmp_path_factory.mktemp("signal-tools")
    catalog = write_catalog(data_dir / "models-tools.yaml", tiny_model_dir)  # settings_for writes models.yaml
    models = yaml.safe_load(catalog.read_text())
    for family in TOOL_FAMILIES:
        path = with_chat_template(tiny_model_dir, tmp_path_factory.mktemp(f"tiny-{family}") / "tiny-llama", family)
        models["models"].append({"name": f"tiny-{family}", "path": path, "family": "llama", "parameters": 1_000_000,
                                 "offline": True, "description": f"the tiny Llama with a {family} tool template"})
    catalog.write_text(yaml.safe_dump(models))
    # A decode chunk of one step: a stream sends each token as it is made, so a tool call's arguments come in pieces.
    server = LiveServer.start(settings_for(data_dir, tiny_model_dir, models_file=catalog, decode_chunk_seconds=0.001))
    yield server
    server.stop()
