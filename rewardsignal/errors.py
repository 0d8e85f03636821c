"""Typed SDK errors, one per server `extensions.code`."""

from __future__ import annotations

from typing import Any


class SignalAPIError(Exception):
    """An error the Signal server answered with; `code` is its stable `extensions.code`."""

    code = "INTERNAL"

    def __init__(self, message: str, code: str | None = None, field: str | None = None,
                 path: list[Any] | None = None, retryable: bool | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(f"[{code or self.code}] {message}")
        self.message = message
        self.code = code or self.code
        self.field = field
        self.path = path
        self.retryable = retryable  # the server's extensions.retryable (None: it did not say)
        self.details = details or {}  # the other extensions, e.g. resource, retryAfterS

    def __reduce__(self) -> tuple[Any, ...]:
        # Default pickling calls cls(*args), and args holds the "[CODE] message" text: it would be prefixed twice.
        return (type(self), (self.message, self.code, self.field, self.path, self.retryable, self.details),
                self.__dict__)


class AuthenticationError(SignalAPIError, PermissionError):
    code = "UNAUTHENTICATED"


class NotFoundError(SignalAPIError, LookupError):
    code = "NOT_FOUND"


class BadInputError(SignalAPIError, ValueError):
    code = "BAD_INPUT"


class ModelUnavailableError(SignalAPIError, RuntimeError):
    code = "MODEL_UNAVAILABLE"


class FailedPreconditionError(SignalAPIError, RuntimeError):
    code = "FAILED_PRECONDITION"


class WorkerFailedError(SignalAPIError, RuntimeError):
    """The GPU runtime died during the call. The client has already retried it (same request id) a few times;
    a new runtime restores every run from its journal, so nothing acknowledged is lost."""

    code = "WORKER_FAILED"


class ForbiddenError(SignalAPIError, PermissionError):
    """The key is valid but its user may not do this (an admin-only field, say)."""

    code = "FORBIDDEN"


class PayloadTooLargeError(SignalAPIError, ValueError):
    """The request body is over the server's SIGNAL_MAX_REQUEST_BYTES; send smaller batches."""

    code = "PAYLOAD_TOO_LARGE"


class HubError(SignalAPIError, RuntimeError):
    """The Hugging Face Hub refused or failed a push_to_hub upload; the message is the Hub's."""

    code = "HUB_ERROR"


class InsufficientCreditsError(SignalAPIError, PermissionError):
    """The server's billing service refused the call (no credits left): nothing was run, nothing charged."""

    code = "INSUFFICIENT_CREDITS"


class BillingUnavailableError(SignalAPIError, RuntimeError):
    """The server could not reach its billing service to check credits: nothing was run; try again later."""

    code = "BILLING_UNAVAILABLE"


class DeadlineExceededError(SignalAPIError, TimeoutError):
    """The call's deadline passed before it was applied: it never was. Not retried automatically."""

    code = "DEADLINE_EXCEEDED"


class ResourceExhaustedError(SignalAPIError, RuntimeError):
    """Nothing was applied. `resource` "disk": the server's disk is full (not retried); "calls": too many of your calls
    in flight (retried with the same id after `retry_after_s`, within a total budget)."""

    code = "RESOURCE_EXHAUSTED"

    @property
    def resource(self) -> str | None:
        return self.details.get("resource")

    @property
    def retry_after_s(self) -> float | None:
        value = self.details.get("retryAfterS")
        return float(value) if value is not None else None


class UnavailableError(SignalAPIError, RuntimeError):
    """The server's database was locked, read-only or unreachable; the call may have been applied. The client retries
    with the same id (which records it once) with exponential backoff, a minute in all."""

    code = "UNAVAILABLE"


class CancelledError(SignalAPIError, RuntimeError):
    """The call was cancelled before it was applied."""

    code = "CANCELLED"


class ServerError(SignalAPIError, RuntimeError):
    code = "INTERNAL"


class TransportError(SignalAPIError, ConnectionError):
    """The server could not be reached or answered something other than GraphQL."""

    code = "TRANSPORT"


_BY_CODE: dict[str, type[SignalAPIError]] = {
    cls.code: cls
    for cls in (AuthenticationError, NotFoundError, BadInputError, ModelUnavailableError, FailedPreconditionError,
                WorkerFailedError, ForbiddenError, PayloadTooLargeError, HubError, InsufficientCreditsError,
                BillingUnavailableError, DeadlineExceededError, ResourceExhaustedError, UnavailableError,
                CancelledError, ServerError, TransportError)
}
_BY_CODE["GRAPHQL_VALIDATION_FAILED"] = BadInputError


def error_for_code(code: str, message: str, field: str | None = None, path: list[Any] | None = None,
                   retryable: bool | None = None, details: dict[str, Any] | None = None) -> SignalAPIError:
    """The typed error for a server `code` (a code this SDK does not know yet: the base class, code kept)."""
    return _BY_CODE.get(code, SignalAPIError)(message, code=code, field=field, path=path, retryable=retryable,
                                              details=details)


def error_from_graphql(error: dict[str, Any]) -> SignalAPIError:
    extensions = dict(error.get("extensions") or {})
    code, field, retryable = extensions.pop("code", "INTERNAL"), extensions.pop("field", None), extensions.pop(
        "retryable", None)
    return error_for_code(code, error.get("message", "unknown error"), field=field, path=error.get("path"),
                          retryable=retryable, details=extensions)
