"""GPU runtimes the server can drive. Each takes the contract's typed requests and answers its typed results
(gpu_runtime.contract), and carries them as plain data (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from app.backends.base import A, Backend, Progress
from app.settings import Settings

__all__ = ["A", "Backend", "Progress", "check_backend", "make_backend"]


def check_backend(settings: Settings) -> None:
    """Refuse now, before serving, a backend that cannot work: SIGNAL_BACKEND=modal without Modal credentials."""
    if settings.backend == "modal":
        from app.backends.modal import check_credentials

        check_credentials()


def make_backend(settings: Settings) -> Backend:
    if settings.backend == "local":
        from app.backends.local import LocalBackend

        return LocalBackend(settings)
    if settings.backend == "modal":
        from app.backends.modal import ModalBackend

        return ModalBackend(settings)
    raise ValueError(f"SIGNAL_BACKEND={settings.backend!r} is not available; this server has: local, modal")
