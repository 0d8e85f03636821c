"""Server settings, read from `SIGNAL_*` environment variables and `.env`.

Passed explicitly to `create_app(settings)`; nothing reads the environment at import time.
Every field here is documented in `.env.example` and the README (a test checks both).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIGNAL_", env_file=".env", extra="ignore")

    data_dir: Path = Field(Path("./data"), description="Runs, checkpoints, model cache and the SQLite file.")
    database_url: str = Field("", description="SQLAlchemy async URL; empty means sqlite in the data dir.")
    host: str = Field("127.0.0.1", description="Address `signal serve` binds.")
    port: int = Field(8000, description="Port `signal serve` binds.")
    public_url: str = Field("", description="URL printed for users; empty means http://host:port.")
    backend: str = Field("local", description="GPU runtime: `local` (a worker process on this machine).")
    device: str = Field("auto", description="Worker device: auto, cpu, cuda, cuda:N.")
    models_file: Path = Field(REPO_ROOT / "config" / "models.yaml", description="The model catalogue.")
    default_model: str = Field("HuggingFaceTB/SmolLM2-135M-Instruct", description="Base model when none is given.")
    max_batch_size: int = Field(64, description="Most items one forward_backward may carry.")
    max_request_bytes: int = Field(16 * 1024 * 1024, description="Largest request body; bigger ones get 413.")
    keep_steps: int = Field(3, description="How many lora_adapters/step_N directories each run keeps.")
    allow_downloads: bool = Field(False, description="Let the worker download models from the HF Hub.")
    worker_log: Path | None = Field(None, description="File for the worker's stderr; empty means inherit.")
    bootstrap_admin: bool = Field(True, description="On first start with no users, create an admin and print a key.")
    log_level: str = Field("info", description="Server log level.")

    @field_validator("worker_log", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'signal.db').resolve()}"

    @property
    def resolved_public_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"
