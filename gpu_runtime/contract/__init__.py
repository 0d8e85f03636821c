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
    DeleteCheckpoint,
    DeleteRun,
    ExportCheckpoint,
    ForwardBackward,
    LoadRun,
    LoadState,
    Method,
    OptimStep,
    Ping,
    RunCall,
    RunInfo,
    RuntimeState,
    Sample,
    SaveState,
    Tokenizer,
    parse_call,
)
from gpu_runtime.contract.results import (
    ForwardBackwardResult,
    LoadStateResult,
    OptimStepResult,
    Result,
    RunDescription,
    SampleResult,
    SaveStateResult,
    TokenizerResult,
)
from gpu_runtime.contract.settings import (
    ADAM_BOUNDS,
    ADAM_DEFAULTS,
    ATTENTION_PROJECTIONS,
    CHECKPOINT_KINDS,
    CHECKPOINT_SCHEME,
    DEFAULT_LOSS_FN,
    ITEM_KEYS,
    LOADABLE_KINDS,
    LORA_DEFAULTS,
    LORA_KEYS,
    LORA_R_MAX,
    LORA_SWITCHES,
    MAX_REQUEST_ID_LENGTH,
    MAX_SAMPLES,
    MAX_TOKENS_LIMIT,
    MAX_TOPK_LOGPROBS,
    MLP_PROJECTIONS,
    SAMPLE_DEFAULTS,
    SAVE_MODES,
    TEXT_KEYS,
    TOKEN_KEYS,
    UNEMBEDDING,
    CheckpointRef,
    RuntimeOptions,
    SamplingSettings,
    adam_settings,
    check_adam_value,
    check_batch_text,
    check_checkpoint_name,
    check_id,
    check_request_id,
    check_text,
    checkpoint_ref,
    default_checkpoint_name,
    default_target_modules,
    lora_settings,
    sampling_prompts,
    sampling_settings,
    stop_settings,
    switched_target_modules,
    target_families,
)

__all__ = [
    "ADAM_BOUNDS", "ADAM_DEFAULTS", "ATTENTION_PROJECTIONS", "CALLS", "CONTRACT_VERSION", "Call", "CloseRun",
    "CreateRun", "DEFAULT_LOSS_FN", "DeleteRun", "ExportCheckpoint", "ForwardBackward", "ForwardBackwardResult",
    "ITEM_KEYS", "LORA_DEFAULTS", "LORA_KEYS", "LORA_R_MAX", "LORA_SWITCHES", "LoadRun", "MLP_PROJECTIONS",
    "MAX_REQUEST_ID_LENGTH", "MAX_SAMPLES", "MAX_TOKENS_LIMIT", "Method", "OptimStep", "OptimStepResult", "Ping",
    "Result", "RunCall", "RunDescription", "RunInfo", "RuntimeOptions", "RuntimeState", "SAMPLE_DEFAULTS",
    "SAVE_MODES", "SYSTEM_CALLS", "Sample", "SampleResult", "SamplingSettings", "SaveState", "SaveStateResult",
    "TEXT_KEYS", "TOKEN_KEYS", "UNEMBEDDING", "adam_settings", "check_adam_value", "check_batch_text", "check_id",
    "check_request_id", "check_text", "default_target_modules", "lora_settings", "parse_call", "sampling_settings",
    "CHECKPOINT_KINDS", "CHECKPOINT_SCHEME", "LOADABLE_KINDS", "CheckpointRef", "DeleteCheckpoint", "LoadState",
    "LoadStateResult", "check_checkpoint_name", "checkpoint_ref", "default_checkpoint_name",
    "switched_target_modules", "target_families", "MAX_TOPK_LOGPROBS", "Tokenizer", "TokenizerResult",
    "sampling_prompts", "stop_settings",
]
