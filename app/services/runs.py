"""Runs and the four training primitives: RunService, the facade GraphQL resolvers, the wires and the dashboard call.

Every primitive goes through one skeleton (`RunCalls.apply`, run_calls.py): ownership first (another user's run is
"not found", never data), its arguments checked, the ledger's credit check, then in the run's order (its ticket:
call_order.py) the runtime call, and the call recorded once: its call record, result and compute seconds in one
transaction (call_records.py), which a retry of an applied call completes if it never ran.

RunService is built of parts, one object each with one job, each holding the RunCalls it shares:
- run_calls.py: RunCalls, the dependencies and the skeleton every call goes through: ownership, checks, credits, the
  run's order, the runtime call, the record.
- run_lifecycle.py: RunLifecycle, creating and deleting runs, and the runtime's state.
- run_training.py: RunTraining, forward_backward, forward, render_datums, optim_step.
- run_sampling.py: RunSampling, samples (a run's weights, a snapshot, a base alone), cancelling, tokenizer work.
- run_checkpoints.py: RunCheckpoints, sampler snapshots, save_state, load_state, deleting and exporting checkpoints.
- run_reads.py: RunReads, the reads and labels: the runs list, metrics, samples, checkpoints, archive, label.
- run_specs.py: what callers hand it, as values (RunSpec, RunLabels, SampleParams, RUN_SORTS), re-exported here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from app.backends import Backend
from app.catalog import Catalog
from app.db import Database
from app.events import MetricFeed
from app.services.call_order import CallOrder
from app.services.ledger import Ledger
from app.services.run_calls import FAILED, RunCalls, pool_of
from app.services.run_checkpoints import RunCheckpoints
from app.services.run_lifecycle import RunLifecycle
from app.services.run_reads import MAX_METRICS_LIMIT, RunReads
from app.services.run_sampling import RunSampling, cancelled
from app.services.run_specs import (
    RUN_SORTS,
    SAMPLE_LIMITS,
    SEARCH_LENGTH,
    RunLabels,
    RunSpec,
    SampleParams,
    default_run_name,
    graphql_field,
)
from app.services.run_training import RunTraining, loss_metric, throughput
from app.services.sample_shares import SampleShares
from app.settings import RECORD_RETRY_S
from app.tables import Run
from gpu_runtime.contract import RuntimeOptions

# What callers import from here (app/, web/, tests/); each lives in the module of its job.
__all__ = ["FAILED", "MAX_METRICS_LIMIT", "RUN_SORTS", "SAMPLE_LIMITS", "SEARCH_LENGTH", "RunCalls", "RunLabels",
           "RunService", "RunSpec", "SampleParams", "cancelled", "default_run_name", "graphql_field", "loss_metric",
           "pool_of", "throughput"]


class RunService:
    """Runs and their calls: the parts above behind one object (app.services.Services.runs)."""

    def __init__(self, db: Database, backend: Backend, catalog: Catalog, feed: MetricFeed,
                 default_model: str, ledger: Ledger, bounds: RuntimeOptions | None = None,
                 record_retry_s: float = RECORD_RETRY_S, deadlines: dict[str, float] | None = None) -> None:
        self.calls = RunCalls(db, backend, catalog, feed, default_model, ledger, bounds, record_retry_s, deadlines)
        self.reads = RunReads(self.calls)
        self.sampling = RunSampling(self.calls)
        self.saves = RunCheckpoints(self.calls)
        self.training = RunTraining(self.calls)
        self.lifecycle = RunLifecycle(self.calls, self.saves)
        # The public methods, each its part's: what resolvers, wires and the dashboard call.
        self.get = self.calls.get
        self.create, self.delete, self.runtime_state = (self.lifecycle.create, self.lifecycle.delete,
                                                        self.lifecycle.runtime_state)
        self.forward_backward, self.forward = self.training.forward_backward, self.training.forward
        self.render_datums, self.optim_step = self.training.render_datums, self.training.optim_step
        self.sample, self.sample_unless_gone = self.sampling.sample, self.sampling.sample_unless_gone
        self.cancel_sample, self.base_device = self.sampling.cancel_sample, self.sampling.base_device
        self.tokenizer, self.chat_prompts = self.sampling.tokenizer, self.sampling.chat_prompts
        self.render_chat = self.sampling.render_chat
        self.tool_format = self.sampling.tool_format
        self.save_weights_for_sampler, self.save_state = self.saves.save_weights_for_sampler, self.saves.save_state
        self.load_state, self.delete_checkpoint = self.saves.load_state, self.saves.delete_checkpoint
        self.set_expiry, self.storage = self.saves.set_expiry, self.saves.storage
        self.set_public, self.published = self.saves.set_public, self.reads.published
        self.delete_expired, self.checkpoint_archive = self.saves.delete_expired, self.saves.checkpoint_archive
        self.list, self.count, self.archive, self.label = (self.reads.list, self.reads.count, self.reads.archive,
                                                           self.reads.label)
        self.metrics, self.samples, self.sample_marks = self.reads.metrics, self.reads.samples, self.reads.sample_marks
        self.base_samples, self.checkpoints = self.reads.base_samples, self.reads.checkpoints
        self.log_metrics = self.reads.log_metrics

    # What callers read of the shared parts: the run's order, the size bounds, the ledger.
    @property
    def order(self) -> CallOrder:
        return self.calls.order

    @property
    def bounds(self) -> RuntimeOptions:
        return self.calls.bounds

    @property
    def ledger(self) -> Ledger:
        return self.calls.ledger

    @property
    def claim(self) -> Callable[[Run, str], Awaitable[None]] | None:
        """Another client's check before each primitive (app/services/tinker_sessions.py); set at start-up."""
        return self.calls.claim

    @claim.setter
    def claim(self, check: Callable[[Run, str], Awaitable[None]] | None) -> None:
        self.calls.claim = check

    @property
    def shares(self) -> SampleShares:
        """Each user's sample calls in flight, from every wire (sample_shares.py)."""
        return self.calls.shares

    @shares.setter
    def shares(self, shares: SampleShares) -> None:
        self.calls.shares = shares
