"""Playground: pick a run, write a prompt, sample from its current weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import BadInput
from app.services.runs import SAMPLE_LIMITS, SampleParams
from web.render import page, services, signed_in

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import User

T = TypeVar("T", int, float)


@signed_in
async def playground_page(request: Request, user: User) -> Response:
    runs = await services(request).runs.list(user)
    return page(request, "playground.html", user=user, runs=runs, selected=request.query_params.get("run", ""),
                limits=SAMPLE_LIMITS)


@signed_in
async def playground_sample(request: Request, user: User) -> Response:
    run_id, prompt, params = sample_form(await request.form())
    result = await services(request).runs.sample(user, run_id, params)
    return page(request, "_samples_result.html", user=user, prompt=prompt, sequences=result["sequences"][0])


def sample_form(form: FormData) -> tuple[str, str, SampleParams]:
    """The run, the prompt and the sample's parameters the form asks for."""
    prompt = str(form.get("prompt", "")).strip()
    if not prompt:
        raise BadInput("Write a prompt first.", field="prompt")
    params = SampleParams(prompts=[prompt], max_tokens=_number(form, "max_tokens", int, 64),
                          temperature=_number(form, "temperature", float, 0.7),
                          num_samples=_number(form, "num_samples", int, 1))
    return str(form.get("run_id", "")), prompt, params


def _number(form: FormData, name: str, kind: type[T], default: T) -> T:
    raw = str(form.get(name, "") or "").strip()
    try:
        return kind(raw) if raw else default
    except ValueError:
        raise BadInput(f"{name} must be a number, got {raw!r}", field=name) from None  # the contract's own name


routes = [
    Route("/playground", playground_page, methods=["GET"]),
    Route("/playground", playground_sample, methods=["POST"]),
]
