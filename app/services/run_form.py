"""What the dashboard's "New run" form offers (issue 18 §1), and its posted fields read into a RunSpec.

The choices and defaults come from the catalogue, the GPU allocation rules and the engine contract, so the form
and createRun agree; creating goes through RunService.create like every other front end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from app.catalog import Catalog
from app.errors import BadInput, SignalError
from app.services.runs import RunService, RunSpec
from app.settings import Settings
from gpu_runtime.client.allocation import GPUS, LEGAL_COUNTS, QUANTIZATIONS
from gpu_runtime.contract import ADAM_DEFAULTS, LORA_DEFAULTS, LORA_R_MAX

Number = TypeVar("Number", int, float)
DEVICE_WAIT_S = 2.0  # the form does not wait on a runtime still starting: it says "not known yet" instead


@dataclass(frozen=True)
class ModelChoice:
    name: str
    parameters: int
    gpu: str  # the catalogue's allocation: what an empty GPU choice gets
    quantization_allowed: bool
    unavailable: str | None  # why runs cannot use it here, or None


@dataclass(frozen=True)
class RunFormChoices:
    models: list[ModelChoice]
    default_model: str
    lora_r: int
    lora_r_max: int
    learning_rate: float
    quantizations: tuple[str, ...]
    gpus: list[str]  # "TYPE:count" allocations the picker offers (Modal); empty where the backend has no GPU choice
    device: str | None  # where a run trains here (local backend): the runtime's device, None while not known


class RunForm:
    def __init__(self, settings: Settings, catalog: Catalog, runs: RunService) -> None:
        self.settings, self.catalog, self.runs = settings, catalog, runs

    async def choices(self) -> RunFormChoices:
        modal = self.settings.backend == "modal"
        return RunFormChoices(
            models=[ModelChoice(m.name, m.parameters, m.gpu, m.quantization_allowed, m.unavailable)
                    for m in self.catalog.list()],
            default_model=self.settings.default_model, lora_r=int(LORA_DEFAULTS["r"]), lora_r_max=LORA_R_MAX,
            learning_rate=ADAM_DEFAULTS["learning_rate"], quantizations=QUANTIZATIONS,
            gpus=[f"{gpu.name}:{count}" for gpu in GPUS for count in LEGAL_COUNTS if count <= gpu.max_count] if modal else [],
            device=None if modal else await self._device())

    async def _device(self) -> str | None:
        try:
            return await asyncio.wait_for(self.runs.base_device(self.settings.default_model), DEVICE_WAIT_S)
        except (TimeoutError, SignalError):  # a runtime still starting (or down): the page still opens
            return None

    @staticmethod
    def spec(form: Mapping[str, str]) -> RunSpec:
        """The posted fields as createRun's input; a number that does not parse is BadInput naming createRun's field."""
        return RunSpec(
            name=form.get("name") or None, base_model=form.get("baseModel") or None,
            lora_r=_number(form, "loraR", int), lora_alpha=_number(form, "loraAlpha", float),
            train_mlp=True if form.get("trainMlp") else None, train_unembed=True if form.get("trainUnembed") else None,
            learning_rate=_number(form, "learningRate", float), quantization=form.get("quantization") or None,
            gpu_config=form.get("gpuConfig") or None,
            tags=[tag for tag in (form.get("tags") or "").split(",") if tag.strip()] or None,
            note=form.get("note") or None)


def _number(form: Mapping[str, str], field: str, kind: type[Number]) -> Number | None:
    text = (form.get(field) or "").strip()
    if not text:
        return None  # left empty: the contract's default
    try:
        return kind(text)
    except ValueError:
        raise BadInput(f"{field} must be {'a whole number' if kind is int else 'a number'}, not {text[:40]!r}",
                       field=field) from None
