"""The engine contract, torch-free: the calls as types, every default and bound, and the validators.

`app` and `gpu_runtime` both import it. One source for every default and bound: the server validates with
these before a call leaves it, and the runtime validates again with the same functions, so a client that
skips the server is held to the same rules. Errors are `BadInput` naming the field in the contract's own
(snake_case) names; the server renames them to GraphQL's camelCase.

- `calls`: the `Method` enum, the `Call` base, each call's `Kind` (its lane, whether it writes, needs its run
  resident, is a user's primitive) and CONTRACT_VERSION; the requests by family in `training_calls`,
  `sampling_calls` and `control_calls`; `registry` maps a method name to its type (`parse_call` for what arrives).
- `results`: one frozen result type per call.
- `checks`: ids, request ids, text and seeds, which every call shares.
- `batch_items`: a batch's items as types (`BatchItem`) and the one reader of their JSON (`item_from_dict`).
- `training_settings`: AdamW, LoRA, batch items' keys and losses; `sampling_settings`: sampling's knobs, prompts, stops.
- `checkpoints`: checkpoint kinds, names and `signal://` references.
- `runtime_options`: the runtime's own options and the per-call size bounds they set.
"""

from gpu_runtime.contract.batch_items import (
    BatchItem,
    ChatItem,
    DatumItem,
    Message,
    PackedItem,
    PromptCompletion,
    TextItem,
    TokensItem,
    batch_from_dicts,
    batch_to_dicts,
    item_from_dict,
)
from gpu_runtime.contract.calls import (
    CALLS,
    CONTRACT_VERSION,
    Call,
    Kind,
    Lane,
    Method,
    RunCall,
)
from gpu_runtime.contract.checkpoints import (
    CHECKPOINT_KINDS,
    CHECKPOINT_SCHEME,
    LOADABLE_KINDS,
    SAVE_MODES,
    CheckpointRef,
    check_checkpoint_name,
    check_snapshot_name,
    checkpoint_ref,
    default_checkpoint_name,
)
from gpu_runtime.contract.checks import (
    MAX_REQUEST_ID_LENGTH,
    MAX_RUN_SEED,
    MAX_SEED,
    check_id,
    check_request_id,
    check_seed,
    check_text,
)
from gpu_runtime.contract.control_calls import (
    Cancel,
    CloseRun,
    CreateRun,
    DeleteCheckpoint,
    DeleteRun,
    ExportCheckpoint,
    LoadRun,
    LoadState,
    Ping,
    RunInfo,
    RuntimeState,
    SaveState,
    SaveWeightsForSampler,
)
from gpu_runtime.contract.registry import (
    SYSTEM_CALLS,
    parse_call,
)
from gpu_runtime.contract.results import (
    BaseDescription,
    CancelResult,
    CloseRunResult,
    DeleteCheckpointResult,
    DeleteRunResult,
    ExportCheckpointResult,
    ForwardBackwardResult,
    ForwardResult,
    LoadStateResult,
    OptimStepResult,
    PingResult,
    RenderChatResult,
    RenderDatumsResult,
    RenderedDatum,
    Result,
    RunDescription,
    RuntimeStateResult,
    SampleChunk,
    SampledSequence,
    SampleResult,
    SaveStateResult,
    SaveWeightsForSamplerResult,
    SequenceChunk,
    TokenizerResult,
)
from gpu_runtime.contract.runtime_options import (
    RuntimeOptions,
    check_batch_size,
    check_sample_size,
)
from gpu_runtime.contract.sampling_calls import (
    RenderChat,
    Sample,
    Tokenizer,
)
from gpu_runtime.contract.sampling_settings import (
    MAX_SAMPLES,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    MAX_TOP_K,
    MAX_TOP_P,
    MAX_TOPK_LOGPROBS,
    SAMPLE_DEFAULTS,
    SampleDefaults,
    SamplingSettings,
    sampling_prompts,
    sampling_settings,
    stop_settings,
)
from gpu_runtime.contract.training_calls import (
    Forward,
    ForwardBackward,
    OptimStep,
    RenderDatums,
)
from gpu_runtime.contract.training_settings import (
    ADAM_BOUNDS,
    ADAM_DEFAULTS,
    ATTENTION_PROJECTIONS,
    DATUM_INPUTS,
    DATUM_KEYS,
    DEFAULT_LOSS_FN,
    DEFAULT_REDUCTION,
    ITEM_KEYS,
    LORA_ALPHA_PER_R,
    LORA_DEFAULTS,
    LORA_KEYS,
    LORA_R_MAX,
    LORA_SWITCHES,
    LOSS_CONFIG_DEFAULTS,
    MLP_PROJECTIONS,
    PACKED_KEY,
    PACKED_TOKENS,
    REDUCTIONS,
    RL_LOSSES,
    TEXT_KEYS,
    TOKEN_KEYS,
    UNEMBEDDING,
    adam_settings,
    check_adam_value,
    default_target_modules,
    lora_settings,
    loss_settings,
    switched_target_modules,
    target_families,
)

