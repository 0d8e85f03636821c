"""Mutations: the four primitives and run/key management, each one call into the services."""

from __future__ import annotations

from typing import Annotated, Any, cast

import strawberry
from strawberry.scalars import JSON

from app.schema.context import Info
from app.schema.inputs import AdamInput, BatchItem, CreateRunInput
from app.schema.types import (
    ApiKey,
    Checkpoint,
    CreatedApiKey,
    ForwardBackwardResult,
    OptimStepResult,
    Run,
    SampleResult,
    SamplerSnapshot,
    SaveMode,
)
from app.services.runs import SampleParams
from gpu_runtime.contract import DEFAULT_LOSS_FN, SAMPLE_DEFAULTS

# An idempotency key: a retry that carries the id of a call already applied gets that call's answer again.
RequestId = Annotated[str | None, strawberry.argument(
    description="Idempotency key (the SDK sends a UUID): a retry with the same id is not applied twice")]


@strawberry.type
class Mutation:
    @strawberry.mutation
    async def create_run(self, info: Info, input: CreateRunInput | None = None) -> Run:
        user = await info.context.user()
        return Run.from_row(await info.context.services.runs.create(user, (input or CreateRunInput()).to_spec()))

    @strawberry.mutation(description="Compute the loss and accumulate gradients for a batch")
    async def forward_backward(
        self, info: Info, run_id: strawberry.ID, batch: list[BatchItem], loss_fn: str = DEFAULT_LOSS_FN,
        loss_fn_config: JSON | None = None, request_id: RequestId = None,
    ) -> ForwardBackwardResult:
        user = await info.context.user()
        # JSON is NewType("JSON", object); the runtime checks the value is an object (gpu_runtime.losses.get_loss).
        config = cast("dict[str, Any] | None", loss_fn_config)
        result = await info.context.services.runs.forward_backward(
            user, str(run_id), [item.to_dict() for item in batch], loss_fn=loss_fn, loss_fn_config=config,
            request_id=request_id,
        )
        return ForwardBackwardResult(loss=result["loss"], num_tokens=result["num_tokens"],
                                     num_examples=result["num_examples"], step=result["step"])

    @strawberry.mutation(description="Apply the accumulated gradients with AdamW")
    async def optim_step(self, info: Info, run_id: strawberry.ID, adam: AdamInput | None = None,
                         request_id: RequestId = None) -> OptimStepResult:
        user = await info.context.user()
        result = await info.context.services.runs.optim_step(user, str(run_id), adam.to_dict() if adam else None,
                                                             request_id=request_id)
        return OptimStepResult(step=result["step"], grad_norm=result["grad_norm"],
                               learning_rate=result["learning_rate"])

    @strawberry.mutation(description="Generate from a run's current weights (in its order), a snapshot of it "
                         "(snapshot), or a base model alone (baseModel, no runId)")
    async def sample(
        self, info: Info, prompts: list[str], run_id: strawberry.ID | None = None, snapshot: str | None = None,
        checkpoint: str | None = None, base_model: str | None = None, max_tokens: int = SAMPLE_DEFAULTS["max_tokens"],
        temperature: float = SAMPLE_DEFAULTS["temperature"], top_p: float = SAMPLE_DEFAULTS["top_p"],
        top_k: int = SAMPLE_DEFAULTS["top_k"], stop: list[str] | None = None,
        num_samples: int = SAMPLE_DEFAULTS["num_samples"],
        seed: int | None = None, request_id: RequestId = None,
        store: Annotated[bool | None, strawberry.argument(
            description="Keep the samples in the run's history; default true for current weights, false for a "
                        "snapshot or a base")] = None,
    ) -> SampleResult:
        user = await info.context.user()
        params = SampleParams(prompts=prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                              top_k=top_k, stop=stop, num_samples=num_samples, seed=seed)
        result = await info.context.services.runs.sample(
            user, None if run_id is None else str(run_id), params, request_id=request_id, snapshot=snapshot,
            checkpoint=checkpoint, base_model=base_model, store=store)
        return SampleResult.from_result(result)

    @strawberry.mutation(description="Freeze the run's current weights as a snapshot to sample from while it trains "
                         "on; named ones are kept (docs/SNAPSHOTS.md)")
    async def save_weights_for_sampler(self, info: Info, run_id: strawberry.ID, name: str | None = None,
                                       request_id: RequestId = None) -> SamplerSnapshot:
        user = await info.context.user()
        result = await info.context.services.runs.save_weights_for_sampler(user, str(run_id), name,
                                                                           request_id=request_id)
        return SamplerSnapshot.from_result(result)

    @strawberry.mutation(description="Export the adapter, a merged model, or the full training state")
    async def save_state(
        self, info: Info, run_id: strawberry.ID, mode: SaveMode = SaveMode.ADAPTER, push_to_hub: bool = False,
        hub_model_id: str | None = None, request_id: RequestId = None,
        hf_token: Annotated[str | None, strawberry.argument(
            description="Hugging Face token for pushToHub; used for this upload only, never stored")] = None,
    ) -> Checkpoint:
        user = await info.context.user()
        checkpoint = await info.context.services.runs.save_state(
            user, str(run_id), mode.value, push_to_hub, hub_model_id, request_id=request_id, hf_token=hf_token
        )
        return Checkpoint.from_row(checkpoint)

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
