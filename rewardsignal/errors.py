"""Typed SDK errors, one per server `extensions.code`."""

from __future__ import annotations

from typing import Any


class SignalAPIError(Exception):
    """An error the Signal server answered with; `code` is its stable `extensions.code`."""

    code = "INTERNAL"

    def __init__(self, message: str, code: str | None = None, field: str | None = None,
                 path: list[Any] | None = None) -> None:
        super().__init__(f"[{code or self.code}] {message}")
        self.message = message
        self.code = code or self.code
        self.field = field
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # Default pickling calls cls(*args), and args holds the "[CODE] message" text: it would be prefixed twice.
        return (type(self), (self.message, self.code, self.field, self.path), self.__dict__)


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


class ServerError(SignalAPIError, RuntimeError):
    code = "INTERNAL"


class TransportError(SignalAPIError, ConnectionError):
    """The server could not be reached or answered something other than GraphQL."""

    code = "TRANSPORT"


_BY_CODE: dict[str, type[SignalAPIError]] = {
    cls.code: cls
    for cls in (AuthenticationError, NotFoundError, BadInputError, ModelUnavailableError, FailedPreconditionError,
                WorkerFailedError, ForbiddenError, PayloadTooLargeError, HubError, InsufficientCreditsError,
                BillingUnavailableError, ServerError, TransportError)
}
_BY_CODE["GRAPHQL_VALIDATION_FAILED"] = BadInputError


def error_for_code(code: str, message: str, field: str | None = None, path: list[Any] | None = None) -> SignalAPIError:
    """The typed error for a server `code` (a code this SDK does not know yet: the base class, code kept)."""
    return _BY_CODE.get(code, SignalAPIError)(message, code=code, field=field, path=path)


def error_from_graphql(error: dict[str, Any]) -> SignalAPIError:
    extensions = error.get("extensions") or {}
    return error_for_code(extensions.get("code", "INTERNAL"), error.get("message", "unknown error"),
                          field=extensions.get("field"), path=error.get("path"))
