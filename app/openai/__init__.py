"""An OpenAI-compatible endpoint under /v1: thin handlers over app/services (docs/OPENAI.md). It imports no other
wire (app.schema, app.tinker); tests/gpu_runtime/test_rooms.py checks.

- `errors`: OpenAI's error shape, the wire's one exception mapping, and its 413.
- `params`: a request body checked into a `CompletionRequest` (every parameter error names its `param`).
- `targets`: what `model` names (a run, a snapshot, a `tinker://` sampler path, a base model) and the models list.
- `generation`: the request's one sample: its prompts as token ids, the sample, the answer.
- `answers`: a sample's result in OpenAI's completion and chat shapes, stop strings and EOS left out.
- `streaming`: the server-sent events.
- `routes`: the Starlette routes.
- `tools`, `tool_parsers`, `tool_answers`: tool calling on chat (the request, the per-family parsers, the answer).
- `responses`, `response_route`: the Responses API over the chat handler, and its stored conversations.
"""

from app.openai.routes import openai_app

__all__ = ["openai_app"]
