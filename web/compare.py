"""Compare (issue 18 §2): 2-8 of the user's runs, their loss curves overlaid and their configurations side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from web.render import page, services, signed_in

if TYPE_CHECKING:
    from app.services.dashboard import RunCurve
    from app.tables import User

# The configuration table's rows: a label and how to read it off a run's curve (its run and its learning rates).
SETTINGS: list[tuple[str, Any]] = [
    ("Base model", lambda c: c.run.base_model),
    ("LoRA rank", lambda c: c.run.lora_config.get("r")),
    ("LoRA alpha", lambda c: c.run.lora_config.get("alpha")),
    ("LoRA dropout", lambda c: c.run.lora_config.get("dropout")),
    ("Target modules", lambda c: ", ".join(c.run.lora_config.get("target_modules") or ["default"])),
    ("Learning rate (run's default)", lambda c: c.run.optimizer_config.get("learning_rate")),
    ("Learning rates used", lambda c: ", ".join(f"{rate:g}" for rate in c.learning_rates) or "none yet"),
    ("Weight decay", lambda c: c.run.optimizer_config.get("weight_decay")),
    ("Grad clip norm", lambda c: c.run.optimizer_config.get("grad_clip_norm")),
    ("Seed", lambda c: c.run.seed),
    ("Base weights", lambda c: c.run.quantization or "full precision"),
    ("Device", lambda c: c.run.device or "unknown"),
    ("Steps", lambda c: c.run.step),
    ("Last loss", lambda c: f"{c.losses[-1]:.4f}" if c.losses else "—"),
]


@dataclass
class SettingRow:
    label: str
    values: list[str]  # one per run, in the page's order
    differs: bool  # the page marks the rows in which the runs differ


@signed_in
async def compare_page(request: Request, user: User) -> Response:
    """?ids=a,b (or the runs list's checkboxes, ?ids=a&ids=b): the state is the URL, so a comparison can be linked."""
    ids = [part.strip() for value in request.query_params.getlist("ids") for part in value.split(",") if part.strip()]
    curves = await services(request).dashboard.compare(user, ids)
    return page(request, "compare.html", user=user, curves=curves, settings=settings_table(curves),
                chart=[{"name": _name(c), "steps": c.steps, "losses": c.losses} for c in curves])


def settings_table(curves: list[RunCurve]) -> list[SettingRow]:
    """Each setting's value per run, and whether the runs differ in it."""
    rows = []
    for label, read in SETTINGS:
        values = [str(read(curve)) for curve in curves]
        rows.append(SettingRow(label, values, len(set(values)) > 1))
    return rows


def _name(curve: RunCurve) -> str:
    return curve.run.name or curve.run.id[:8]


routes = [Route("/runs/compare", compare_page)]
