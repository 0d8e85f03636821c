"""The server's error hierarchy: the engine's typed errors plus the ones only the server raises.

Each carries a stable `code` that GraphQL clients see as `extensions.code`, and an HTTP status that the
dashboard and the download endpoints answer with (`http_status`). The server's own classes carry it as
`status`, as Datasette's do; the runtime's classes know nothing of HTTP (gpu_runtime has no web stack), so
their statuses are given once, in RUNTIME_STATUS below.
"""

from __future__ import annotations

import math
from typing import ClassVar

from gpu_runtime.errors import (
    BadInput,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    HubError,
    InternalError,
    ModelUnavailable,
    NotFound,
    ResourceExhausted,
    RunNotFound,
    SignalError,
    Unavailable,
    WorkerFailed,
)

INTERNAL_STATUS = 500

RUNTIME_STATUS: dict[type[SignalError], int] = {
    BadInput: 422,
    NotFound: 404,
    RunNotFound: 404,
    FailedPrecondition: 409,
    ModelUnavailable: 503,
    WorkerFailed: 502,
    HubError: 502,  # the Hub, upstream of us, refused or failed
    DeadlineExceeded: 504,
    ResourceExhausted: 507,  # the disk; "calls" is 429 (http_status)
    Unavailable: 503,
    Cancelled: 409,
    InternalError: INTERNAL_STATUS,
}


class AppError(SignalError):
    """A typed error only the server raises; `status` is the HTTP status it is answered with."""

    status: ClassVar[int] = INTERNAL_STATUS


class Unauthenticated(AppError, PermissionError):
    code = "UNAUTHENTICATED"
    status = 401


class Forbidden(AppError, PermissionError):
    """The caller is known but may not do this (an admin-only field, say)."""

    code = "FORBIDDEN"
    status = 403


class InsufficientCredits(AppError, PermissionError):
    """The billing service refused the call (no credits left, or no account): nothing was run."""

    code = "INSUFFICIENT_CREDITS"
    status = 402


class BillingUnavailable(AppError, RuntimeError):
    """The billing service could not be asked (unreachable, timed out, answered 5xx): nothing was run."""

    code = "BILLING_UNAVAILABLE"
    status = 503
    retryable = True


class PayloadTooLarge(AppError, ValueError):
    """The request body is over SIGNAL_MAX_REQUEST_BYTES (refused before anything parsed it)."""

    code = "PAYLOAD_TOO_LARGE"
    status = 413


class InvalidDocument(AppError, ValueError):
    """The client's GraphQL document does not parse or validate against the schema."""

    code = "GRAPHQL_VALIDATION_FAILED"
    status = 400


def http_status(error: SignalError | type[SignalError]) -> int:
    """The HTTP status of a typed error, from its class (the nearest one in its MRO that names one)."""
    cls = error if isinstance(error, type) else type(error)
    if isinstance(error, ResourceExhausted) and error.details.get("resource") == "calls":
        return 429  # with Retry-After: too many calls in flight, not a full disk
    for klass in cls.__mro__:
        if klass in RUNTIME_STATUS:
            return RUNTIME_STATUS[klass]
        if issubclass(klass, AppError):
            return klass.status
    return INTERNAL_STATUS


def retry_after_s(error: SignalError) -> float | None:
    """A refusal's `retryAfterS` (too many calls in flight): when its caller may send the call again; else None."""
    value = error.details.get("retry_after_s") if http_status(error) == 429 else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def retry_after_headers(error: SignalError) -> dict[str, str]:
    """`Retry-After` (whole seconds, rounded up) for a 429, as every HTTP surface sends it; empty for others."""
    seconds = retry_after_s(error)
    return {} if seconds is None else {"Retry-After": str(max(1, math.ceil(seconds)))}


__all__ = [
    "BadInput",
    "BillingUnavailable",
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Forbidden",
    "HubError",
    "InsufficientCredits",
    "InternalError",
    "InvalidDocument",
    "ModelUnavailable",
    "NotFound",
    "PayloadTooLarge",
    "ResourceExhausted",
    "RunNotFound",
    "AppError",
    "SignalError",
    "Unauthenticated",
    "Unavailable",
    "WorkerFailed",
    "http_status",
]
