"""Every setting is documented in .env.example and the README; settings come from SIGNAL_* variables."""

from __future__ import annotations

from pathlib import Path

from app.settings import Settings

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
    settings = Settings(_env_file=None)
    assert settings.port == 9123
    assert settings.resolved_database_url == f"sqlite+aiosqlite:///{tmp_path.resolve()}/signal.db"
