"""The plain data a pass takes and gives back, and what compute reads of a run: the seam between `engine/` (which
decides what runs) and `compute/` (which runs it). Nothing here imports the engine; the engine's `RunState` satisfies
`RunWeights` by its shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NotRequired, Protocol, TypedDict

import torch

from gpu_runtime.compute.batches import Datum
from gpu_runtime.contract.custom_loss import CustomLoss
from gpu_runtime.contract.training_settings import LoraSettings
from gpu_runtime.errors import SignalError


class RunConfig(TypedDict):
    """What a run's config.json holds: written once by create_run, read by every restore."""

    run_id: str
    user_id: str
    base_model: str
    base_revision: NotRequired[str | None]  # the base's content hash when the run was made (a restore checks it)
    lora: LoraSettings  # r, alpha, dropout, target_modules, as the contract's lora_settings resolved them
    seed: int
    created_at: NotRequired[float]
    quantization: NotRequired[str | None]  # None: the base in its own dtype (runs from before quantization have none)
    from_checkpoint: NotRequired[str]  # signal://… the run started from, if it did


class RunWeights(Protocol):
    """What a pass, an optimizer step or a merge reads of a run: its id, its LoRA settings and matrices, its AdamW."""

    run_id: str
    step: int
    weights: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]  # layer path → (A, B)
    optimizer: torch.optim.AdamW

    @property
    def lora(self) -> LoraSettings: ...

    def parameters(self) -> list[torch.nn.Parameter]: ...


class SplitCall(Protocol):
    """A call computed in parts across passes, whose gradients are put back if a later part fails."""

    done: int

    @property
    def run_id(self) -> str: ...

    def restore_grads(self) -> None: ...


@dataclass
class PartOutcome:
    """A part's loss sum and normaliser over every rank; with return_outputs, each datum's per-position values."""

    loss_sum: float
    normaliser: float
    outputs: list[dict[str, list[float]]] | None = None  # [{logprobs, elementwise_loss}] per datum, in order
    metrics: dict[str, float] | None = None  # a custom loss's own metrics (custom/<name>:sum|mean), over its rows
    lora_kernel: str | None = None  # the segmented LoRA kernel the pass ran (ops.pass_kernel), for the journal
    join_rows: bool = False  # its datums shared model rows (compute/joined_rows.py), for the journal


Outcome = PartOutcome | SignalError  # a part's sums, or why it was left out


@dataclass
class PassPart:
    """One call's rows in one pass, as plain data: rank 0 broadcasts these, and every rank runs the same ones."""

    run_id: str | None  # None: the base alone (a forward on a base model: its rows reach no adapter)
    examples: list[Datum]
    row_offset: int  # where these rows start within the call: its dropout masks are sliced from there
    call_rows: int  # the whole call's rows and padded width: its dropout masks are drawn at this shape
    call_width: int
    dropout_seed: int | None  # None: no dropout (a forward)
    loss_fn: str
    loss_config: dict[str, float] = field(default_factory=dict)
    custom: CustomLoss | None = None  # loss_fn "custom": the checked graph run per datum
    backup: bool = False  # the first part of a split call: keep the run's gradients, to put back if a later part fails
    return_outputs: bool = False  # compute and ship per-position logprobs and elementwise losses
    forward_only: bool = False  # a forward: no backward, no gradient kept
    lora_kernel: str | None = None  # a replayed record's LoRA kernel (or ops.LEGACY); None: live, today's choice
    join_rows: bool | None = None  # a replayed record's: whether its datums shared model rows; None: live, decided
