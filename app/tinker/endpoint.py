"""What every Tinker handler shares: the SDK's key, JSON bodies, and typed errors as the JSON responses it expects.

Auth is the SDK's `X-API-Key: tml-<Signal key>`, never the dashboard's cookie (so /api/v1 is exempt from CSRF).
Every 4xx is a plain JSON response with a Content-Length: a 400 without a body sends the SDK into a reconnect loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.errors import BadInput, Unauthenticated, http_status, retry_after_headers
from app.failures import known_failure
from app.services import Services, services_of
from app.services.tinker_futures import credential
from app.services.tinker_sessions import SessionFinished
from app.tables import TinkerFuture, User
from app.tinker import compression
from app.tinker.messages import UntypedAPIFuture
from gpu_runtime.errors import FailedPrecondition

log = logging.getLogger("signal.tinker")
PREFIX = "/api/v1"
KEY_PREFIX = "tml-"  # the SDK refuses keys without it: users send tml- + their whole Signal key (tml-sk-…)
Handler = Callable[[Request], Awaitable[Response]]
# A handler answers a Response or one of app/tinker/messages.py's TypedDicts, sent as JSON.
UserHandler = Callable[[Request, User], Awaitable[Response | Mapping[str, object]]]


def error(status: int, message: str, category: str = "user", headers: dict[str, str] | None = None) -> JSONResponse:
    # Never an "error" key the SDK could mistake for a failed future: this is an HTTP error, with `detail`.
    return JSONResponse({"detail": message, "category": category}, status_code=status, headers=headers)


def too_large(limit: int) -> JSONResponse:
    """The wire's 413, for a declared length (app/body_limit.py, before any parsing) or a body met streaming in."""
    return error(413, f"the request body is over {limit} bytes", "user")


def services(request: Request) -> Services:
    return services_of(request)


async def authenticate(request: Request) -> User:
    """The X-API-Key header with one leading `tml-` stripped, as any Signal key. The session cookie is never read."""
    secret = request.headers.get("x-api-key") or ""
    if secret.startswith(KEY_PREFIX):
        secret = secret.removeprefix(KEY_PREFIX)
    if not secret:
        raise Unauthenticated("missing API key: send X-API-Key: tml-<your Signal key>")
    keys = services(request).keys
    user = await keys.authenticate(secret)
    credential.set(lambda: keys.authenticate(secret))  # re-checked while the request's futures are pending
    return user


async def body(request: Request) -> Mapping[str, object]:
    """The request's JSON object, as sent: each handler checks the fields it reads."""
    raw = await compression.request_body(request, services(request).settings.max_request_bytes)
    try:
        value = json.loads(raw or b"{}")
    except RecursionError:
        raise BadInput("the body is nested too deeply", field="body") from None
    except ValueError:  # UnicodeDecodeError included
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
        except HTTPException as caught:  # the body limit, met while the body streamed in
            if caught.status_code != 413:
                raise
            return too_large(services(request).settings.max_request_bytes)
        except Exception as caught:  # noqa: BLE001 - every failure in the wire's shape
            failure = known_failure(caught)
            if failure is None:  # a bug: logged with its trace, answered in the wire's shape (never a reset connection)
                log.exception("Tinker %s %s failed", request.method, request.url.path)
                return error(500, "internal server error", "server")
            status = http_status(failure)
            if isinstance(failure, (BadInput, FailedPrecondition)):
                status = 400  # the SDK's user error at submit (422 is fatal too; 400 is what the issue names)
            # A 429 (too many calls in flight) carries Retry-After, which the SDK's HTTP layer honours; it is the
            # server's capacity, not the user's mistake (as the throttled polls say).
            user_fault = status < 500 and status != 429
            return error(status if status < 500 else 503, failure.message, "user" if user_fault else "server",
                         retry_after_headers(failure))
        return answer if isinstance(answer, Response) else JSONResponse(answer)

    return wrapped


def future_answer(row: TinkerFuture, model_id: str | None = None) -> UntypedAPIFuture:
    """The submitted operation's future: its request id (with the model it creates, and a sample's sequence ids)."""
    answer = UntypedAPIFuture(request_id=row.request_id)
    if model_id is not None:
        answer["model_id"] = model_id
    if row.sample_sequence_ids:
        answer["sample_sequence_ids"] = list(row.sample_sequence_ids)
    return answer
