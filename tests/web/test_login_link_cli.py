"""`signal login-link` mints a link in its own process's database session; the running server accepts it once."""

from __future__ import annotations

import re

import httpx
import pytest

from app.cli import main
from tests.helpers.live_server import LiveServer
from tests.web.conftest import csrf_of


def test_cli_login_link_signs_in_on_the_running_server(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SIGNAL_DATA_DIR", str(live_server.settings.data_dir))
    monkeypatch.setenv("SIGNAL_PORT", str(live_server.settings.port))
    assert main(["login-link", "--user", "cli-user@example.com"]) == 0
    link = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"{live_server.url}/auth/link\?token=[\w-]+", link)
    with httpx.Client(base_url=live_server.url) as client:
        page = client.get(link)
        token = re.search(r'name="token" value="([^"]+)"', page.text)
        assert token
        signed = client.post("/auth/link", data={"token": token.group(1)}, headers={"X-CSRF-Token": csrf_of(page.text)})
        assert signed.status_code == 303
        assert "cli-user@example.com" in client.get("/keys").text
