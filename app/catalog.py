"""The model catalogue (config/models.yaml): the base models runs may use, and their GPU allocation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from app.errors import BadInput
from gpu_runtime.allocation import allocate, parse_gpu_config


@dataclass(frozen=True)
class CatalogModel:
    name: str
    family: str
    parameters: int
    offline: bool
    description: str
    path: str | None
    gpu: str

    @property
    def source(self) -> str:
        """What the worker loads: the local path when there is one, else the hub id."""
        return self.path or self.name


class Catalog:
    def __init__(self, models: list[CatalogModel]) -> None:
        self._models = {model.name: model for model in models}

    @classmethod
    def from_file(cls, path: Path) -> Catalog:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls([_parse_entry(entry, path) for entry in data.get("models", [])])

    def list(self) -> list[CatalogModel]:
        return list(self._models.values())

    def get(self, name: str) -> CatalogModel:
        model = self._models.get(name)
        if model is None:
            raise BadInput(
                f"unknown base model {name!r}; `models` lists the available ones "
                "(add yours to config/models.yaml)",
                field="baseModel",
            )
        return model


def _parse_entry(entry: dict, source: Path) -> CatalogModel:
    if not isinstance(entry, dict) or not entry.get("name"):
        raise ValueError(f"{source}: every model needs a name, got {entry!r}")
    parameters = int(entry.get("parameters", 0))
    gpu = str(parse_gpu_config(entry["gpu"])) if entry.get("gpu") else str(allocate(parameters))
    return CatalogModel(
        name=str(entry["name"]),
        family=str(entry.get("family", "")),
        parameters=parameters,
        offline=bool(entry.get("offline", False)),
        description=str(entry.get("description", "")),
        path=str(entry["path"]) if entry.get("path") else None,
        gpu=gpu,
    )
