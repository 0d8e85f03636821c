"""Every setting is documented in .env.example and the README; settings come from SIGNAL_* variables."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from app.settings import Settings
from gpu_runtime.contract import RuntimeOptions

REPO = Path(__file__).resolve().parents[2]
VARIABLES = [f"SIGNAL_{name.upper()}" for name in Settings.model_fields]


def test_every_setting_is_in_env_example() -> None:
    text = (REPO / ".env.example").read_text()
    missing = [name for name in VARIABLES if name not in text]
    assert missing == []


def test_every_setting_is_in_the_readme() -> None:
    text = (REPO / "README.md").read_text()
    assert [name for name in VARIABLES if name not in text] == []


def test_settings_read_the_environment(monkeypatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SIGNAL_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SIGNAL_PORT", "9123")
    monkeypatch.delenv("SIGNAL_DATABASE_URL", raising=False)  # set by make test-postgres
    settings = Settings(_env_file=None)
    assert settings.port == 9123
    assert settings.resolved_database_url == f"sqlite+aiosqlite:///{tmp_path.resolve()}/signal.db"


RUNTIME_FIELDS = [f.name for f in fields(RuntimeOptions)]


@pytest.mark.parametrize("name", RUNTIME_FIELDS)
def test_runtime_settings_default_to_the_contract(name: str) -> None:
    assert Settings.model_fields[name].default == getattr(RuntimeOptions, name)
    assert getattr(Settings(_env_file=None).runtime_options(), name) == getattr(RuntimeOptions(), name)


@pytest.mark.parametrize(("variable", "value", "name", "expected"), [
    ("SIGNAL_TICK_TOKENS", "1024", "tick_tokens", 1024),
    ("SIGNAL_DECODE_CHUNK_SECONDS", "0.1", "decode_chunk_seconds", 0.1),
    ("SIGNAL_RESIDENT_RUNS", "16", "resident_runs", 16),
    ("SIGNAL_KEEP_SNAPSHOTS", "5", "keep_snapshots", 5),
])
def test_runtime_settings_reach_the_runtime_options(monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
                                                    name: str, expected: float) -> None:
    monkeypatch.setenv(variable, value)
    assert getattr(Settings(_env_file=None).runtime_options(), name) == expected
