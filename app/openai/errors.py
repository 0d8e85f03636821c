"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, and Signal's typed errors in it.

Every parameter error is a 400 naming `param` (the `openai` package raises BadRequestError; a 422 would be its
UnprocessableEntityError), a bad key 401, an unknown or foreign model 404 `model_not_found`.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.errors import BadInput, NotFound, RunNotFound, SignalError, Unauthenticated, http_status, retry_after_s
from app.failures import known_failure
from gpu_runtime.contract.json_types import JSONObject

log = logging.getLogger("signal.openai")

# The service layer names fields as GraphQL does; an OpenAI client sent these.
FIELD_PARAMS = {"maxTokens": "max_tokens", "numSamples": "n", "topP": "top_p", "topK": "top_k", "runId": "model",
                "topkSampleLogprobs": "logprobs", "topkPromptLogprobs": "logprobs", "promptLogprobs": "echo"}
TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # a 429's Retry-After: the openai package waits that long, then retries
        self.kind = kind or TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")

    def body(self) -> JSONObject:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(math.ceil(self.retry_after_s))} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def model_not_found(name: str, why: str | None = None) -> OpenAIError:
    return OpenAIError(404, why or f"The model {name!r} does not exist or you do not have access to it.",
                       param="model", code="model_not_found")


def openai_param(field: str | None, prompt_param: str) -> str | None:
    """A service-layer field name as the OpenAI parameter the client sent: `maxTokens` → `max_tokens`,
    `promptTokens[2]` → `prompt` (or `messages` on chat)."""
    if not field:
        return None
    if re.match(r"^(prompts|promptTokens|prompt_tokens)(\[|$)", field):
        return prompt_param
    if field in FIELD_PARAMS:
        return FIELD_PARAMS[field]
    return re.sub(r"(?<!^)([A-Z])", lambda m: "_" + m.group(1).lower(), field)


def from_signal(error: SignalError, prompt_param: str = "prompt") -> OpenAIError:
    """A typed Signal error in OpenAI's shape, its status kept (402 credits, 503 billing, 507 disk…)."""
    if isinstance(error, Unauthenticated):
        return OpenAIError(401, error.message, code="invalid_api_key")
    if isinstance(error, RunNotFound | NotFound):
        return OpenAIError(404, error.message, param="model", code="model_not_found")
    if isinstance(error, BadInput):
        return OpenAIError(400, error.message, param=openai_param(error.field, prompt_param), code="invalid_value")
    return OpenAIError(http_status(error), error.message, param=openai_param(error.field, prompt_param),
                       code=error.code.lower(), retry_after_s=retry_after_s(error))


def too_large(limit: int) -> OpenAIError:
    """The wire's 413, for a declared length (app/body_limit.py, before any parsing) or a body met streaming in."""
    return OpenAIError(413, f"the request body is over {limit} bytes", code="request_too_large")


def as_openai(exc: Exception, prompt_param: str = "prompt") -> OpenAIError:
    """The wire's one exception mapping: its own errors as they are, typed Signal errors, the database's failures,
    recursion, overflow and decoding errors (app/failures.py); anything else, a bug, is logged and a 500 in OpenAI's
    shape."""
    if isinstance(exc, OpenAIError):
        return exc
    known = known_failure(exc)
    if known is not None:
        return from_signal(known, prompt_param)
    log.error("/v1 request failed", exc_info=exc)
    return OpenAIError(500, "internal server error", kind="api_error")


def answering_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Every failure as OpenAI's error response (a Router has no exception handlers)."""
    @functools.wraps(handler)
    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:  # noqa: BLE001 - every failure in the wire's shape
            return as_openai(exc).response()
    return handle
