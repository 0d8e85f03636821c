"""A Call over HTTP: its GraphQL request body, its answer read into a result or a typed error, and when a failed
attempt is sent again.

The four training primitives carry a fresh `requestId` each. When the connection drops or the server answers
WORKER_FAILED, the client sends the same call again, with the same id, a few times: the server applies a call once
per id and answers a retry with the first attempt's result.
"""

from __future__ import annotations

from typing import Any, TypedDict

import httpx

from rewardsignal.calls import Call
from rewardsignal.errors import (
    PayloadTooLargeError,
    ResourceExhaustedError,
    ServerError,
    TransportError,
    UnavailableError,
    WorkerFailedError,
    error_from_graphql,
)
from rewardsignal.operations import document
from rewardsignal.results import TYPED, Result, convert

DEFAULT_BASE_URL = "http://localhost:8000"
DEFAULT_TIMEOUT = 600.0  # a forward_backward on a large model can take minutes
DEFAULT_MAX_ATTEMPTS = 3  # tries of a primitive whose connection dropped or whose worker failed
DEFAULT_RETRY_BACKOFF = 0.5  # seconds before the second try; doubled before each further one
UNAVAILABLE_BUDGET_S = 60.0  # an UNAVAILABLE (locked database) or too-many-calls answer is retried this long in all
MAX_RETRY_DELAY_S = 8.0
# The connection dropped, or never came up: the call may or may not have reached the server.
RETRYABLE_TRANSPORT_ERRORS = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)
# What a call's attempt may end in that `retry_delay` may send again; it decides which (a full disk: never).
MAYBE_RETRIED = (httpx.HTTPError, WorkerFailedError, UnavailableError, ResourceExhaustedError)


class GraphQLRequest(TypedDict):
    """The JSON body POSTed to /graphql."""

    query: str
    variables: dict[str, Any]  # the Call's: free-form JSON
    operationName: str


def request_body(call: Call) -> GraphQLRequest:
    return {"query": document(call.operation), "variables": call.variables, "operationName": call.operation}


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def read_answer(call: Call, response: httpx.Response) -> Any:
    """The call's field of the GraphQL answer as the SDK's result type (wrapped by `call.wrap`), or its typed error."""
    try:
        body = response.json()
    except ValueError:
        if response.status_code == 413:  # refused by the server's body limit before any GraphQL
            raise PayloadTooLargeError(f"the request body is too large: {response.text[:200]}") from None
        raise TransportError(f"server answered HTTP {response.status_code} without JSON: {response.text[:200]}") from None
    if body.get("errors"):
        raise error_from_graphql(body["errors"][0])
    if response.status_code >= 400 or not isinstance(body.get("data"), dict):
        raise ServerError(f"server answered HTTP {response.status_code}")
    value = convert(body["data"][call.field], TYPED.get(call.field, Result))
    return call.wrap(value) if call.wrap else value


def retry_delay(call: Call, attempt: int, error: Exception, elapsed: float, max_attempts: int,
                retry_backoff: float) -> float | None:
    """Seconds to wait before sending `call` again (same request id) after `error` on try `attempt`, `elapsed` seconds
    after the first; None: give up. A dropped connection or a dead runtime: `max_attempts` tries. UNAVAILABLE (the
    call may be applied; a retry records it): backoff for UNAVAILABLE_BUDGET_S in all. Too many calls in flight:
    after the server's retryAfterS, within the same budget. Errors that mean "never applied" (deadline, full disk)
    are raised."""
    if not call.retry:
        return None
    backoff = retry_backoff * 2 ** (attempt - 1)
    if isinstance(error, UnavailableError) or (isinstance(error, ResourceExhaustedError) and error.retryable):
        delay = error.retry_after_s if isinstance(error, ResourceExhaustedError) else None
        delay = min(delay if delay is not None else backoff, MAX_RETRY_DELAY_S)
        return float(delay) if elapsed + delay <= UNAVAILABLE_BUDGET_S else None
    if isinstance(error, WorkerFailedError) and error.retryable is False:
        return None  # in flight through two runtime deaths: the server says not to send it a third time
    if not (isinstance(error, (*RETRYABLE_TRANSPORT_ERRORS, WorkerFailedError)) and attempt < max_attempts):
        return None
    return float(backoff)


def unreachable(url: str, error: httpx.HTTPError) -> TransportError:
    return TransportError(f"cannot reach Signal at {url}: {error}")
