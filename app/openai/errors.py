"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, and Signal's typed errors in it.

Every parameter error is a 400 naming `param` (the `openai` package raises BadRequestError; a 422 would be its
UnprocessableEntityError), a bad key 401, an unknown or foreign model 404 `model_not_found`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from starlette.responses import JSONResponse

from app.errors import BadInput, NotFound, RunNotFound, SignalError, Unauthenticated, http_status, retry_after_s

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

    def body(self) -> dict[str, Any]:
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
