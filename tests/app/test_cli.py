"""The `signal` command, run as a user runs it: a subprocess with SIGNAL_* settings."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.live_server import free_port, write_catalog

SIGNAL = str(Path(sys.executable).with_name("signal"))


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SIGNAL, *args], env=env, capture_output=True, text=True, timeout=120)


def cli_env(data_dir: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "SIGNAL_DATA_DIR": str(data_dir), **extra}


def test_keys_create_list_revoke(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    created = run_cli(env, "keys", "create", "--user", "ada@example.com", "--name", "laptop")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert re.fullmatch(r"sk-[\w-]{40,}", secret)
    assert "created user ada@example.com" in created.stderr

    listed = run_cli(env, "keys", "list", "--user", "ada@example.com")
    assert listed.returncode == 0 and secret[:10] in listed.stdout and "active" in listed.stdout
    assert secret not in listed.stdout

    revoked = run_cli(env, "keys", "revoke", secret[:10], "--user", "ada@example.com")
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    assert "revoked" in run_cli(env, "keys", "list", "--user", "ada@example.com").stdout

    unknown_user = run_cli(env, "keys", "list", "--user", "nobody@example.com")
    assert unknown_user.returncode == 1 and "no user 'nobody@example.com'" in unknown_user.stderr
    assert "nobody" not in run_cli(env, "keys", "create", "--user", "ada@example.com").stderr

    missing = run_cli(env, "keys", "revoke", "sk-nothing", "--user", "ada@example.com")
    assert missing.returncode == 1 and "no single key" in missing.stderr

    too_long = run_cli(env, "keys", "create", "--user", "a" * 320 + "@example.com")
    assert too_long.returncode == 1 and "email must be at most 320 characters" in too_long.stderr


def test_models_lists_the_catalogue(tmp_path: Path) -> None:
    result = run_cli(cli_env(tmp_path), "models")
    assert result.returncode == 0
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in result.stdout and "offline" in result.stdout
    assert re.search(r"meta-llama/Llama-3.1-70B\s+70.60B\s+A100-80GB:4", result.stdout)


def test_no_command_prints_help_and_fails(tmp_path: Path) -> None:
    result = run_cli(cli_env(tmp_path))
    assert result.returncode == 2 and "serve" in result.stdout


@pytest.mark.usefixtures("fresh_database")
def test_serve_first_start_prints_an_admin_key_once(tmp_path: Path, tiny_model_dir: str) -> None:
    env = cli_env(tmp_path, SIGNAL_DEVICE="cpu", SIGNAL_DEFAULT_MODEL="tiny-llama",
                  SIGNAL_MODELS_FILE=str(write_catalog(tmp_path / "models.yaml", tiny_model_dir)))
    first = _serve_once(env)
    key = re.search(r"SIGNAL_API_KEY=(sk-\S+)", first["output"])
    assert key, first["output"]
    assert first["me"]["data"]["me"]["email"] == "admin@localhost"
    again = _serve_once(env)
    assert "SIGNAL_API_KEY" not in again["output"]


def _serve_once(env: dict[str, str]) -> dict:
    port = free_port()
    process = subprocess.Popen([SIGNAL, "serve", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for _ in range(200):
            line = process.stdout.readline()
            lines.append(line)
            if "Signal at" in line or not line:
                break
        output = "".join(lines)
        assert f"http://127.0.0.1:{port}" in output
        key = re.search(r"SIGNAL_API_KEY=(sk-\S+)", output)
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        me = {}
        if key:
            me = httpx.post(f"http://127.0.0.1:{port}/graphql", json={"query": "{ me { email } }"},
                            headers={"Authorization": f"Bearer {key.group(1)}"}, timeout=30).json()
        return {"output": output, "me": me}
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


@pytest.mark.usefixtures("fresh_database")
def test_login_link_names_the_running_servers_url_and_falls_back_to_the_settings(tmp_path: Path,
                                                                                tiny_model_dir: str) -> None:
    env = cli_env(tmp_path, SIGNAL_DEVICE="cpu", SIGNAL_DEFAULT_MODEL="tiny-llama",
                  SIGNAL_MODELS_FILE=str(write_catalog(tmp_path / "models.yaml", tiny_model_dir)))
    for name in ("SIGNAL_PUBLIC_URL", "SIGNAL_PORT"):  # the fallback below is the default URL
        env.pop(name, None)
    port = free_port()  # not the default 8000: the link must name the port the server really serves
    process = subprocess.Popen([SIGNAL, "serve", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        _read_until(process, "Uvicorn running on")  # uvicorn's line once the port is bound
        printed = run_cli(env, "login-link", "--user", "grace@example.com")
        assert printed.returncode == 0, printed.stderr
        link = printed.stdout.strip()
        assert re.fullmatch(rf"http://127\.0\.0\.1:{port}/auth/link\?token=[\w-]+", link)
        assert "settings' URL" not in printed.stderr
        with httpx.Client() as client:
            page = client.get(link)
            token = re.search(r'name="token" value="([^"]+)"', page.text)
            csrf = re.search(r'"X-CSRF-Token": "([^"]+)"', page.text)
            assert page.status_code == 200 and token and csrf
            signed = client.post(f"http://127.0.0.1:{port}/auth/link", data={"token": token.group(1)},
                                 headers={"X-CSRF-Token": csrf.group(1)})
            assert signed.status_code == 303
            assert "grace@example.com" in client.get(f"http://127.0.0.1:{port}/keys").text
        # The login page names the command that mints such a link.
        assert "signal login-link" in httpx.get(f"http://127.0.0.1:{port}/login").text
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    assert not (tmp_path / "server.json").exists()  # a clean shutdown removes the record

    stopped = run_cli(env, "login-link", "--user", "grace@example.com")
    assert stopped.returncode == 0
    assert stopped.stdout.startswith("http://127.0.0.1:8000/auth/link?token=")
    assert "no running server has recorded its URL" in stopped.stderr and "settings' URL" in stopped.stderr


def test_login_link_ignores_a_server_record_whose_process_has_ended(tmp_path: Path) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(ended.stdout)  # reaped: no process has this pid now (until the system reuses it)
    (tmp_path / "server.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": pid}))
    printed = run_cli(cli_env(tmp_path, SIGNAL_PUBLIC_URL="https://signal.example.org"), "login-link")
    assert printed.returncode == 0
    assert printed.stdout.startswith("https://signal.example.org/auth/link?token=")
    assert f"(pid {pid}) is no longer running" in printed.stderr


def _read_until(process: subprocess.Popen[str], text: str) -> str:
    assert process.stdout is not None
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        if text in line:
            return "".join(lines)
    raise AssertionError(f"the server exited before printing {text!r}:\n" + "".join(lines))


