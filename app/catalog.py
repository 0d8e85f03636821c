"""The model catalogue (config/models.yaml): the base models runs may use, and their GPU allocation."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.errors import BadInput
from gpu_runtime.client.allocation import (
    ATTENTION_ONLY,
    GB,
    ExpertShape,
    LoraTargets,
    allocate,
    check_fit,
    estimate_bytes,
    parse_gpu_config,
    parse_quantization,
    smallest_fit,
    smallest_single_gpu,
)
from gpu_runtime.contract import LORA_DEFAULTS
from gpu_runtime.contract.families import MOE_FAMILIES, family_problem

FRAMEWORKS = ("transformers", "unsloth")
_FIELDS = {"name", "family", "parameters", "offline", "description", "path", "gpu", "context_length", "framework",
           "quantization_allowed", "quantized", "vocab_size", "tokenizer", "active_parameters", "experts"}
_EXPERT_FIELDS = ("experts", "active_experts", "hidden", "intermediate", "layers")


@dataclass(frozen=True)
class CatalogModel:
    name: str
    family: str
    parameters: int
    offline: bool
    description: str
    path: str | None
    gpu: str
    context_length: int | None = None  # tokens; None when the catalogue does not say
    framework: str = "transformers"
    quantization_allowed: bool = False
    quantized: str | None = None  # "4bit" / "8bit": the published weights are already quantized (bitsandbytes)
    unavailable: str | None = None  # why runs cannot use it here (a framework missing), or None
    vocab_size: int | None = None  # the unembedding's rows, for the fit of LoRA on lm_head (None: an estimate)
    tokenizer: str | None = None  # the tokenizer's Hub id, where it is not the name (Tinker's get_info tokenizer_id)
    active_parameters: int | None = None  # a mixture-of-experts model's parameters per token (None: all of them)
    experts: ExpertShape | None = None  # a mixture-of-experts model's expert layers (the fit counts every expert)

    @property
    def source(self) -> str:
        """What the worker loads: the local path when there is one, else the hub id."""
        return self.path or self.name

    @property
    def available(self) -> bool:
        return self.unavailable is None

    @property
    def estimated_memory_gb(self) -> float:
        """GPU memory a run at the default LoRA settings needs (rank 32, attention only), bf16 weights
        (gpu_runtime.client.allocation's estimate). A run on the MLP or the unembedding needs more: resolve_gpu counts it."""
        return round(estimate_bytes(self.parameters, targets=self.lora_targets({})) / GB, 1)

    def lora_targets(self, switches: dict[str, bool]) -> LoraTargets:
        """The fit estimate's view of a run's targets on this model (its vocabulary and experts, when the catalogue
        says)."""
        return LoraTargets.of(switches, self.vocab_size, self.experts)


class Catalog:
    def __init__(self, models: list[CatalogModel]) -> None:
        self._models = {model.name: model for model in models}

    @classmethod
    def from_file(cls, path: Path, frameworks: Collection[str] | None = None) -> Catalog:
        """Load and check the catalogue; `frameworks` are those usable here (default: what this machine has)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        usable = available_frameworks() if frameworks is None else frameworks
        return cls([_parse_entry(entry, path, usable) for entry in data.get("models", [])])

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

    def resolve_gpu(self, model: CatalogModel, gpu_config: str | None, quantization: str | None = None,
                    lora_r: int = LORA_DEFAULTS["r"], targets: LoraTargets = ATTENTION_ONLY) -> str:
        """The GPU configuration a new run on `model` gets: the override or the catalogue's, checked to hold it.

        BadInput names the field: baseModel (framework missing here), quantization, or gpuConfig (with the
        smallest configuration that fits). `targets` counts LoRA on the MLP and the unembedding ([vocab, r] B).
        """
        if model.unavailable is not None:
            raise BadInput(f"{model.name} cannot be used here: {model.unavailable}", field="baseModel")
        if targets.experts is None and model.experts is not None:  # a MoE model's fit counts its experts
            targets = dataclasses.replace(targets, experts=model.experts)
        quantization = self.resolve_quantization(model, quantization)
        allocation = parse_gpu_config(gpu_config or model.gpu, field="gpuConfig")
        if quantization is not None and allocation.count > 1:
            single = smallest_single_gpu(model.parameters, quantization, lora_r, targets)
            raise BadInput(f"a {quantization} base trains on one GPU only, and {allocation} asks for {allocation.count}; "
                           + (f"{single} holds {model.name} in {quantization}" if single else
                              f"no single GPU holds {model.name} even in {quantization}: drop quantization"),
                           field="quantization")
        return str(check_fit(model.name, model.parameters, allocation, quantization, lora_r, targets=targets))

    def resolve_quantization(self, model: CatalogModel, quantization: str | None) -> str | None:
        """The quantization a run on `model` trains with: the request's, or the weights' own when pre-quantized."""
        quantization = parse_quantization(quantization)
        if model.quantized is not None:
            if quantization not in (None, model.quantized):
                raise BadInput(f"{model.name} is already quantized to {model.quantized}; it cannot be loaded in "
                               f"{quantization}", field="quantization")
            return model.quantized
        if quantization is not None and not model.quantization_allowed:
            raise BadInput(f"{model.name} does not allow quantization (config/models.yaml: quantization_allowed)",
                           field="quantization")
        return quantization


def available_frameworks() -> set[str]:
    """Frameworks this machine can train with: transformers always; unsloth when importable on CUDA.

    Torch-free (the server never imports torch): CUDA counts as present when the NVIDIA driver is loaded.
    """
    found = {"transformers"}
    if importlib.util.find_spec("unsloth") is not None and Path("/proc/driver/nvidia/version").exists():
        found.add("unsloth")
    return found


def _parse_entry(entry: Any, source: Path, frameworks: Collection[str]) -> CatalogModel:
    if not isinstance(entry, dict) or not entry.get("name"):
        raise ValueError(f"{source}: every model needs a name, got {entry!r}")
    name = str(entry["name"])

    def bad(message: str) -> ValueError:
        return ValueError(f"{source}: model {name!r}: {message}")

    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}")
    parameters = entry.get("parameters", 0)
    if isinstance(parameters, bool) or not isinstance(parameters, int) or parameters < 0:
        raise bad(f"parameters must be a non-negative integer, got {parameters!r}")
    context_length = entry.get("context_length")
    if context_length is not None and (isinstance(context_length, bool) or not isinstance(context_length, int)
                                       or context_length <= 0):
        raise bad(f"context_length must be a positive integer (tokens), got {context_length!r}")
    framework = entry.get("framework", "transformers")
    if framework not in FRAMEWORKS:
        raise bad(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    quantization_allowed = entry.get("quantization_allowed", False)
    if not isinstance(quantization_allowed, bool):
        raise bad(f"quantization_allowed must be true or false, got {quantization_allowed!r}")
    try:
        quantized = parse_quantization(entry.get("quantized"), field="quantized")
    except BadInput as error:
        raise bad(error.message) from None
    tokenizer = entry.get("tokenizer")
    if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer or ":" in tokenizer):
        raise bad(f"tokenizer must be a Hub id or a directory without ':', got {tokenizer!r}")
    vocab_size = entry.get("vocab_size")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0):
        raise bad(f"vocab_size must be a positive integer, got {vocab_size!r}")
    family = str(entry.get("family", ""))
    problem = family_problem(family) if family else None  # an entry naming no family claims none to check
    if problem is not None:
        raise bad(problem)
    active_parameters = entry.get("active_parameters")
    if active_parameters is not None and (isinstance(active_parameters, bool) or not isinstance(active_parameters, int)
                                          or not 0 < active_parameters <= parameters):
        raise bad(f"active_parameters must be a positive integer at most parameters ({parameters}), got {active_parameters!r}")
    experts = _expert_shape(entry.get("experts"), active_parameters or parameters, bad)
    if family in MOE_FAMILIES and (experts is None or active_parameters is None):
        raise bad(f"family {family!r} is mixture-of-experts: the fit needs `active_parameters` and `experts: "
                  f"{{{', '.join(_EXPERT_FIELDS)}}}` (from its config.json)")
    targets = LoraTargets(experts=experts)
    try:
        allocation = (parse_gpu_config(entry["gpu"], field="gpu") if entry.get("gpu")
                      else allocate(parameters) if experts is None else _smallest(parameters, targets))
        check_fit(name, parameters, allocation, quantized, field="gpu", targets=targets)
    except BadInput as error:
        raise bad(f"gpu: {error.message}") from None
    unavailable = None
    if framework not in frameworks:
        unavailable = (f"it needs the {framework} framework, which this server does not have"
                       + (" (unsloth must be importable and CUDA present)" if framework == "unsloth" else ""))
    return CatalogModel(
        name=name,
        family=family,
        parameters=parameters,
        offline=bool(entry.get("offline", False)),
        description=str(entry.get("description", "")),
        path=str(entry["path"]) if entry.get("path") else None,
        gpu=str(allocation),
        context_length=context_length,
        framework=framework,
        quantization_allowed=quantization_allowed or quantized is not None,
        quantized=quantized,
        unavailable=unavailable,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        active_parameters=active_parameters,
        experts=experts,
    )


def _smallest(parameters: int, targets: LoraTargets) -> Any:
    """A MoE model's default allocation: the smallest that holds every expert (the README's rules go by dense size)."""
    return smallest_fit(parameters, targets=targets) or allocate(parameters)


def _expert_shape(value: Any, active_parameters: int, bad: Any) -> ExpertShape | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(_EXPERT_FIELDS) or not all(
            isinstance(value[k], int) and not isinstance(value[k], bool) and value[k] > 0 for k in _EXPERT_FIELDS):
        raise bad(f"experts must give positive integers {', '.join(_EXPERT_FIELDS)}, got {value!r}")
    if value["active_experts"] > value["experts"]:
        raise bad(f"experts.active_experts ({value['active_experts']}) exceeds experts.experts ({value['experts']})")
    return ExpertShape(**value, active_parameters=active_parameters)
