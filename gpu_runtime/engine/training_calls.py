"""forward_backward and optim_step on resident runs: prepare, share a pass, count, journal, step.

A forward_backward is prepared once (its batch rendered to token rows) before the scheduler prices it,
may be split across ticks by the token budget, and is journaled when its last rows are done. Every
part of a tick's calls on one base runs in one pass (gpu_runtime/compute/training.py, through `Compute`).
optim_step divides each run's summed gradients by their normaliser ("mean"; by 1 for "sum") and applies AdamW.
forward runs the same datums through a pass with no autograd and no dropout on a weights source
(gpu_runtime/engine/weights_sources.py, as a sample's), changing nothing; render_datums shows what a batch renders to.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import time
from dataclasses import dataclass

import torch

from gpu_runtime.client.persistence import append_manifest, last_manifest_step, sha256_json
from gpu_runtime.compute.batches import Datum
from gpu_runtime.compute.custom_losses import check_inputs
from gpu_runtime.compute.hardware import Stepping
from gpu_runtime.compute.lora.ops import LEGACY
from gpu_runtime.compute.lora.slots import BaseSlots
from gpu_runtime.compute.plan import PartOutcome, PassPart
from gpu_runtime.compute.pool import BaseEntry
from gpu_runtime.compute.ranks import RanksFailed
from gpu_runtime.contract import (
    DEFAULT_REDUCTION,
    BatchItem,
    Forward,
    ForwardBackward,
    ForwardBackwardResult,
    ForwardResult,
    OptimStep,
    OptimStepResult,
    RenderDatums,
    RenderDatumsResult,
    batch_to_dicts,
    check_batch_size,
    loss_settings,
)
from gpu_runtime.contract.custom_loss import CustomLoss
from gpu_runtime.contract.json_types import JSONObject, as_object
from gpu_runtime.contract.training_calls import check_custom
from gpu_runtime.engine.journal_records import BatchRecord, FbRecord, LoadStateRecord, OptimRecord, Record
from gpu_runtime.engine.request import Request
from gpu_runtime.engine.run_state import LOADS_DIR, RunState
from gpu_runtime.engine.shared import Answered, Shared, TickStats, internal
from gpu_runtime.engine.weights_sources import WeightsSource
from gpu_runtime.errors import FailedPrecondition, SignalError


def per_datum(metrics: dict[str, float] | None, datums: int) -> dict[str, float] | None:
    """A custom loss's metrics over a call: `:sum` ones summed over its datums, `:mean` ones averaged."""
    return None if metrics is None else {k: v / datums if k.endswith(":mean") else v for k, v in metrics.items()}


@dataclass(eq=False)
class FbProgress:
    """A forward_backward call being computed, possibly across several ticks."""

    state: RunState
    examples: list[Datum]
    loss_fn: str
    loss_config: dict[str, float]
    batch_hash: str
    call: int  # which call since the last optim_step: seeds its dropout
    width: int  # the call's own padded width: its dropout masks are drawn at this shape
    reduction: str = DEFAULT_REDUCTION
    return_outputs: bool = False
    custom: CustomLoss | None = None  # loss_fn "custom": its checked graph
    body: str | None = None  # the call's Call.body_sha256, journaled and remembered beside its answer
    outputs: list[dict[str, list[float]]] | None = None  # per datum, gathered across the call's parts
    metrics: dict[str, float] | None = None  # a custom loss's, summed across the call's parts
    done: int = 0
    loss_sum: float = 0.0
    normaliser: float = 0.0
    compute_seconds: float = 0.0  # this call's share of its ticks' passes, by its rows' tokens
    backup: list[torch.Tensor | None] | None = None  # gradients before a split call, restored if a later part fails
    lora_kernel: str | None = None  # the segmented LoRA kernel its passes ran (journaled); a replay's: its record's
    join_rows: bool = False  # its datums shared model rows (journaled); a replay's: its record's

    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def remaining_tokens(self) -> int:
        return sum(e.cost for e in self.examples[self.done:])

    def restore_grads(self) -> None:
        """A later part of a split call failed: put back the gradients from before the call."""
        if self.backup is None or self.done == 0:
            return  # nothing of this call reached the gradients
        for param, grad in zip(self.state.parameters(), self.backup):
            param.grad = grad


