"""An OpenAI-compatible endpoint under /v1: thin handlers over app/services (docs/OPENAI.md).

- `errors`: OpenAI's error shape, and Signal's typed errors in it.
- `params`: a request body checked and turned into one `sample` (every parameter error names its `param`).
- `answers`: a sample's result in OpenAI's completion and chat shapes, stop strings and EOS left out.
- `routes`: the Starlette routes and the server-sent events.
- `tools`, `tool_parsers`, `tool_answers`: tool calling on chat (the request, the per-family parsers, the answer).
- `responses`, `response_route`: the Responses API over the chat handler, and its stored conversations.
"""

from app.openai.routes import OpenAIBodyLimit, openai_app

__all__ = ["OpenAIBodyLimit", "openai_app"]
