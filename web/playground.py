"""Playground: write a prompt, sample it from up to three models side by side (a run's current weights, a sampler
snapshot of it, a base model alone), optionally under a system prompt rendered with the model's chat template."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.errors import BadInput, SignalError
from app.services import Services
from app.services.runs import SAMPLE_LIMITS, SampleParams
from web.render import page, services, signed_in

if TYPE_CHECKING:  # rows are only ever received from app.services, never queried here
    from app.tables import Run, User

T = TypeVar("T", int, float)
PANES = 3  # models sampled side by side on one prompt
DEFAULT_MAX_TOKENS = 64  # the form's own starting value, short enough to come back at once
GROUPS = {"run": "Runs (current weights)", "snapshot": "Sampler snapshots", "base": "Base models"}


@dataclass(frozen=True)
class Model:
    """What one pane samples: a run's current weights (`run:ID`), a sampler snapshot (`snapshot:ID@NAME`) or a
    catalogue base model alone (`base:NAME`); `value` is the form's spelling of it."""

    value: str
    label: str
    run: Run | None = None
    snapshot: str | None = None
    base_model: str | None = None


@dataclass(frozen=True)
class PlayForm:
    models: list[str]
    prompt: str
    system: str
    chat: bool  # render the prompt with the model's chat template (a system prompt implies it)
    params: SampleParams


def _run_label(run: Run) -> str:
    return f"{run.name or run.id[:8]} · step {run.step}"


async def choices(svc: Services, user: User) -> list[Model]:
    """Every model the user may pick for a pane: their runs, each run's named sampler snapshots, the base models."""
    models = []
    for run in await svc.runs.list(user):
        models.append(Model(f"run:{run.id}", _run_label(run), run))
        models += [Model(f"snapshot:{run.id}@{row.name}", f"{_run_label(run)} · snapshot {row.name}", run, row.name)
                   for row in await svc.runs.checkpoints(run) if row.mode == "sampler" and row.name]
    return models + [Model(f"base:{model.name}", f"{model.name} · base model", base_model=model.name)
                     for model in svc.catalog.list() if model.available]


async def resolve(svc: Services, user: User, value: str) -> Model:
    """The pane's model, checked: the run is the user's (another's is not found), the snapshot exists."""
    kind, _, name = value.partition(":")
    if kind == "base":
        if not any(model.name == name and model.available for model in svc.catalog.list()):
            raise BadInput(f"no base model {name!r} on this server", field="model")
        return Model(value, f"{name} · base model", base_model=name)
    if kind not in ("run", "snapshot"):
        raise BadInput(f"model must be run:ID, snapshot:ID@NAME or base:NAME, got {value!r}", field="model")
    run_id, _, snapshot = name.partition("@") if kind == "snapshot" else (name, "", "")
    run = await svc.runs.get(user, run_id)
    if kind == "run":
        return Model(value, _run_label(run), run)
    if snapshot not in {row.name for row in await svc.runs.checkpoints(run) if row.mode == "sampler"}:
        raise BadInput(f"run {run.id[:8]} has no sampler snapshot {snapshot!r}", field="model")
    return Model(value, f"{_run_label(run)} · snapshot {snapshot}", run, snapshot)


@signed_in
async def playground_page(request: Request, user: User) -> Response:
    svc = services(request)
    models = await choices(svc, user)
    groups = [(label, [m for m in models if m.value.startswith(f"{kind}:")]) for kind, label in GROUPS.items()]
    selected = request.query_params.get("run", "")
    return page(request, "playground.html", user=user, groups=groups, has_models=bool(models), selected=f"run:{selected}" if selected else "",
                panes=PANES, limits=SAMPLE_LIMITS, sample_tokens=svc.runs.bounds.max_sample_tokens,
                default_tokens=DEFAULT_MAX_TOKENS)


@signed_in
async def playground_sample(request: Request, user: User) -> Response:
    """Without a stream (no script): the first pane's model, answered whole."""
    form = sample_form(await request.form())
    svc = services(request)
    model, params = (await prepared(svc, user, form))[0]
    result = await svc.runs.sample(user, model.run.id if model.run else None, params, snapshot=model.snapshot,
                                   base_model=model.base_model)
    return page(request, "_samples_result.html", user=user, prompt=form.prompt, sequences=result.sequences[0])


def sample_form(form: FormData) -> PlayForm:
    """The models, the prompt and the sample's parameters the form asks for (`run_id`: one run, as older forms
    posted it)."""
    prompt = str(form.get("prompt", "")).strip()
    if not prompt:
        raise BadInput("Write a prompt first.", field="prompt")
    models = [str(value) for value in form.getlist("model") if str(value)]
    if not models:
        models = [f"run:{form.get('run_id', '')}"]
    if len(models) > PANES:
        raise BadInput(f"{len(models)} models; the playground compares at most {PANES}", field="model")
    stop = [line for line in str(form.get("stop", "") or "").replace("\r\n", "\n").split("\n") if line]
    params = SampleParams(prompts=[prompt], max_tokens=_number(form, "max_tokens", int, DEFAULT_MAX_TOKENS),
                          temperature=_number(form, "temperature", float, 0.7),
                          top_p=_number(form, "top_p", float, SampleParams.top_p),
                          num_samples=_number(form, "num_samples", int, 1), stop=stop or None,
                          store=True)  # every pane's sample is kept: the run's history, or the user's for a base
    system = str(form.get("system", "") or "").strip()
    return PlayForm(models, prompt, system, bool(system) or bool(form.get("chat")), params)


async def prepared(svc: Services, user: User, form: PlayForm) -> list[tuple[Model, SampleParams]]:
    """Each pane's model and its sample: the form's bounds checked first (the contract's, and the server's per-call
    ones), then, for a chat, the messages rendered with that model's template, as /v1's chat path renders them."""
    form.params.check(svc.runs.bounds)
    panes = []
    for value in form.models:
        model = await resolve(svc, user, value)
        params = form.params
        if form.chat:
            messages = ([{"role": "system", "content": form.system}] if form.system else []) + \
                [{"role": "user", "content": form.prompt}]
            try:
                rendered = await svc.runs.render_chat(model.run, messages=messages, base_model=model.base_model)
            except SignalError as error:
                if error.field != "messages":
                    raise
                raise BadInput(f"{model.label} has no chat template: clear the system prompt and untick "
                               "\"Chat template\"", field="system") from None
            # The history shows the chat as typed, not the rendered ids (the template's markup is the model's).
            params = replace(params, prompts=None, prompt_tokens=[rendered.prompt_tokens or []],  # messages: not None
                             prompt_texts=[chat_text(messages)])
        panes.append((model, params))
    return panes


def chat_text(messages: list[dict[str, str]]) -> str:
    """A chat as the sample history shows it: each turn on its own lines, named by its role."""
    return "\n\n".join(f"{message['role'].capitalize()}: {message['content']}" for message in messages)


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
