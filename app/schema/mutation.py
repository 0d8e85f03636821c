"""Mutations: the four primitives and run/key management, each one call into the services."""

from __future__ import annotations

from typing import Annotated, Any, cast

import strawberry
from strawberry.scalars import JSON

from app.errors import BadInput
from app.schema.account import ApiKey, CreatedApiKey
from app.schema.context import Info, selects
from app.schema.enums import DEFAULT_LOSS, DEFAULT_REDUCTION_ENUM, LossFn, Reduction
from app.schema.inputs import AdamInput, BatchItem, CreateRunInput, MessageInput, batch_items
from app.schema.results import (
    ForwardBackwardResult,
    ForwardResult,
    LoadStateResult,
    OptimStepResult,
    SampleResult,
    SamplerSnapshot,
    datum_outputs,
)
from app.schema.runs import Checkpoint, Run, SaveMode
from app.services.call_order import Numbered
from app.services.runs import RunLabels, SampleParams
from gpu_runtime.contract import SAMPLE_DEFAULTS

# An idempotency key: a retry that carries the id of a call already applied gets that call's answer again.
RequestId = Annotated[str | None, strawberry.argument(
    description="Idempotency key (the SDK sends a UUID): a retry with the same id is not applied twice")]
# The SDK's numbering of a run's calls (docs/ORDERING.md): given both, the call applies after its session's seq - 1.
Seq = Annotated[int | None, strawberry.argument(
    description="This call's number in its session's order on the run (1, 2, ...): it applies after seq - 1")]
Session = Annotated[str | None, strawberry.argument(
    description="The client session that numbers its calls with seq (the SDK sends one id per client)")]


CheckpointArgument = Annotated[str | None, strawberry.argument(
    description="A training checkpoint to read the weights of, off the run's queue: its name on runId, or its path "
                "signal://<run_id>/<kind>/<name> (kind state, adapter or sampler; runId may then be left out) "
                "(docs/CHECKPOINTS.md)")]


