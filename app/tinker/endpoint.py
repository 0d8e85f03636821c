"""What every Tinker handler shares: the SDK's key, JSON bodies, and typed errors as the JSON responses it expects.

Auth is the SDK's `X-API-Key: tml-<Signal key>`, never the dashboard's cookie (so /api/v1 is exempt from CSRF).
Every 4xx is a plain JSON response with a Content-Length: a 400 without a body sends the SDK into a reconnect loop.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.errors import BadInput, SignalError, Unauthenticated, http_status, retry_after_headers
from app.services import Services
from app.services.tinker_sessions import SessionFinished
from app.tables import TinkerFuture, User
from app.tinker import compression
from app.tinker.messages import UntypedAPIFuture
from gpu_runtime.errors import FailedPrecondition

PREFIX = "/api/v1"
KEY_PREFIX = "tml-"  # the SDK refuses keys without it: users send tml- + their whole Signal key (tml-sk-…)
Handler = Callable[[Request], Awaitable[Response]]
# A handler answers a Response or one of app/tinker/messages.py's TypedDicts, sent as JSON.
UserHandler = Callable[[Request, User], Awaitable[Response | Mapping[str, object]]]


def error(status: int, message: str, category: str = "user", headers: dict[str, str] | None = None) -> JSONResponse:
    # Never an "error" key the SDK could mistake for a failed future: this is an HTTP error, with `detail`.
    return JSONResponse({"detail": message, "category": category}, status_code=status, headers=headers)


def services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]  # Starlette's state is untyped


async def authenticate(request: Request) -> User:
    """The X-API-Key header with one leading `tml-` stripped, as any Signal key. The session cookie is never read."""
    secret = request.headers.get("x-api-key") or ""
    if secret.startswith(KEY_PREFIX):
        secret = secret.removeprefix(KEY_PREFIX)
    if not secret:
        raise Unauthenticated("missing API key: send X-API-Key: tml-<your Signal key>")
    return await services(request).keys.authenticate(secret)


async def body(request: Request) -> dict[str, Any]:
    """The request's JSON object, as sent: each handler checks the fields it reads."""
    raw = await compression.request_body(request, services(request).settings.max_request_bytes)
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        raise BadInput("the body is not JSON", field="body") from None
    if not isinstance(value, dict):
        raise BadInput("the body must be a JSON object", field="body")
    return value


def endpoint(handler: UserHandler, auth: bool = True) -> Handler:
    """A handler's typed errors as JSON: 401 bad key, 400 unparsable or invalid input, 404 unknown ids."""
    async def wrapped(request: Request) -> Response:
        try:
            user = await authenticate(request) if auth else None
            answer = await handler(request, user)  # type: ignore[arg-type]  # auth=False handlers take no user
        except SessionFinished as exc:
            return error(410, f"session {exc} has finished")
        except SignalError as exc:
            status = http_status(exc)
            if isinstance(exc, (BadInput, FailedPrecondition)):
                status = 400  # the SDK's user error at submit (422 is fatal too; 400 is what the issue names)
            # A 429 (too many calls in flight) carries Retry-After, which the SDK's HTTP layer honours.
            return error(status if status < 500 else 503, exc.message, "user" if status < 500 else "server",
                         retry_after_headers(exc))
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return wrapped


# The largest integer a database column holds (SQLite's and PostgreSQL's BIGINT): a larger id is the caller's error.
MAX_INTEGER = 2**63 - 1


def integer(value: object, field: str, low: int = 0, high: int = MAX_INTEGER) -> int:
    """A JSON integer in low..high, checked before anything proportional to it is built."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise BadInput(f"{field} must be an integer in {low}..{high}, got {value!r}", field=field)
    return value


def future_answer(row: TinkerFuture, model_id: str | None = None) -> UntypedAPIFuture:
    """The submitted operation's future: its request id (with the model it creates, and a sample's sequence ids)."""
    answer = UntypedAPIFuture(request_id=row.request_id)
    if model_id is not None:
        answer["model_id"] = model_id
    if row.sample_sequence_ids:
        answer["sample_sequence_ids"] = list(row.sample_sequence_ids)
    return answer
