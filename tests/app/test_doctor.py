"""`signal doctor --json` (issue 8 §6), run as a user runs it, in a HOME with no Modal credentials."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.app.test_cli import run_cli


def doctor(tmp_path: Path, **env: str) -> tuple[int, dict]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MODAL_", "SIGNAL_", "SUPABASE_"))}
    result = run_cli({**clean, "HOME": str(tmp_path / "home"), "SIGNAL_DATA_DIR": str(tmp_path / "data"), **env},
                     "doctor", "--json")
    return result.returncode, json.loads(result.stdout)


def by_name(report: dict) -> dict[str, dict]:
    return {check["name"]: check for check in report["checks"]}


def test_doctor_names_what_is_missing_and_how_to_fix_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIGNAL_DATABASE_URL", raising=False)  # the checks below are of the SQLite default
    (tmp_path / "home").mkdir()
    data = tmp_path / "data"
    assert run_cli({**os.environ, "SIGNAL_DATA_DIR": str(data)}, "migrate").returncode == 0  # the test SQLite

    code, report = doctor(tmp_path)
    checks = by_name(report)
    assert report["backend"] == "local" and report["ok"] is True and code == 0  # Modal is not needed locally
    assert checks["modal_credentials"]["status"] == "unknown" and "modal token new" in checks["modal_credentials"]["fix"]
    names = [check["name"] for check in report["checks"]]
    assert names.index("torch") < names.index("modal_credentials")  # a local setup's report opens on its own pieces
    assert checks["modal_app"]["detail"] == "unknown (no credentials)" and "modal deploy" in checks["modal_app"]["fix"]
    assert checks["modal_hf_secret"]["status"] == "unknown" and "modal secret create" in checks["modal_hf_secret"]["fix"]
    assert checks["database"]["status"] == "ok" and str(data / "signal.db") in checks["database"]["detail"]
    assert checks["default_model"]["status"] == "ok"
    assert checks["torch"]["status"] == "ok" and checks["cuda"]["status"] in ("ok", "warning")
    assert checks["disk"]["status"] in ("ok", "warning") and checks["supabase"]["required"] is False

    # With the Modal backend the credentials are required: not ready, non-zero exit.
    code, report = doctor(tmp_path, SIGNAL_BACKEND="modal")
    checks = by_name(report)
    assert code == 1 and report["ok"] is False
    assert checks["modal_credentials"]["required"] is True and checks["modal_credentials"]["status"] == "missing"

    # A database that cannot be reached is named, with the fix.
    unreachable = f"sqlite+aiosqlite:///{tmp_path / 'no-such-dir' / 'x.db'}"
    code, report = doctor(tmp_path, SIGNAL_DATABASE_URL=unreachable)
    assert code == 1 and by_name(report)["database"]["status"] == "missing"
    assert "SIGNAL_DATABASE_URL" in by_name(report)["database"]["fix"]

    # Credentials in ~/.modal.toml are found (nothing is asked of Modal's servers here).
    (tmp_path / "home" / ".modal.toml").write_text('[default]\ntoken_id = "ak-x"\ntoken_secret = "as-y"\nactive = true\n')
    from app.doctor import modal_credentials

    for name in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_CONFIG_PATH", "MODAL_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert modal_credentials() == str(tmp_path / "home" / ".modal.toml")
