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
    Forward,
    ForwardBackward,
    LoadRun,
    Method,
    OptimStep,
    Ping,
    RenderDatums,
    RunCall,
    RunInfo,
    RuntimeState,
    Sample,
    SaveState,
    parse_call,
)
from gpu_runtime.contract.results import (
    ForwardBackwardResult,
    ForwardResult,
    OptimStepResult,
    RenderDatumsResult,
    Result,
    RunDescription,
    SampleResult,
    SaveStateResult,
)
from gpu_runtime.contract.settings import (
    ADAM_BOUNDS,
    ADAM_DEFAULTS,
    ATTENTION_PROJECTIONS,
    DATUM_INPUTS,
    DATUM_KEYS,
    DEFAULT_LOSS_FN,
    DEFAULT_REDUCTION,
    ITEM_KEYS,
    LORA_DEFAULTS,
    LORA_KEYS,
    LORA_R_MAX,
    LOSS_CONFIG_DEFAULTS,
    MAX_REQUEST_ID_LENGTH,
    MAX_SAMPLES,
    MAX_TOKENS_LIMIT,
    PACKED_KEY,
    PACKED_TOKENS,
    REDUCTIONS,
    RL_LOSSES,
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
    check_text,
    default_target_modules,
    lora_settings,
    loss_settings,
    sampling_settings,
)

__all__ = [
    "ADAM_BOUNDS", "ADAM_DEFAULTS", "ATTENTION_PROJECTIONS", "CALLS", "CONTRACT_VERSION", "Call", "CloseRun",
    "CreateRun", "DATUM_INPUTS", "DATUM_KEYS", "DEFAULT_LOSS_FN", "DEFAULT_REDUCTION", "DeleteRun", "ExportCheckpoint",
    "Forward", "ForwardBackward", "ForwardBackwardResult", "ForwardResult", "LOSS_CONFIG_DEFAULTS", "REDUCTIONS",
    "PACKED_KEY", "PACKED_TOKENS", "RL_LOSSES", "RenderDatums", "RenderDatumsResult", "loss_settings",
    "ITEM_KEYS", "LORA_DEFAULTS", "LORA_KEYS", "LORA_R_MAX", "LoadRun", "MAX_REQUEST_ID_LENGTH", "MAX_SAMPLES",
    "MAX_TOKENS_LIMIT", "Method", "OptimStep", "OptimStepResult", "Ping", "Result", "RunCall", "RunDescription",
    "RunInfo", "RuntimeOptions", "RuntimeState", "SAMPLE_DEFAULTS", "SAVE_MODES", "SYSTEM_CALLS", "Sample",
    "SampleResult", "SamplingSettings", "SaveState", "SaveStateResult", "TEXT_KEYS", "TOKEN_KEYS", "adam_settings",
    "check_adam_value", "check_batch_text", "check_id", "check_request_id", "check_text", "default_target_modules", "lora_settings",
    "parse_call", "sampling_settings",
]
