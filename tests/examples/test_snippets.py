"""Every command Signal documents or prints works when pasted: each shell and Python snippet of the README, docs/
and the Getting started page (/start) is marked runnable, or says why not; the runnable ones run here against a live
server, as a newcomer pastes them (a document's shell snippets in one shell, its Python snippets in one session).

The server names the tiny model as the offline default (`HuggingFaceTB/SmolLM2-135M-Instruct`), so the snippets run
unchanged; only `http://localhost:8000` becomes the server's own URL, as SIGNAL_BASE_URL says.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers.live_server import LiveServer, settings_for
from tests.helpers.wheels import SDK, build_wheel
from tests.web.conftest import sign_in

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHELLS = ("bash", "sh", "shell")
# A fence's language and body, after an optional marker line: <!-- runnable --> or <!-- not runnable: why -->.
FENCE = re.compile(r"(?:<!-- (runnable|not runnable: [^>]+) -->\n)?```(\w*)\n(.*?)^```", re.S | re.M)
LOCAL_URLS = re.compile(r"http://(?:localhost|127\.0\.0\.1):8000")
HUB_UNREACHABLE = "http://127.0.0.1:9"  # nothing listens: a snippet that reaches for the Hub fails instead of waiting


@dataclass(frozen=True)
class Snippet:
    language: str
    code: str
    marker: str | None


def snippets(path: Path) -> list[Snippet]:
    found = [Snippet(language, code, marker) for marker, language, code in FENCE.findall(path.read_text())]
    return [s for s in found if s.language in (*SHELLS, "python")]


@pytest.fixture(scope="module")
def docs_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny model under the offline default's name, and the SDK's wheel built where the server serves it."""
    data = tmp_path_factory.mktemp("snippets")
    settings = settings_for(data, tiny_model_dir, default_model=DEFAULT_MODEL)
    catalog = yaml.safe_load(settings.models_file.read_text())
    catalog["models"].append({**catalog["models"][0], "name": DEFAULT_MODEL})
    settings.models_file.write_text(yaml.safe_dump(catalog))
    build_wheel(SDK, settings.sdk_dir)
    server = LiveServer.start(settings)
    yield server
    server.stop()


def newcomer_env(server: LiveServer, tmp_path: Path) -> dict[str, str]:
    """What a newcomer's terminal holds: the key `make serve` printed and the server's URL; a Hub that cannot be
    reached; this checkout's packages (the test venv's editable install may point at another checkout)."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SIGNAL_", "TINKER_", "HF_", "OPENAI_"))}
    return {**keep, "SIGNAL_API_KEY": server.new_user(), "SIGNAL_BASE_URL": server.url, "HF_ENDPOINT": HUB_UNREACHABLE,
            "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}


def run_python(code: str, env: dict[str, str], cwd: Path, python: str = sys.executable) -> str:
    done = subprocess.run([python, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{code}\n---\n{done.stderr[-4000:]}"
    return done.stdout


def run_shell(code: str, env: dict[str, str], cwd: Path) -> dict[str, str]:
    """The snippet in bash, stopping at the first failure; the environment it leaves, for the Python after it."""
    # The snippet's own output goes to stderr, so stdout is `env -0`'s alone (pip's lines once ran into its first entry).
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", f"{{\n{code}\n}} >&2\nenv -0"], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{code}\n---\n{done.stderr[-4000:]}"
    return dict(line.split("=", 1) for line in done.stdout.split("\0") if "=" in line)


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_snippet_is_marked_runnable_or_says_why_not(path: Path) -> None:
    unmarked = [s.code.splitlines()[0] for s in snippets(path) if s.marker is None]
    assert unmarked == [], f"{path.name}: mark each <!-- runnable --> or <!-- not runnable: why -->"


RUNNABLE = [path for path in DOCUMENTS if any(s.marker == "runnable" for s in snippets(path))]


@pytest.mark.parametrize("path", RUNNABLE, ids=lambda p: p.name)
def test_runnable_snippets_run_against_a_live_server(docs_server: LiveServer, path: Path, tmp_path: Path) -> None:
    runnable = [s for s in snippets(path) if s.marker == "runnable"]
    env = newcomer_env(docs_server, tmp_path)
    shell = [LOCAL_URLS.sub(docs_server.url, s.code) for s in runnable if s.language in SHELLS]
    if shell:
        env = run_shell("\n".join(shell), env, tmp_path)
    python = "\n".join(LOCAL_URLS.sub(docs_server.url, s.code) for s in runnable if s.language == "python")
    if python:
        run_python(python, env, tmp_path)


def start_snippets(server: LiveServer) -> dict[str, str]:
    """Getting started's snippets by id, after "Create a key for this snippet": the env snippet holds its secret."""
    visitor = sign_in(server)
    page = visitor.client.get("/start").text
    page += visitor.post("/start/key").text
    found = dict(re.findall(r'<pre class="code"[^>]* id="([\w-]+)">(.*?)</pre>', page, re.S))
    return {name: html.unescape(code) for name, code in found.items()}


def test_the_getting_started_snippets_run(docs_server: LiveServer, tmp_path: Path) -> None:
    found = start_snippets(docs_server)
    assert {"env-snippet", "py-snippet", "openai-snippet"} <= set(found), found.keys()
    # Steps 2 and 3, pasted one after the other into one Python session (step 3 samples step 2's run).
    out = run_python(found["py-snippet"] + "\n" + found["openai-snippet"], newcomer_env(docs_server, tmp_path),
                     tmp_path)
    assert re.search(r"^9 \d+\.\d+", out, re.M), out  # the tenth step's loss


def test_the_start_pages_install_command_installs_the_sdk_from_this_server_and_trains(docs_server: LiveServer,
                                                                                      tmp_path: Path) -> None:
    """Step 1 as printed (pip install <this server>/sdk/<wheel>, then the exports) in a shell whose `pip` and `python`
    are a fresh venv's, with nothing of this checkout on its path; then step 2 trains from that venv."""
    found = start_snippets(docs_server)
    wheel = next(docs_server.settings.sdk_dir.glob("*.whl"))
    install = f"pip install {docs_server.url}/sdk/{wheel.name}"
    assert found["env-snippet"].splitlines()[0] == install
    assert "SIGNAL_API_KEY=sk-" in found["env-snippet"]
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SIGNAL_", "PIP_", "VIRTUAL_ENV"))}
    env |= {"PATH": f"{python.parent}:{env['PATH']}", "HOME": str(tmp_path)}
    # pip fetches the wheel from the server and httpx, its one dependency, from the package index.
    shell = run_shell(found["env-snippet"], env, tmp_path)
    shell["PYTHONNOUSERSITE"] = "1"
    out = run_python(found["py-snippet"] + "\nimport rewardsignal; print('from', rewardsignal.__file__)", shell,
                     tmp_path, python=str(python))
    assert re.search(r"^9 \d+\.\d+", out, re.M), out
    assert str(tmp_path / "venv") in out.splitlines()[-1]
