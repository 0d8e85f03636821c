"""Tinker's JSON messages as the server sends them, named and spelled as the `tinker` SDK's pydantic types
(tinker/types/*.py). They are TypedDicts, not those models: importing `tinker.types` imports torch, and `app` never
does. tests/tinker/test_messages.py checks each against its SDK type, so a key the SDK lacks fails CI.

Each keeps only the keys Signal sends; `type` is the discriminator the SDK reads off a future's result, sent where
the SDK's type names none.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

CheckpointType = Literal["training", "sampler"]  # the SDK's third, "external", is not Signal's


class Empty(TypedDict):
    """An answer the SDK reads nothing from (finish_session, a checkpoint's deletion)."""


class UntypedAPIFuture(TypedDict):
    request_id: str
    model_id: NotRequired[str]
    sample_sequence_ids: NotRequired[list[str]]


class TryAgainResponse(TypedDict):
    type: Literal["try_again"]
    request_id: str
    queue_state: Literal["active"]


class ClientConfigResponse(TypedDict):
    pjwt_auth_enabled: bool
    fwdbwd_max_chunk_len: int
    fwdbwd_max_chunk_bytes_count: int
    proto_compress_fwdbwd: bool
    sample_max_concurrent_requests: int
    custom_loss_server_side: bool


class CreateSessionResponse(TypedDict):
    session_id: str
    type: Literal["create_session"]


class SessionHeartbeatResponse(TypedDict):
    type: Literal["session_heartbeat"]


class TelemetryResponse(TypedDict):
    status: Literal["accepted"]


class HealthResponse(TypedDict):
    status: Literal["ok"]


class CreateModelResponse(TypedDict):
    model_id: str
    type: Literal["create_model"]


class LoadWeightsResponse(TypedDict):
    path: str
    type: Literal["load_weights"]
    model_id: NotRequired[str]  # create-via-load only: the new model


class ModelData(TypedDict):
    model_name: str
    tokenizer_id: str
    arch: str


class GetInfoResponse(TypedDict):
    model_id: str
    type: Literal["get_info"]
    model_name: str
    is_lora: bool
    lora_rank: int
    model_data: ModelData


class OptimStepResponse(TypedDict):
    type: Literal["optim_step"]
    metrics: dict[str, float]


class SaveWeightsResponse(TypedDict):
    path: str
    type: Literal["save_weights"]


class SaveWeightsForSamplerResponseInternal(TypedDict):
    """A named snapshot answers its path; an unnamed one the sampling session that samples it."""
    type: Literal["save_weights_for_sampler"]
    path: NotRequired[str]
    sampling_session_id: NotRequired[str]


class CreateSamplingSessionResponse(TypedDict):
    sampling_session_id: str
    type: Literal["create_sampling_session"]


class GetSamplerResponse(TypedDict):
    sampler_id: str
    base_model: str
    model_path: NotRequired[str]


# ---- the REST surface (RestClient, the tinker CLI) ---------------------------------------------------------

class Checkpoint(TypedDict):
    checkpoint_id: str  # {weights|sampler_weights}/{name}
    checkpoint_type: CheckpointType
    time: str  # ISO 8601
    tinker_path: str
    size_bytes: int
    public: bool
    expires_at: str | None  # ISO 8601: when ttl_seconds deletes it; None: kept until deleted


class CurrentCheckpointStorageUsageItem(TypedDict):
    project_id: str | None
    org_user_urn: str | None
    user_email: str | None
    user_name: str | None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float  # decimal GB, Tinker's billing unit
    estimated_monthly_cost_usd: float | None


class CurrentCheckpointStorageUsageResponse(TypedDict):
    effective_rate_usd_per_gigabyte_month: float | None
    data: list[CurrentCheckpointStorageUsageItem]


class ExternalWeightsUrlsResponse(TypedDict):
    urls: dict[str, str]  # a checkpoint file's path (relative to its root) → its signed download URL
    expires: str  # ISO 8601


class Cursor(TypedDict):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(TypedDict):
    checkpoints: list[Checkpoint]
    cursor: NotRequired[Cursor]  # paged: the user's checkpoints across models


class TrainingRun(TypedDict):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool
    lora_rank: int
    last_request_time: str  # ISO 8601
    last_checkpoint: NotRequired[Checkpoint]
    last_sampler_checkpoint: NotRequired[Checkpoint]


class TrainingRunsResponse(TypedDict):
    training_runs: list[TrainingRun]
    cursor: Cursor


class SupportedModel(TypedDict):
    model_name: str
    max_context_length: int | None
    trainable: bool
    sampleable: bool


class GetServerCapabilitiesResponse(TypedDict):
    supported_models: list[SupportedModel]


class AdamOptimizerConfig(TypedDict):
    type: Literal["adamw"]


class WeightsInfoResponse(TypedDict):
    base_model: str
    is_lora: bool
    lora_rank: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    optimizer_config: AdamOptimizerConfig
