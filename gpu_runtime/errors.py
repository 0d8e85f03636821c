"""Typed errors that cross the worker pipe (and Modal) as plain data.

Each error has a stable `code` that the server forwards to clients as `extensions.code`,
and also inherits the matching built-in so callers can catch `ValueError`/`LookupError`.
No torch here: the server imports this module.
"""

from __future__ import annotations

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

    def __init__(self, message: str, *, field: str | None = None) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only `field` would be lost by the default Exception pickling.
        return (_rebuild, (type(self).__name__, self.message, self.field))

    def to_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "code": self.code, "message": self.message, "field": self.field}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> SignalError:
        return _rebuild(data.get("type", "InternalError"), data.get("message", ""), data.get("field"))


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
    code = "WORKER_FAILED"


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


def _rebuild(type_name: str, message: str, field: str | None) -> SignalError:
    cls = _registry().get(type_name, InternalError)
    return cls(message, field=field)
