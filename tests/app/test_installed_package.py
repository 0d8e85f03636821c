"""Signal from an installed wheel, with no checkout: the templates, static files, migrations, catalogue and the
worker are found through the installed package (a Modal image or `pip install` has no repository).

The server's wheel and the SDK's (its own distribution, rewardsignal/pyproject.toml, which the server depends on)
are built from this tree and installed without dependencies into a fresh venv, which borrows the test venv's
third-party packages through a .pth line (a path, so the test venv's editable install of this repository is not
activated there). The server runs from a directory unrelated to the checkout.
"""

from __future__ import annotations

import os
import re
import signal
import site
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, free_port, write_catalog
from tests.helpers.wheels import REPO, SDK, build_wheel, fresh_venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheels of this tree (the server's and the SDK's); returns its python."""
    root = tmp_path_factory.mktemp("installed")
    wheels = [build_wheel(REPO, root / "dist"), build_wheel(SDK, root / "dist")]
    python, purelib = fresh_venv(root / "venv", wheels)
    # Borrowed only now, so pip above saw no other copy of this project to replace.
    (purelib / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def test_the_installed_package_is_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run(
        [str(installed), "-c", "import app, web, gpu_runtime, rewardsignal.operations as o, app.resources as r; "
         "print(app.__file__, web.__file__, gpu_runtime.__file__, o.__file__, o.OPERATIONS_DIR, "
         "*(r.resource_dir(n) for n in r.NAMES))"],
        cwd=tmp_path, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ""},
    ).stdout.split()
    assert len(where) == 9
    assert Path(where[3]).is_relative_to(installed.parents[1]), where  # the SDK's own wheel, in the fresh venv
    assert not any(Path(p).is_relative_to(REPO) for p in where), where
    for path in where[4:]:
        assert Path(path).is_dir(), path


@pytest.fixture
def served(installed: Path, tmp_path: Path, tiny_model_dir: str) -> Iterator[tuple[str, str]]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": "", "SIGNAL_DATA_DIR": str(tmp_path / "data"), "SIGNAL_DEVICE": "cpu",
           "SIGNAL_DEFAULT_MODEL": TINY_MODEL, "SIGNAL_PORT": str(port),
           "SIGNAL_MODELS_FILE": str(write_catalog(tmp_path / "models.yaml", tiny_model_dir))}
    process = subprocess.Popen([str(installed.with_name("signal")), "serve"], cwd=tmp_path, env=env,  # its own script
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        lines = []
        for _ in range(200):  # bounded: the key, the login link, then uvicorn's own line once it listens
            line = process.stdout.readline()
            lines.append(line)
            if "Application startup complete" in line or not line:
                break
        assert "Application startup complete" in lines[-1], "".join(lines)
        key = re.search(r"SIGNAL_API_KEY=(sk-\S+)", "".join(lines))
        assert key, "".join(lines)
        yield f"http://127.0.0.1:{port}", key.group(1)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def test_an_installed_server_serves_pages_and_trains(served: tuple[str, str]) -> None:
    url, key = served
    client = SignalClient(api_key=key, base_url=url)
    run = client.create_run(lora_r=4)  # waits for the runtime: a worker started from the installed package
    first = run.forward_backward(batch=[{"text": "an installed server trains too"}]).loss
    run.optim_step(learning_rate=0.05)
    assert run.forward_backward(batch=[{"text": "an installed server trains too"}]).loss < first
    assert run.refresh().step == 1  # the migrations made the tables this is read from

    assert "Sign in" in httpx.get(f"{url}/login", timeout=30).text  # a template
    css = httpx.get(f"{url}/static/app.css", timeout=30)
    assert css.status_code == 200 and len(css.content) > 100  # a static file
    assert httpx.get(f"{url}/static/vendor/htmx-2.0.11/htmx.min.js", timeout=30).status_code == 200
    assert client.list_models() == [TINY_MODEL, "meta-llama/Llama-3.2-1B"]  # the catalogue it was given
