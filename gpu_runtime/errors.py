"""Typed errors that cross the worker pipe (and Modal) as plain data.

Each error has a stable `code` that the server forwards to clients as `extensions.code`,
and also inherits the matching built-in so callers can catch `ValueError`/`LookupError`.
No torch here: the server imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_MESSAGE_CHARS = 400  # a message that quotes the input quotes a prefix of it: a 10 MB name is no 10 MB error


def bounded(message: str) -> str:
    """`message` cut to MAX_MESSAGE_CHARS, keeping its head (what was wrong) and tail (what to do)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    head = MAX_MESSAGE_CHARS * 2 // 3
    return f"{message[:head]}… ({len(message) - MAX_MESSAGE_CHARS} characters left out) …{message[head - MAX_MESSAGE_CHARS:]}"


class SignalError(Exception):
    code = "INTERNAL"
    retryable = False  # may the same call (same request id) be sent again? Errors that never applied it say so

    def __init__(self, message: str, *, field: str | None = None, retryable: bool | None = None,
                 **details: Any) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message
        self.field = field
        if retryable is not None:
            self.retryable = retryable
        self.details = details  # e.g. ResourceExhausted's resource and retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments would be lost by the default Exception pickling.
        return (_rebuild, (type(self).__name__, self.message, self.field, self.retryable, self.details))

    def to_dict(self) -> dict[str, Any]:
        data = {"type": type(self).__name__, "code": self.code, "message": self.message, "field": self.field,
                "retryable": self.retryable}
        return data | ({"details": self.details} if self.details else {})

    @staticmethod
    def from_dict(data: Mapping[str, object]) -> SignalError:
        # As to_dict wrote it; a field of another type is read as absent.
        kind, message, field = data.get("type"), data.get("message"), data.get("field")
        retryable, details = data.get("retryable"), data.get("details")
        return _rebuild(kind if isinstance(kind, str) else "InternalError", message if isinstance(message, str) else "",
                        field if isinstance(field, str) else None, retryable if isinstance(retryable, bool) else None,
                        details if isinstance(details, Mapping) else None)


class BadInput(SignalError, ValueError):
    """The request itself is wrong; `field` names what (e.g. `batch[3].output`, `lora.r`)."""

    code = "BAD_INPUT"


class RunNotFound(SignalError, LookupError):
    code = "NOT_FOUND"


class NotFound(SignalError, LookupError):
    code = "NOT_FOUND"


class ModelUnavailable(SignalError, RuntimeError):
    code = "MODEL_UNAVAILABLE"


class FailedPrecondition(SignalError, RuntimeError):
    """The call is valid but the run's state does not allow it (optim_step with no gradients)."""

    code = "FAILED_PRECONDITION"


class WorkerFailed(SignalError, RuntimeError):
    """The runtime died during the call; it may have applied it. Retried with the same id, unless `retryable` is
    False (the call was in flight through two runtime deaths in a row: a poison pill is not sent a third time)."""

    code = "WORKER_FAILED"
    retryable = True


class DeadlineExceeded(SignalError, TimeoutError):
    """The call's deadline passed before it was applied: it never was, and is not retried automatically."""

    code = "DEADLINE_EXCEEDED"


class ResourceExhausted(SignalError, RuntimeError):
    """A resource ran out; nothing was applied. details["resource"]: "disk" (not retried) or "calls" (the user's
    calls in flight: retried after details["retry_after_s"])."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, resource: str = "disk", retry_after_s: float | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("retryable", resource == "calls")
        details = {"resource": resource} | ({"retry_after_s": retry_after_s} if retry_after_s is not None else {})
        super().__init__(message, **(kwargs | details))


class Unavailable(SignalError, RuntimeError):
    """A dependency (the database) is locked, read-only or unreachable; the call may have been applied, and a
    retry with the same id records it."""

    code = "UNAVAILABLE"
    retryable = True


class Cancelled(SignalError, RuntimeError):
    """The call was cancelled (its client went away, or asked) before it was applied."""

    code = "CANCELLED"


class HubError(SignalError, RuntimeError):
    """The Hugging Face Hub refused or failed an upload; the message is the Hub's, with the token scrubbed."""

    code = "HUB_ERROR"


class InternalError(SignalError, RuntimeError):
    code = "INTERNAL"


def _registry() -> dict[str, type[SignalError]]:
    found: dict[str, type[SignalError]] = {}
    stack: list[type[SignalError]] = [SignalError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


def _rebuild(type_name: str, message: str, field: str | None, retryable: bool | None = None,
             details: Mapping[str, object] | None = None) -> SignalError:
    cls = _registry().get(type_name, InternalError)
    return cls(message, field=field, retryable=retryable, **(details or {}))