@strawberry.type
class Mutation:
    @strawberry.mutation
    async def create_run(self, info: Info, input: CreateRunInput | None = None) -> Run:
        user = await info.context.user()
        return Run.from_row(await info.context.services.runs.create(user, (input or CreateRunInput()).to_spec()))

    @strawberry.mutation(description="Compute the loss and accumulate gradients for a batch")
    async def forward_backward(
        self, info: Info, run_id: strawberry.ID, batch: list[BatchItem], loss_fn: LossFn = DEFAULT_LOSS,
        loss_fn_config: JSON | None = None, request_id: RequestId = None,
        reduction: Annotated[Reduction, strawberry.argument(
            description="MEAN (normalised over every call before optimStep) or SUM (raw, as Tinker); one per "
                        "step")] = DEFAULT_REDUCTION_ENUM,
        seq: Seq = None, session: Session = None,
    ) -> ForwardBackwardResult:
        user = await info.context.user()
        # JSON is NewType("JSON", object); the runtime checks the value is an object (contract.loss_settings).
        config = cast("dict[str, Any] | None", loss_fn_config)
        result = await info.context.services.runs.forward_backward(
            user, str(run_id), batch_items(batch), loss_fn=loss_fn.value, loss_fn_config=config,
            request_id=request_id, reduction=reduction.value, return_outputs=selects(info, "outputs"),
            order=Numbered.of(seq, session),
        )
        return ForwardBackwardResult(loss=result.loss, num_tokens=result.num_tokens,
                                     num_examples=result.num_examples, step=result.step,
                                     reduction=result.reduction, outputs=datum_outputs(result.outputs))

    @strawberry.mutation(description="The loss and per-position logprobs of a batch, with no backward: nothing "
                         "changes. On a run's current weights (runId), a snapshot of it (runId + snapshot), or a base "
                         "model alone (baseModel)")
    async def forward(
        self, info: Info, batch: list[BatchItem], run_id: strawberry.ID | None = None, base_model: str | None = None,
        loss_fn: LossFn = DEFAULT_LOSS, loss_fn_config: JSON | None = None, request_id: RequestId = None,
        seq: Seq = None, session: Session = None,
        snapshot: Annotated[str | None, strawberry.argument(
            description="A sampler snapshot of the run (saveWeightsForSampler), by name")] = None,
        checkpoint: CheckpointArgument = None,
    ) -> ForwardResult:
        user = await info.context.user()
        config = cast("dict[str, Any] | None", loss_fn_config)
        result = await info.context.services.runs.forward(
            user, batch_items(batch), run_id=str(run_id) if run_id is not None else None,
            base_model=base_model, loss_fn=loss_fn.value, loss_fn_config=config, request_id=request_id,
            order=Numbered.of(seq, session), snapshot=snapshot, checkpoint=checkpoint)
        return ForwardResult(loss=result.loss, loss_sum=result.loss_sum, num_tokens=result.num_tokens,
                             num_examples=result.num_examples, step=result.step,
                             outputs=datum_outputs(result.outputs) or [])

    @strawberry.mutation(description="Apply the accumulated gradients with AdamW")
    async def optim_step(self, info: Info, run_id: strawberry.ID, adam: AdamInput | None = None,
                         request_id: RequestId = None, seq: Seq = None, session: Session = None) -> OptimStepResult:
        user = await info.context.user()
        result = await info.context.services.runs.optim_step(user, str(run_id), adam.to_dict() if adam else None,
                                                             request_id=request_id, order=Numbered.of(seq, session))
        return OptimStepResult(step=result.step, grad_norm=result.grad_norm, learning_rate=result.learning_rate)

    @strawberry.mutation(description="Generate from a run's current weights (in its order), a snapshot of it "
                         "(snapshot), or a base model alone (baseModel, no runId) (docs/SAMPLING.md, docs/SNAPSHOTS.md)")
    async def sample(
        self, info: Info, run_id: strawberry.ID | None = None,
        prompts: Annotated[list[str] | None, strawberry.argument(
            description="Text prompts; or give promptTokens")] = None,
        prompt_tokens: Annotated[list[list[int]] | None, strawberry.argument(
            description="Token-id prompts, as the model sees them (no BOS added)")] = None,
        messages: Annotated[list[list[MessageInput]] | None, strawberry.argument(
            description="Chat prompts, one conversation each, rendered with the base's chat template and the "
                        "assistant's turn opened, as /v1 does; instead of prompts and promptTokens")] = None,
        snapshot: Annotated[str | None, strawberry.argument(
            description="A sampler snapshot of the run (saveWeightsForSampler), by name")] = None,
        checkpoint: CheckpointArgument = None,
        base_model: Annotated[str | None, strawberry.argument(
            description="With no runId: sample this base model alone, billed to you")] = None,
        max_tokens: int = SAMPLE_DEFAULTS["max_tokens"],
        temperature: float = SAMPLE_DEFAULTS["temperature"], top_p: float = SAMPLE_DEFAULTS["top_p"],
        top_k: Annotated[int, strawberry.argument(description="0 or -1: off")] = SAMPLE_DEFAULTS["top_k"],
        stop: Annotated[list[str] | None, strawberry.argument(
            description="Stop strings. Omitted (and no stopTokens): EOS stops; []: nothing but maxTokens stops; "
            "a non-empty list stops there and at EOS")] = None,
        stop_tokens: Annotated[list[int] | None, strawberry.argument(
            description="Stop token ids, instead of stop (not both); [] turns EOS off like stop: []")] = None,
        num_samples: int = SAMPLE_DEFAULTS["num_samples"],
        seed: int | None = None,
        prompt_logprobs: Annotated[bool, strawberry.argument(
            description="Return each prompt token's logprob")] = SAMPLE_DEFAULTS["prompt_logprobs"],
        topk_prompt_logprobs: Annotated[int, strawberry.argument(
            description="Return the k most likely tokens at each prompt position")]
        = SAMPLE_DEFAULTS["topk_prompt_logprobs"],
        topk_sample_logprobs: Annotated[int, strawberry.argument(
            description="Return the k most likely tokens at each sampled position")]
        = SAMPLE_DEFAULTS["topk_sample_logprobs"],
        store: Annotated[bool | None, strawberry.argument(
            description="Keep the samples in the run's history (a base's: the caller's baseSamples); default true "
                        "for current weights, false for a snapshot or a base")] = None,
        request_id: RequestId = None, seq: Seq = None, session: Session = None,
    ) -> SampleResult:
        user = await info.context.user()
        if messages is not None:
            if prompts is not None or prompt_tokens is not None:
                raise BadInput("give messages, prompts or promptTokens, one of them", field="messages")
            prompt_tokens = await info.context.services.runs.chat_prompts(
                user, None if run_id is None else str(run_id),
                [[{"role": m.role, "content": m.content} for m in conversation] for conversation in messages],
                base_model=base_model)
        params = SampleParams(prompts=prompts, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                              temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, stop_tokens=stop_tokens,
                              num_samples=num_samples, seed=seed, prompt_logprobs=prompt_logprobs,
                              topk_prompt_logprobs=topk_prompt_logprobs, topk_sample_logprobs=topk_sample_logprobs,
                              store=store)
        result = await info.context.services.runs.sample_unless_gone(  # its client gone: withdrawn, unbilled
            user, None if run_id is None else str(run_id), params, info.context.gone(), request_id=request_id,
            snapshot=snapshot, checkpoint=checkpoint, base_model=base_model, order=Numbered.of(seq, session))
        return SampleResult.from_result(result)

    @strawberry.mutation(description="Freeze the run's current weights as a snapshot to sample from while it trains "
                         "on; named ones are kept (docs/SNAPSHOTS.md)")
    async def save_weights_for_sampler(self, info: Info, run_id: strawberry.ID, name: str | None = None,
                                       request_id: RequestId = None, seq: Seq = None,
                                       session: Session = None) -> SamplerSnapshot:
        user = await info.context.user()
        result = await info.context.services.runs.save_weights_for_sampler(user, str(run_id), name,
                                                                           request_id=request_id,
                                                                           order=Numbered.of(seq, session))
        return SamplerSnapshot.from_result(result)

    @strawberry.mutation(description="Export the adapter, a merged model, or the full training state")
    async def save_state(
        self, info: Info, run_id: strawberry.ID, mode: SaveMode = SaveMode.ADAPTER, push_to_hub: bool = False,
        hub_model_id: str | None = None, request_id: RequestId = None,
        hf_token: Annotated[str | None, strawberry.argument(
            description="Hugging Face token for pushToHub; used for this upload only, never stored")] = None,
        name: Annotated[str | None, strawberry.argument(
            description="Unique per run and mode (a name saved twice is refused); default: step-N")] = None,
        with_optimizer: Annotated[bool | None, strawberry.argument(
            description="Keep AdamW's state, to resume exactly; default: true for STATE, false otherwise")] = None,
        seq: Seq = None, session: Session = None,
    ) -> Checkpoint:
        user = await info.context.user()
        checkpoint = await info.context.services.runs.save_state(
            user, str(run_id), mode.value, push_to_hub, hub_model_id, request_id=request_id, hf_token=hf_token,
            name=name, with_optimizer=with_optimizer, order=Numbered.of(seq, session),
        )
        return Checkpoint.from_row(checkpoint)

    @strawberry.mutation(description="Load a checkpoint (this run's or another of yours) into the run: its weights, "
                         "with withOptimizer its AdamW state, and its step; pending gradients are dropped")
    async def load_state(
        self, info: Info, run_id: strawberry.ID,
        checkpoint: Annotated[str, strawberry.argument(
            description="signal://<runId>/<mode>/<name> (a Checkpoint's path), or a name: this run's STATE one")],
        with_optimizer: bool = True, request_id: RequestId = None, seq: Seq = None, session: Session = None,
    ) -> LoadStateResult:
        user = await info.context.user()
        result = await info.context.services.runs.load_state(user, str(run_id), checkpoint, with_optimizer,
                                                             request_id=request_id, order=Numbered.of(seq, session))
        return LoadStateResult(checkpoint=result.checkpoint, step=result.step, with_optimizer=result.with_optimizer,
                               pending_dropped=result.pending_dropped)

    @strawberry.mutation(description="Delete a checkpoint or sampler snapshot: its files and its row")
    async def delete_checkpoint(self, info: Info, run_id: strawberry.ID, checkpoint_id: strawberry.ID) -> bool:
        user = await info.context.user()
        await info.context.services.runs.delete_checkpoint(user, str(run_id), str(checkpoint_id))
        return True

    @strawberry.mutation(description="Record your own metrics for a step (a DPO loss, a reward): `metrics` is an "
                         "object of name: number, stored with the run's metrics as `user:<name>` and drawn on its "
                         "page; `step` defaults to the run's current step. Answers the step.")
    async def log_metrics(self, info: Info, run_id: strawberry.ID, metrics: JSON, step: int | None = None) -> int:
        user = await info.context.user()
        return await info.context.services.runs.log_metrics(user, str(run_id), metrics, step)

    @strawberry.mutation(description="Rename a run, set its tags (all of them) or its note; an argument left out "
                         "keeps its value")
    async def update_run(self, info: Info, run_id: strawberry.ID, name: str | None = None,
                         tags: list[str] | None = None, note: str | None = None) -> Run:
        user = await info.context.user()
        labels = RunLabels(name=name, tags=tags, note=note)
        return Run.from_row(await info.context.services.runs.label(user, str(run_id), labels))

    @strawberry.mutation(description="Archive a run: hidden from runs' default list, its training and sampling "
                         "refused until unarchived; its files, checkpoints and history are kept")
    async def archive_run(self, info: Info, run_id: strawberry.ID) -> Run:
        user = await info.context.user()
        return Run.from_row(await info.context.services.runs.archive(user, str(run_id)))

    @strawberry.mutation
    async def unarchive_run(self, info: Info, run_id: strawberry.ID) -> Run:
        user = await info.context.user()
        return Run.from_row(await info.context.services.runs.archive(user, str(run_id), archived=False))

    @strawberry.mutation
    async def delete_run(self, info: Info, run_id: strawberry.ID) -> bool:
        user = await info.context.user()
        await info.context.services.runs.delete(user, str(run_id))
        return True

    @strawberry.mutation(description="Create an API key; its secret is returned this once")
    async def create_api_key(self, info: Info, name: str = "") -> CreatedApiKey:
        user = await info.context.user()
        secret, key = await info.context.services.keys.create(user, name)
        return CreatedApiKey(secret=secret, api_key=ApiKey.from_row(key))

    @strawberry.mutation
    async def revoke_api_key(self, info: Info, id: strawberry.ID) -> ApiKey:
        user = await info.context.user()
        return ApiKey.from_row(await info.context.services.keys.revoke(user, str(id)))