@dataclass
class StepCall:
    """An optim_step begun in a tick, waiting for the tick's one optimizer tick."""

    state: RunState
    call: OptimStep
    body: str
    settings: dict[str, float]


@dataclass
class FbPart:
    request: Request | None  # None while replaying the journal
    progress: FbProgress
    examples: list[Datum]
    row_offset: int


class Training:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    # ---- forward_backward ----------------------------------------------------------------

    def prepare(self, state: RunState, call: ForwardBackward) -> FbProgress | ForwardBackwardResult:
        """The call's rows, ready to price and run; or, for a retry of a journaled call, its first answer."""
        body = call.body_sha256()
        answered = state.answer_to(call.request_id, body)
        if answered is not None:
            return ForwardBackwardResult.from_dict(answered).replay()
        config = loss_settings(call.loss_fn, call.loss_fn_config, call.reduction)
        if state.pending.calls and state.pending.reduction != call.reduction:
            raise FailedPrecondition(
                f"reduction {call.reduction!r} differs from the {state.pending.reduction!r} of the {state.pending.calls} "
                "forward_backward call(s) since the last optim_step: every call between two steps uses one reduction",
                field="reduction")
        custom = check_custom(call.loss_fn, call.custom_loss)
        examples = self.rendered(self.shared.entry(state), call.batch, call.loss_fn, custom)
        batch_hash = sha256_json({"loss_fn": call.loss_fn, "batch": batch_to_dicts(call.batch)})
        return FbProgress(state, examples, call.loss_fn, config, batch_hash, call=state.pending.calls,
                          width=max(e.length for e in examples), reduction=call.reduction,
                          return_outputs=call.return_outputs, custom=custom, body=body)

    def rendered(self, entry: BaseEntry, batch: list[BatchItem], loss_fn: str,
                 custom: CustomLoss | None = None) -> list[Datum]:
        """A batch's rows, bounded in items and (now that text is tokenized) in tokens by the runtime's options."""
        examples = entry.renderer.render_batch(batch, self.shared.options.max_batch_size, loss_fn)
        check_batch_size(len(examples), sum(e.cost for e in examples), self.shared.options)
        if custom is not None:
            check_inputs(custom, examples)
        return examples

    @staticmethod
    def take_rows(progress: FbProgress, allowance: int) -> list[Datum]:
        """The next rows of a call that fit in `allowance` tokens (at least one)."""
        taken: list[Datum] = []
        tokens = 0
        for example in progress.examples[progress.done:]:
            if taken and tokens + example.cost > allowance:
                break
            taken.append(example)
            tokens += example.cost
        if progress.done == 0 and len(taken) < len(progress.examples):
            # A split call: keep the gradients from before it, to put back if a later part fails.
            progress.backup = [None if p.grad is None else p.grad.clone() for p in progress.state.parameters()]
        return taken

    def run_pass(self, entry: BaseEntry, parts: list[FbPart], stats: TickStats) -> list[Answered]:
        """One forward and backward pass of the base for every part; journal the calls that completed.
        The pass's seconds are shared among its parts by their tokens (a call's compute_seconds)."""
        started = time.perf_counter()
        outcomes = self._pass(entry, parts)
        seconds = self.shared.compute.seconds_since(started)
        tokens = [sum(e.cost for e in part.examples) for part in parts]
        stats.fb_seconds += seconds
        stats.base_passes += 1
        stats.fb_rows += sum(len(p.examples) for p in parts)
        stats.fb_runs += len(parts)
        answers: list[Answered] = []
        for part, outcome, part_tokens in zip(parts, outcomes, tokens):
            assert part.request is not None
            if isinstance(outcome, SignalError):
                part.progress.restore_grads()
                answers.append((part.request, outcome))
                continue
            try:
                result = self._count(part, outcome, seconds * part_tokens / max(sum(tokens), 1))
            except Exception as exc:  # noqa: BLE001  # one call's completion fails it alone, not the pass's others
                if part.request is None:
                    raise  # replaying: the restore fails, as a broken journal would
                error = internal(exc, part.request)
                self.shared.discarded.setdefault(part.progress.state.run_id, error)
                answers.append((part.request, error))
                continue
            if result is not None:
                answers.append((part.request, result))
        return answers

    def run_live_pass(self, entry: BaseEntry, parts: list[FbPart], stats: TickStats) -> list[Answered]:
        """`run_pass` in a tick: if the pass fails as a whole, its calls fail (gradients put back), no others."""
        try:
            return self.run_pass(entry, parts, stats)
        except RanksFailed as exc:  # every rank stopped: these calls fail; the pool restarts after this tick
            return [(part.request, exc) for part in parts if part.request is not None]
        except Exception as exc:  # noqa: BLE001 - one failing pass must not take the runtime down
            answers: list[Answered] = []
            for part in parts:
                part.progress.restore_grads()
                if part.request is not None:
                    answers.append((part.request, internal(exc, part.request)))
            return answers

    def _pass(self, entry: BaseEntry, parts: list[FbPart]) -> list[PartOutcome | SignalError]:
        plan = []
        for part in parts:
            progress = part.progress
            plan.append(PassPart(
                progress.state.run_id, part.examples, part.row_offset, call_rows=len(progress.examples),
                call_width=progress.width, loss_fn=progress.loss_fn, loss_config=progress.loss_config,
                custom=progress.custom, dropout_seed=derive_seed(progress.state.config["seed"], progress.state.step, progress.call),
                backup=part.row_offset == 0 and len(part.examples) < len(progress.examples),
                return_outputs=progress.return_outputs and part.request is not None,  # none when replaying
                lora_kernel=None if part.request is not None else progress.lora_kernel or LEGACY,
                join_rows=None if part.request is not None else progress.join_rows))
        return self.shared.compute.forward_backward(entry, self.shared.residency.runs, plan)

    def _count(self, part: FbPart, outcome: PartOutcome, seconds: float = 0.0) -> ForwardBackwardResult | None:
        """Count a part (and its share of the pass's `seconds`); when the call is whole, journal it and return
        its result."""
        progress, state = part.progress, part.progress.state
        if "raise_in_count" in self.shared.faults and (part.request and part.request.request_id or "").startswith("raise"):
            raise RuntimeError("failpoint raise_in_count")  # what a bug in one call's completion does
        progress.compute_seconds += seconds
        progress.loss_sum += outcome.loss_sum
        progress.normaliser += outcome.normaliser
        if outcome.outputs is not None:
            progress.outputs = (progress.outputs or []) + outcome.outputs
        if outcome.metrics is not None:
            progress.metrics = {k: (progress.metrics or {}).get(k, 0.0) + v for k, v in outcome.metrics.items()}
        progress.done += len(part.examples)
        progress.lora_kernel = outcome.lora_kernel  # every pass of a live call runs today's kernel alike
        progress.join_rows = outcome.join_rows  # only a whole call joins: one pass decides
        if progress.done < len(progress.examples):
            return None
        num_tokens = sum(e.num_targets for e in progress.examples)
        state.pending.add(progress.normaliser, num_tokens,
                          BatchRecord(progress.batch_hash, len(progress.examples), num_tokens, progress.loss_fn), progress.reduction)
        if progress.reduction == "sum":
            loss = progress.loss_sum
        else:
            loss = progress.loss_sum / progress.normaliser if progress.normaliser else 0.0
        result = ForwardBackwardResult(
            loss=loss, num_tokens=num_tokens, num_examples=len(progress.examples), step=state.step,
            compute_seconds=progress.compute_seconds, reduction=progress.reduction, outputs=progress.outputs,
            metrics=per_datum(progress.metrics, len(progress.examples)))
        if part.request is None:  # replaying: the journal already holds it
            return result
        if "before_journal" in self.shared.faults:
            os.kill(os.getpid(), signal.SIGKILL)  # failpoint: computed, not journaled
        request_id = part.request.request_id
        kept = result.kept().to_dict()  # nothing per-position in the journal or the retry cache
        self.shared.journal(state, FbRecord(
            request_id=request_id, loss_fn=progress.loss_fn, loss_fn_config=progress.loss_config,
            reduction=progress.reduction, call=progress.call, step=state.step, batch_sha256=progress.batch_hash,
            body_sha256=progress.body, datums=progress.examples, result=kept, lora_kernel=progress.lora_kernel,
            join_rows=progress.join_rows,
            custom_loss=None if progress.custom is None else progress.custom.to_dict()))
        state.remember(request_id, kept, progress.body)
        self.shared.residency.touch(state)
        return result

    # ---- forward and render_datums: change nothing --------------------------------------

    def forward(self, call: Forward, source: WeightsSource) -> ForwardResult:
        """The batch's losses and logprobs on the call's weights source (gpu_runtime/engine/weights_sources.py: the engine
        resolves it, as a sample's), without autograd or dropout: no gradient, step or dropout counter of any run
        changes. Pure, so a retry (same request id) computes the same answer."""
        started = time.perf_counter()
        config = loss_settings(call.loss_fn, call.loss_fn_config)
        custom = check_custom(call.loss_fn, call.custom_loss)
        examples = self.rendered(source.entry, call.batch, call.loss_fn, custom)
        part = PassPart(source.routing_key, examples, 0, call_rows=len(examples),
                        call_width=max(e.length for e in examples), dropout_seed=None, loss_fn=call.loss_fn,
                        loss_config=config, custom=custom, return_outputs=True, forward_only=True)
        (outcome,) = self.shared.compute.forward_backward(source.entry, self.shared.residency.runs, [part])
        if isinstance(outcome, SignalError):
            raise outcome
        assert outcome.outputs is not None
        if source.state is not None:
            self.shared.residency.touch(source.state)
        return ForwardResult(
            loss=outcome.loss_sum / outcome.normaliser if outcome.normaliser else 0.0, loss_sum=outcome.loss_sum,
            num_tokens=sum(e.num_targets for e in examples), num_examples=len(examples),
            step=source.known_step, outputs=outcome.outputs,
            compute_seconds=self.shared.compute.seconds_since(started),
            metrics=per_datum(outcome.metrics, len(examples)))

    def render_datums(self, state: RunState, call: RenderDatums) -> RenderDatumsResult:
        examples = self.rendered(self.shared.entry(state), call.batch, call.loss_fn)
        return RenderDatumsResult(datums=[e.to_dict() for e in examples])

    # ---- optim_step ------------------------------------------------------------------------

    def optim_step(self, state: RunState, call: OptimStep) -> OptimStepResult:
        """One optim_step alone: an optimizer tick of one."""
        begun = self.begin_optim(state, call)
        if isinstance(begun, OptimStepResult):
            return begun
        (outcome,) = self.optim_tick([begun])
        if isinstance(outcome, SignalError):
            raise outcome
        return outcome

    def begin_optim(self, state: RunState, call: OptimStep) -> OptimStepResult | StepCall:
        """A retry's first answer (or its failure, raised), or the call ready for this tick's optimizer tick."""
        body = call.body_sha256()
        answered = state.answer_to(call.request_id, body)
        if answered is not None:
            if "error" in answered:  # it failed (and dropped the gradients) the first time: the retry fails alike
                raise SignalError.from_dict(as_object(answered["error"], "error"))
            return OptimStepResult.from_dict(answered).replay()
        if state.pending.calls == 0:
            raise FailedPrecondition("no gradients to apply: call forward_backward before optim_step")
        return StepCall(state, call, body, call.settings())

    def optim_tick(self, steps: list[StepCall]) -> list[OptimStepResult | SignalError]:
        """Every run's optim_step of this tick in one optimizer tick (gpu_runtime/compute/optim_tick.py); then each
        is counted, journaled and remembered on its own. The tick's seconds are shared among them evenly."""
        started = time.perf_counter()
        stepping = [Stepping(s.state, s.state.pending.divisor, s.settings, slots=self._slots(s.state)) for s in steps]
        norms = self.shared.compute.optim_tick(stepping)
        seconds = self.shared.compute.seconds_since(started) / max(len(steps), 1)
        return [self._stepped(step, norm, seconds, s.slots) for step, norm, s in zip(steps, norms, stepping)]

    def _stepped(self, step: StepCall, grad_norm: float, seconds: float,
                 slots: BaseSlots | None) -> OptimStepResult | SignalError:
        state, pending, settings = step.state, step.state.pending, step.settings
        record: JSONObject
        try:
            result = self._count_step(state, settings, grad_norm)
            result = OptimStepResult(step=result.step, grad_norm=result.grad_norm, learning_rate=result.learning_rate,
                                     compute_seconds=seconds)
            record = result.to_dict()
        except FailedPrecondition as exc:
            record = {"error": exc.to_dict()}  # journaled too: dropping the gradients is a change replay must repeat
        self.shared.journal(state, OptimRecord(request_id=step.call.request_id, adam=settings,
                                               kernel=self.shared.compute.kernel_for(state, slots),
                                               body_sha256=step.body, result=record))
        state.remember(step.call.request_id, record, step.body)
        self.shared.residency.touch(state)
        if "error" in record:
            return SignalError.from_dict(as_object(record["error"], "error"))
        append_manifest(state.paths.manifest, {"step": state.step, "adam": settings, "grad_norm": result.grad_norm,
                                               "num_tokens": pending.tokens, "batches": [b.to_dict() for b in pending.batches]})
        return result

    def _apply(self, state: RunState, settings: dict[str, float], kernel: str | None = None) -> OptimStepResult:
        """AdamW on the run's summed gradients divided by their normaliser (on every rank, alike); clears them."""
        if state.pending.calls == 0:
            raise FailedPrecondition("no gradients to apply: call forward_backward before optim_step")
        grad_norm = self.shared.compute.optim(state, state.pending.divisor, settings, kernel, self._slots(state))
        return self._count_step(state, settings, grad_norm)

    def _slots(self, state: RunState) -> BaseSlots | None:
        """The slot buffers of the run's base, where its LoRA (and so its AdamW) may live."""
        entry = self.shared.residency.bases.get(state.base_key)
        return None if entry is None else entry.routing.slots

    @staticmethod
    def _count_step(state: RunState, settings: dict[str, float], grad_norm: float) -> OptimStepResult:
        """The step is applied (or skipped for a non-finite norm): the pending gradients are gone either way."""
        state.clear_pending()
        if not math.isfinite(grad_norm):
            raise FailedPrecondition(f"gradient norm is {grad_norm}; the step was skipped and the gradients dropped")
        state.step += 1
        state.weights_changed()
        return OptimStepResult(step=state.step, grad_norm=grad_norm, learning_rate=settings["learning_rate"])

    # ---- replay (restore = snapshot + these) -----------------------------------------------

    def replay(self, state: RunState, record: Record) -> None:
        """Apply one journal record again, as it was applied live (journal_records.py read it, whatever its format)."""
        request_id = record.request_id
        if request_id and request_id in state.answered:
            return  # a duplicate cannot be applied twice
        if isinstance(record, FbRecord):
            self._replay_fb(state, record)
        elif isinstance(record, LoadStateRecord):
            # Only a crash between the load's journal record and its snapshot gets here: the run's own copy of the
            # checkpoint's files (never the checkpoint, which may be gone) is still there until a snapshot covers it.
            staged = state.paths.root / LOADS_DIR / record.staged
            state.load_checkpoint_files(staged, record.with_optimizer, record.step, self.shared.device)
        elif record.error is not None:
            # It failed live and dropped the gradients: the journal's outcome holds, whatever a recompute says.
            self.shared.compute.drop_grads(state)
            state.clear_pending()
        else:
            pending = state.pending
            try:
                self._apply(state, record.adam, record.kernel)
            except FailedPrecondition:
                pass  # it failed the first time too, and dropped the gradients as it does now
            else:
                if last_manifest_step(state.paths.manifest) < state.step:  # the crash came before its manifest line
                    append_manifest(state.paths.manifest, {
                        "step": state.step, "adam": record.adam, "grad_norm": record.result["grad_norm"],
                        "num_tokens": pending.tokens, "batches": [b.to_dict() for b in pending.batches]})
        state.remember(request_id, record.result, record.body_sha256)

    def _replay_fb(self, state: RunState, record: FbRecord) -> None:
        examples = record.datums
        config = loss_settings(record.loss_fn, record.loss_fn_config or None, record.reduction)
        progress = FbProgress(state, examples, record.loss_fn, config, record.batch_sha256,
                              call=record.call, width=max(e.length for e in examples), reduction=record.reduction,
                              custom=check_custom(record.loss_fn, record.custom_loss),
                              lora_kernel=record.lora_kernel, join_rows=record.join_rows)
        entry = self.shared.entry(state)
        while progress.done < len(examples):  # split as the budget splits live calls
            part = FbPart(None, progress, self.take_rows(progress, self.shared.options.tick_tokens), progress.done)
            (outcome,) = self._pass(entry, [part])
            assert not isinstance(outcome, SignalError), "a journaled call cannot fail on replay"
            self._count(part, outcome)


def derive_seed(*parts: int) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
