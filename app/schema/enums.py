"""GraphQL's enums for the loss and its reduction: the SDL names every loss, so GraphiQL completes one and a typo is
a validation error. Values are the contract's spellings (`cross_entropy`, `mean`), which the service layer takes;
tests/app/test_contract_drift.py fails when the contract gains a loss or a reduction these lack. The SDK and the other
wires keep their own spellings."""

from __future__ import annotations

from enum import Enum

import strawberry

from gpu_runtime.contract import DEFAULT_LOSS_FN, DEFAULT_REDUCTION


@strawberry.enum(description="The loss a forward or forward_backward computes (docs/LOSSES.md)")
class LossFn(Enum):
    CROSS_ENTROPY = "cross_entropy"
    IMPORTANCE_SAMPLING = "importance_sampling"
    PPO = "ppo"
    CISPO = "cispo"
    DRO = "dro"
    GSPO = "gspo"
    STABLE_REINFORCE = "stable_reinforce"


@strawberry.enum(description="How a step's losses and gradients are reduced: MEAN over every weighted target token "
                             "before optim_step (Signal's default), SUM the raw sums (Tinker's)")
class Reduction(Enum):
    MEAN = "mean"
    SUM = "sum"


DEFAULT_LOSS = LossFn(DEFAULT_LOSS_FN)
DEFAULT_REDUCTION_ENUM = Reduction(DEFAULT_REDUCTION)
