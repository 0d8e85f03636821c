"""The server's error hierarchy: the engine's typed errors plus the ones only the server raises.

Each carries a stable `code` that GraphQL clients see as `extensions.code`.
"""

from __future__ import annotations

from gpu_runtime.errors import (
    BadInput,
    FailedPrecondition,
    InternalError,
    ModelUnavailable,
    NotFound,
    RunNotFound,
    SignalError,
    WorkerFailed,
)


class Unauthenticated(SignalError, PermissionError):
    code = "UNAUTHENTICATED"


class Forbidden(SignalError, PermissionError):
    """The caller is known but may not do this (an admin-only field, say)."""

    code = "FORBIDDEN"


class InsufficientCredits(SignalError, PermissionError):
    """The billing backend refused the call (no credits left, or no account): nothing was run."""

    code = "INSUFFICIENT_CREDITS"


class BillingUnavailable(SignalError, RuntimeError):
    """The billing backend could not be asked (unreachable, timed out, answered 5xx): nothing was run."""

    code = "BILLING_UNAVAILABLE"


__all__ = [
    "BadInput",
    "BillingUnavailable",
    "FailedPrecondition",
    "Forbidden",
    "InsufficientCredits",
    "InternalError",
    "ModelUnavailable",
    "NotFound",
    "RunNotFound",
    "SignalError",
    "Unauthenticated",
    "WorkerFailed",
]
