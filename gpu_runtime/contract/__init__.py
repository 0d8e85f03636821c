"""The engine contract, torch-free: the calls as types, every default and bound, and the validators.

`app` and `gpu_runtime` both import it. One source for every default and bound: the server validates with
these before a call leaves it, and the runtime validates again with the same functions, so a client that
skips the server is held to the same rules. Errors are `BadInput` naming the field in the contract's own
(snake_case) names; the server renames them to GraphQL's camelCase.

- `settings`: AdamW, LoRA and sampling settings, ids, the runtime's own options.
- `calls`: the `Method` enum and one frozen request type per method (`parse_call` for what arrives).
- `results`: one frozen result type per call.
"""

from gpu_runtime.contract.calls import (
    CALLS,
    CONTRACT_VERSION,
    SYSTEM_CALLS,
    Call,
    CloseRun,
    CreateRun,
    DeleteRun,
    ExportCheckpoint,
    ForwardBackward,
    LoadRun,
    Method,
    OptimStep,
    Ping,
    RunCall,
    RunInfo,
    RuntimeState,
    Sample,
    SaveState,
    SaveWeightsForSampler,
    parse_call,
)
from gpu_runtime.contract.results import (
    ForwardBackwardResult,
    OptimStepResult,
    Result,
    RunDescription,
    SampleResult,
    SaveStateResult,
    SaveWeightsForSamplerResult,
)
from gpu_runtime.contract.settings import (
    ADAM_BOUNDS,
    ADAM_DEFAULTS,
    ATTENTION_PROJECTIONS,
    DEFAULT_LOSS_FN,
    ITEM_KEYS,
    LORA_DEFAULTS,
    LORA_KEYS,
    LORA_R_MAX,
    MAX_REQUEST_ID_LENGTH,
    MAX_SAMPLES,
    MAX_TOKENS_LIMIT,
    SAMPLE_DEFAULTS,
    SAVE_MODES,
    TEXT_KEYS,
    TOKEN_KEYS,
    RuntimeOptions,
    SamplingSettings,
    adam_settings,
    check_adam_value,
    check_batch_text,
    check_id,
    check_request_id,
    check_snapshot_name,
    check_text,
    default_target_modules,
    lora_settings,
    sampling_settings,
)

__all__ = [
    "ADAM_BOUNDS", "ADAM_DEFAULTS", "ATTENTION_PROJECTIONS", "CALLS", "CONTRACT_VERSION", "Call", "CloseRun",
    "CreateRun", "DEFAULT_LOSS_FN", "DeleteRun", "ExportCheckpoint", "ForwardBackward", "ForwardBackwardResult",
    "ITEM_KEYS", "LORA_DEFAULTS", "LORA_KEYS", "LORA_R_MAX", "LoadRun", "MAX_REQUEST_ID_LENGTH", "MAX_SAMPLES",
    "MAX_TOKENS_LIMIT", "Method", "OptimStep", "OptimStepResult", "Ping", "Result", "RunCall", "RunDescription",
    "RunInfo", "RuntimeOptions", "RuntimeState", "SAMPLE_DEFAULTS", "SAVE_MODES", "SYSTEM_CALLS", "Sample",
    "SampleResult", "SamplingSettings", "SaveState", "SaveStateResult",
    "SaveWeightsForSampler", "SaveWeightsForSamplerResult", "TEXT_KEYS", "TOKEN_KEYS", "adam_settings",
    "check_adam_value", "check_batch_text", "check_id", "check_request_id",
    "check_snapshot_name", "check_text", "default_target_modules", "lora_settings",
    "parse_call", "sampling_settings",
]
