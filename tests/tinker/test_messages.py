"""app/tinker/messages.py's TypedDicts against the `tinker` SDK's own pydantic types, which the server cannot import
(tinker's package imports torch): a key the SDK does not know, a required key left out, or a literal the SDK does
not accept fails here rather than in a user's client."""

from __future__ import annotations

import importlib
import typing
from typing import Any, Literal

import pytest

from app.tinker import messages

# Our TypedDict → the SDK type it stands for (module path, class name).
SDK_TYPES = {
    messages.UntypedAPIFuture: ("tinker.types.shared.untyped_api_future", "UntypedAPIFuture"),
    messages.TryAgainResponse: ("tinker.types.try_again_response", "TryAgainResponse"),
    messages.ClientConfigResponse: ("tinker.types.client_config_response", "ClientConfigResponse"),
    messages.CreateSessionResponse: ("tinker.types.create_session_response", "CreateSessionResponse"),
    messages.SessionHeartbeatResponse: ("tinker.types.session_heartbeat_response", "SessionHeartbeatResponse"),
    messages.TelemetryResponse: ("tinker.types.telemetry_response", "TelemetryResponse"),
    messages.HealthResponse: ("tinker.types.health_response", "HealthResponse"),
    messages.CreateModelResponse: ("tinker.types.create_model_response", "CreateModelResponse"),
    messages.LoadWeightsResponse: ("tinker.types.load_weights_response", "LoadWeightsResponse"),
    messages.ModelData: ("tinker.types.get_info_response", "ModelData"),
    messages.GetInfoResponse: ("tinker.types.get_info_response", "GetInfoResponse"),
    messages.OptimStepResponse: ("tinker.types.optim_step_response", "OptimStepResponse"),
    messages.SaveWeightsResponse: ("tinker.types.save_weights_response", "SaveWeightsResponse"),
    messages.SaveWeightsForSamplerResponseInternal: ("tinker.types.save_weights_for_sampler_response",
                                                     "SaveWeightsForSamplerResponseInternal"),
    messages.CreateSamplingSessionResponse: ("tinker.types.create_sampling_session_response",
                                             "CreateSamplingSessionResponse"),
    messages.GetSamplerResponse: ("tinker.types.get_sampler_response", "GetSamplerResponse"),
    messages.Checkpoint: ("tinker.types.checkpoint", "Checkpoint"),
    messages.Cursor: ("tinker.types.cursor", "Cursor"),
    messages.CheckpointsListResponse: ("tinker.types.checkpoints_list_response", "CheckpointsListResponse"),
    messages.TrainingRun: ("tinker.types.training_run", "TrainingRun"),
    messages.TrainingRunsResponse: ("tinker.types.training_runs_response", "TrainingRunsResponse"),
    messages.SupportedModel: ("tinker.types.get_server_capabilities_response", "SupportedModel"),
    messages.GetServerCapabilitiesResponse: ("tinker.types.get_server_capabilities_response",
                                             "GetServerCapabilitiesResponse"),
    messages.AdamOptimizerConfig: ("tinker.types.optimizer", "AdamOptimizerConfig"),
    messages.WeightsInfoResponse: ("tinker.types.weights_info_response", "WeightsInfoResponse"),
    messages.CurrentCheckpointStorageUsageItem: ("tinker.types.current_checkpoint_storage_usage_response",
                                                 "CurrentCheckpointStorageUsageItem"),
    messages.CurrentCheckpointStorageUsageResponse: ("tinker.types.current_checkpoint_storage_usage_response",
                                                     "CurrentCheckpointStorageUsageResponse"),
    messages.ExternalWeightsUrlsResponse: ("tinker.types.external_weights_urls_response", "ExternalWeightsUrlsResponse"),
}
# optim_step's answer carries `type`, which the SDK's future union reads though OptimStepResponse declares none.
UNDECLARED = {messages.OptimStepResponse: {"type"}}


def literals(annotation: Any) -> set[Any]:
    """The values a (possibly Optional) Literal annotation allows; empty for any other annotation."""
    if typing.get_origin(annotation) is Literal:
        return set(typing.get_args(annotation))
    return set().union(*(literals(arg) for arg in typing.get_args(annotation)))


def test_every_message_has_its_sdk_type() -> None:
    typed = {v for v in vars(messages).values() if isinstance(v, type) and typing.is_typeddict(v)}
    assert typed - set(SDK_TYPES) == {messages.Empty}


@pytest.mark.parametrize("message", list(SDK_TYPES), ids=lambda t: t.__name__)
def test_message_matches_the_sdk_type(message: Any) -> None:
    module, name = SDK_TYPES[message]
    sdk = getattr(importlib.import_module(module), name)
    fields = sdk.model_fields
    ours = typing.get_type_hints(message)
    assert set(ours) - set(fields) == UNDECLARED.get(message, set())
    assert {key for key, field in fields.items() if field.is_required()} <= message.__required_keys__
    for key, hint in ours.items():
        if literals(hint) and key in fields:
            assert literals(hint) <= literals(fields[key].annotation), key
