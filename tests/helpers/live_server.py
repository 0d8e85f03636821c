"""A real Signal server for tests: uvicorn on a free loopback port, in a thread, with a real worker.

Users and keys are made through the real services on the same database, the way `signal keys create` does.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml

from app.db import Database
from app.server import create_app
from app.services.keys import KeyService
from app.services.users import UserService
from app.settings import Settings

TINY_MODEL = "tiny-llama"
LONG_TINY_MODEL = "tiny-llama-long"  # the same weights, a 1024-token context (streaming_server only)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_catalog(path: Path, tiny_model_dir: str, long_model_dir: str | None = None) -> Path:
    """The tests' catalogue; with `long_model_dir`, also LONG_TINY_MODEL, the tiny model with a longer context."""
    catalog = {"models": [
        {"name": TINY_MODEL, "path": tiny_model_dir, "family": "llama", "parameters": 1_000_000, "offline": True,
         "description": "random tiny Llama for tests", "quantization_allowed": True},
        # In the catalogue but not on this machine: createRun must answer MODEL_UNAVAILABLE.
        {"name": "meta-llama/Llama-3.2-1B", "family": "llama", "parameters": 1_240_000_000},
    ]}
    if long_model_dir is not None:
        catalog["models"].append({"name": LONG_TINY_MODEL, "path": long_model_dir, "family": "llama",
                                  "parameters": 1_000_000, "offline": True,
                                  "description": "the tiny Llama with a 1024-token context"})
    path.write_text(yaml.safe_dump(catalog))
    return path


@dataclass
class LiveServer:
    url: str
    settings: Settings
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @classmethod
    def start(cls, settings: Settings, wait_for_runtime: bool = True, backend: Any = None) -> LiveServer:
        """Serve `settings`; with `wait_for_runtime`, return once the GPU runtime answers too (it starts in the
        background, so timing-sensitive tests would otherwise measure its start-up). `backend`: one built by the
        test (the Modal backend pointed at its offline path), else the settings' own."""
        app = create_app(settings, backend)
        config = uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning", lifespan="on")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 120
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.05)
        live = cls(f"http://127.0.0.1:{settings.port}", settings, app, server, thread)
        if wait_for_runtime:
            live.wait_for(lambda: live.backend.ready, "the GPU runtime to start")
        return live

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    @property
    def backend(self) -> Any:
        return self.app.state.services.backend

    @property
    def worker_pid(self) -> int | None:
        return self.backend.client.pid

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Poll `condition` until it holds: how a test learns that something happened (never a fixed sleep)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.01)

    def new_user(self, email: str | None = None, is_admin: bool = False) -> str:
        """A fresh user with one API key; returns the key's secret."""
        email = email or f"user-{uuid.uuid4().hex[:8]}@example.com"

        async def make() -> str:
            db = Database(self.settings.resolved_database_url)
            try:
                user, _ = await UserService(db).get_or_create(email, is_admin=is_admin)
                secret, _ = await KeyService(db).create(user, "test")
                return secret
            finally:
                await db.dispose()

        # A thread of its own, so async tests (which already run a loop) can call this too.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, make()).result()

    def graphql(self, query: str, variables: dict | None = None, key: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(f"{self.url}/graphql", json={"query": query, "variables": variables or {}},
                              headers=headers, timeout=300)
        return response.json()


def settings_for(data_dir: Path, tiny_model_dir: str, **overrides: Any) -> Settings:
    data_dir.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "port": free_port(),
        "device": "cpu",
        "models_file": write_catalog(data_dir / "models.yaml", tiny_model_dir),
        "default_model": TINY_MODEL,
        "max_batch_size": 16,
        "max_request_bytes": 1024 * 1024,
        "bootstrap_admin": False,
        "sdk_dir": data_dir / "sdk",  # none built: a test that serves the SDK's wheel builds it there
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)


def error_code(body: dict) -> str | None:
    errors = body.get("errors") or []
    return (errors[0].get("extensions") or {}).get("code") if errors else None