__all__ = [
    "ADAM_BOUNDS", "ADAM_DEFAULTS", "ATTENTION_PROJECTIONS", "CALLS", "CONTRACT_VERSION", "Call", "CloseRun",
    "CreateRun", "DEFAULT_LOSS_FN", "DeleteRun", "ExportCheckpoint", "ForwardBackward", "ForwardBackwardResult",
    "ITEM_KEYS", "LORA_DEFAULTS", "LORA_KEYS", "LORA_R_MAX", "LORA_SWITCHES", "LoadRun", "MLP_PROJECTIONS",
    "MAX_REQUEST_ID_LENGTH", "MAX_SAMPLES", "MAX_TOKENS_LIMIT", "Method", "OptimStep", "OptimStepResult", "Ping",
    "Result", "RunCall", "RunDescription", "RunInfo", "RuntimeOptions", "RuntimeState", "SAMPLE_DEFAULTS",
    "SAVE_MODES", "SYSTEM_CALLS", "Sample", "SampledSequence", "SampleResult", "SamplingSettings", "SaveState",
    "SaveStateResult", "TEXT_KEYS", "TOKEN_KEYS", "UNEMBEDDING", "adam_settings", "check_adam_value", "check_id",
    "check_request_id", "check_text", "default_target_modules", "lora_settings", "parse_call", "sampling_settings",
    "CHECKPOINT_KINDS", "CHECKPOINT_SCHEME", "LOADABLE_KINDS", "CheckpointRef", "DeleteCheckpoint", "LoadState",
    "LoadStateResult", "check_checkpoint_name", "checkpoint_ref", "default_checkpoint_name",
    "switched_target_modules", "target_families", "MAX_TOPK_LOGPROBS", "Tokenizer", "TokenizerResult",
    "sampling_prompts", "stop_settings", "DATUM_INPUTS", "DATUM_KEYS", "DEFAULT_REDUCTION", "Forward",
    "ForwardResult", "LOSS_CONFIG_DEFAULTS", "REDUCTIONS", "PACKED_KEY", "PACKED_TOKENS", "RL_LOSSES", "RenderDatums",
    "RenderDatumsResult", "loss_settings", "RenderChat", "RenderChatResult", "SaveWeightsForSampler",
    "SaveWeightsForSamplerResult", "check_snapshot_name", "LORA_ALPHA_PER_R", "MAX_RUN_SEED", "MAX_SEED", "MAX_STOP",
    "MAX_STOP_CHARS", "MAX_TEMPERATURE", "MAX_TOP_K", "MAX_TOP_P", "check_batch_size", "check_sample_size", "check_seed",
    "Cancel", "CancelResult", "SampleChunk", "CloseRunResult", "DeleteRunResult",
    "DeleteCheckpointResult", "ExportCheckpointResult", "PingResult", "RuntimeStateResult",
    "BaseDescription", "RenderedDatum", "SequenceChunk", "SampleDefaults", "Kind", "Lane",
    "BatchItem", "ChatItem", "DatumItem", "Message", "PackedItem", "PromptCompletion", "TextItem", "TokensItem",
    "batch_from_dicts", "batch_to_dicts", "item_from_dict",
]
