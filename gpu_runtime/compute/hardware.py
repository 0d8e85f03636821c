"""Where the tensor work of a tick runs: this process, or a group of ranks. The tick does not know which.

`LocalCompute` runs the training step (gpu_runtime/compute/training.py) here. `RankCompute` drives a multi-GPU pool
(gpu_runtime/compute/ranks.py): rank 0 is this process, the others follow its broadcast, and the same step runs on
every rank. Both offer the same calls, so the engine has no `if ranks` branches.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from gpu_runtime.compute.lora.slots import BaseSlots
from gpu_runtime.compute.memory_fit import activation_bytes_per_token, free_device_bytes, layers_to_checkpoint
from gpu_runtime.compute.optim_tick import StepOrder, optimizer_tick, own_kernel
from gpu_runtime.compute.pass_logprobs import decoder_layers
from gpu_runtime.compute.plan import Outcome, PassPart, RunWeights, SplitCall
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.ranks import GroupReport, RankGroup
from gpu_runtime.compute.training import forward_backward_pass


@dataclass
class Stepping:
    """One run's optim_step in an optimizer tick: the run, its gradients' normaliser, the call's AdamW settings and
    the kernel a replayed journal record names (None: the run's own)."""

    state: RunWeights
    normaliser: float
    settings: dict[str, float]
    kernel: str | None = None
    slots: BaseSlots | None = None  # the run's base's slot buffers: there it steps by the slotted kernel


class LocalCompute:
    """One process holds the base and every run's LoRA."""

    world = 1
    can_merge = True  # whole base weights are here, so merged checkpoints can be folded

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.force_checkpoint_layers: int | None = None  # None: from the device's free memory

    @property
    def failed(self) -> str | None:
        """Why the compute stopped (a rank died or hung); None while it works. One process never fails alone."""
        return None

    def forward_backward(self, entry: BaseEntry, runs: Mapping[str, RunWeights], plan: list[PassPart]) -> list[Outcome]:
        return forward_backward_pass(entry, runs, plan, self.device, checkpoint_layers=self.checkpoint_layers(entry, plan))

    def checkpoint_layers(self, entry: BaseEntry, plan: list[PassPart]) -> int:
        """Decoder layers to recompute in backward: `force_checkpoint_layers` where set (a test on the CPU), else as
        many as the pass's padded tokens need to fit the device's free memory (memory_fit.py; none on a CPU)."""
        if self.force_checkpoint_layers is not None:
            return self.force_checkpoint_layers
        free = free_device_bytes(self.device)
        if free is None or all(part.forward_only for part in plan):
            return 0
        rows = sum(len(part.examples) for part in plan)
        width = max((d.length for part in plan for d in part.examples), default=0)
        layers = len(decoder_layers(entry.model))
        return layers_to_checkpoint(layers, rows * width, activation_bytes_per_token(entry.model), free)

    def optim(self, state: RunWeights, normaliser: float, settings: dict[str, float], kernel: str | None = None,
              slots: BaseSlots | None = None) -> float:
        """AdamW on the run's summed gradients over `normaliser`; returns the gradient norm. `kernel`: the one a
        replayed journal record names (None: the run's own)."""
        (grad_norm,) = self.optim_tick([Stepping(state, normaliser, settings, kernel, slots)])
        return grad_norm

    def optim_tick(self, steps: list[Stepping]) -> list[float]:
        """Every stepping run's AdamW in one optimizer tick (compute/optim_tick.py); their gradient norms, in order."""
        return optimizer_tick([self._order(s) for s in steps])

    def kernel_for(self, state: RunWeights, slots: BaseSlots | None) -> str:
        """The kernel the run's own optim_step steps with: what its journal record names."""
        return own_kernel(self._order(Stepping(state, 1.0, {}, None, slots)))

    @staticmethod
    def _order(s: Stepping) -> StepOrder:
        # the optimizer's own list: the run's parameters in the same order, without naming them anew each tick
        return StepOrder([p for group in s.state.optimizer.param_groups for p in group["params"]], s.state.optimizer,
                         s.normaliser, s.settings, s.kernel, s.slots, s.state.run_id)

    def drop_grads(self, state: RunWeights) -> None:
        state.optimizer.zero_grad(set_to_none=True)

    def restore_grads(self, progress: SplitCall) -> None:
        """A split call withdrawn between its parts: the gradients from before it put back."""
        progress.restore_grads()

    def seconds_since(self, started: float) -> float:
        """Seconds since `started` (time.perf_counter), with no device sync of its own: a pass and an optimizer tick
        end in their one device-to-host copy, which waits for the work queued before it; what an optimizer tick
        queues after its copy (the AdamW kernels) is counted by whatever waits next."""
        return time.perf_counter() - started

    def keepalive(self) -> None:
        pass

    def restart(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def describe(self) -> GroupReport:
        return {"world": 1}


class RankCompute(LocalCompute):
    """A multi-GPU pool: the base sharded with FSDP across the ranks, each run's LoRA and AdamW on every rank."""

    can_merge = False  # no rank holds whole base weights (docs/MULTIGPU.md: merge the adapter elsewhere)

    def __init__(self, device: torch.device, ranks: RankGroup) -> None:
        super().__init__(device)
        self.ranks = ranks
        self.world = ranks.world

    @property
    def failed(self) -> str | None:
        return self.ranks.failed

    def forward_backward(self, entry: BaseEntry, runs: Mapping[str, RunWeights], plan: list[PassPart]) -> list[Outcome]:
        return self.ranks.forward_backward(entry, runs, plan)

    def optim_tick(self, steps: list[Stepping]) -> list[float]:
        for s in steps:  # each follower steps each run alone: the same bits as a tick (optim_tick.py)
            self.ranks.send("optim", run_id=s.state.run_id, normaliser=s.normaliser, settings=s.settings, kernel=s.kernel)
        # the followers hold no slot buffers of this base: every rank steps through torch's kernels alike
        return super().optim_tick([Stepping(s.state, s.normaliser, s.settings, s.kernel) for s in steps])

    def kernel_for(self, state: RunWeights, slots: BaseSlots | None) -> str:
        return super().kernel_for(state, None)

    def drop_grads(self, state: RunWeights) -> None:
        self.ranks.send("drop_grads", run_id=state.run_id)
        super().drop_grads(state)

    def restore_grads(self, progress: SplitCall) -> None:
        if progress.done > 0:  # each follower put its own backup aside at the call's first part
            self.ranks.send("restore_grads", run_id=progress.run_id)
        super().restore_grads(progress)

    def keepalive(self) -> None:
        self.ranks.keepalive()

    def restart(self) -> None:
        self.ranks.restart()

    def stop(self) -> None:
        self.ranks.stop()

    def describe(self) -> GroupReport:
        return self.ranks.describe()
