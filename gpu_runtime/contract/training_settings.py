"""What training takes, with its defaults and bounds: AdamW, LoRA (and the layers it targets by architecture family),
the batch items a forward_backward carries, and the losses with their configs.

The server checks these before a call leaves it; the runtime checks again, and resolves LoRA's targets against its
model (`lora_settings(..., available)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict, overload

from gpu_runtime.contract.checks import is_int, is_number
from gpu_runtime.contract.custom_loss import CUSTOM_LOSS_FN
from gpu_runtime.errors import BadInput

# ---- AdamW -------------------------------------------------------------------------------------

ADAM_DEFAULTS: dict[str, float] = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 1.0,  # 0 turns clipping off
}
# (lowest, highest, lowest allowed itself?, highest allowed itself?) per setting.
ADAM_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "learning_rate": (0.0, 1.0, False, True),
    "beta1": (0.0, 1.0, True, False),
    "beta2": (0.0, 1.0, True, False),
    "eps": (0.0, 1.0, False, True),
    "weight_decay": (0.0, 10.0, True, True),
    # Past a norm of 1000 clipping never happens in practice: 0 is how it is turned off, a huge number is a typo.
    "grad_clip_norm": (0.0, 1000.0, True, True),
}


def check_adam_value(key: str, value: Any) -> float:
    low, high, low_ok, high_ok = ADAM_BOUNDS[key]
    ok = is_number(value) and (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
    if not ok:
        bound = f"{'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
        raise BadInput(f"adam.{key} must be a number in {bound}, got {value!r}", field=f"adam.{key}")
    return float(value)


def adam_settings(adam: Any) -> dict[str, float]:
    """The user's AdamW overrides over the defaults; unknown or out-of-range settings name their field."""
    adam = {} if adam is None else adam
    if not isinstance(adam, dict):
        raise BadInput("adam must be an object of AdamW settings", field="adam")
    settings = dict(ADAM_DEFAULTS)
    for key, value in adam.items():
        if key not in ADAM_DEFAULTS:
            raise BadInput(f"unknown AdamW setting {key!r}; known: {sorted(ADAM_DEFAULTS)}", field=f"adam.{key}")
        if value is not None:
            settings[key] = check_adam_value(key, value)
    return settings


# ---- LoRA --------------------------------------------------------------------------------------

Switch = Literal["train_attn", "train_mlp", "train_unembed"]


class LoraDefaults(TypedDict):
    r: int
    alpha: float
    dropout: float
    train_attn: bool
    train_mlp: bool
    train_unembed: bool


class LoraSettings(TypedDict):
    """A run's LoRA as lora_settings resolved it: what config.json, a checkpoint's meta and RunDescription hold."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str]


class LoraGiven(TypedDict, total=False):
    """Only the LoRA settings a caller gave (a run from a checkpoint: these must agree with the checkpoint's)."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str]


class LoraAsked(TypedDict):
    """LoRA as checked without a model (the server's): targets unnamed, the switches (if set) say which to resolve."""

    r: int
    alpha: float
    dropout: float
    target_modules: None
    train_attn: NotRequired[bool]
    train_mlp: NotRequired[bool]
    train_unembed: NotRequired[bool]


LORA_DEFAULTS: LoraDefaults = {
    "r": 32, "alpha": 64.0, "dropout": 0.0,  # alpha = 2r, the usual choice
    # Tinker's three switches (LoraConfig's train_attn/train_mlp/train_unembed; Tinker defaults all three to true).
    # Signal's default stays attention only: the MLP triples the adapter, the unembedding adds a [vocab, r] B.
    "train_attn": True, "train_mlp": False, "train_unembed": False,
}
LORA_R_MAX = 512
# The update is scaled by alpha / r: past 16 it is a typo, not a setting (alpha 1e308 made every loss nan).
LORA_ALPHA_PER_R = 16
LORA_SWITCHES: tuple[Switch, ...] = ("train_attn", "train_mlp", "train_unembed")
LORA_KEYS = {"r", "alpha", "dropout", "target_modules", *LORA_SWITCHES}
# The layers each switch targets, by architecture family (leaf names); a model gets whichever of them it has.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv", "out_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "dense_h_to_4h", "dense_4h_to_h",
                   "w1", "w2", "w3", "c_fc")
UNEMBEDDING = ("lm_head", "embed_out")  # the output projection (GPT-NeoX calls it embed_out)
SWITCH_MODULES = {"train_attn": ATTENTION_PROJECTIONS, "train_mlp": MLP_PROJECTIONS, "train_unembed": UNEMBEDDING}


def default_target_modules(available: set[str]) -> list[str]:
    return [name for name in ATTENTION_PROJECTIONS if name in available]


def switched_target_modules(switches: dict[str, bool], available: set[str]) -> list[str]:
    """The layers the switches name that this model has; BadInput naming the switch that finds none."""
    targets: list[str] = []
    for switch in LORA_SWITCHES:
        if switches[switch]:
            found = [name for name in SWITCH_MODULES[switch] if name in available]
            if not found:
                raise BadInput(f"lora.{switch}: this architecture has none of {list(SWITCH_MODULES[switch])}; name "
                               f"lora.target_modules instead (it has {sorted(available)})", field=f"lora.{switch}")
            targets += found
    return targets


def target_families(target_modules: list[str] | None) -> dict[str, bool]:
    """Which switches a target list amounts to (None: the default); for the fit estimate, which has no model."""
    if target_modules is None:
        return {switch: LORA_DEFAULTS[switch] for switch in LORA_SWITCHES}
    return {switch: any(t in SWITCH_MODULES[switch] for t in target_modules) for switch in LORA_SWITCHES}


@overload
def lora_settings(lora: object, available: set[str]) -> LoraSettings: ...
@overload
def lora_settings(lora: object, available: None = None) -> LoraSettings | LoraAsked: ...
def lora_settings(lora: object, available: set[str] | None = None) -> LoraSettings | LoraAsked:
    """Validate the user's LoRA dict and fill defaults; errors name the field (`lora.r`).

    The targets are `target_modules` or the three switches (train_attn, train_mlp, train_unembed), not both.
    With `available` (the base's layer names, lm_head included) the targets are resolved and checked: the result
    names them in `target_modules` and carries no switch. Without it (the server, which has no model) they are
    only checked for shape, and switches that were set stay in the result, each filled from LORA_DEFAULTS.
    """
    lora = {} if lora is None else lora
    if not isinstance(lora, dict):
        raise BadInput(f"lora must be an object with r, alpha, dropout, target_modules, got {type(lora).__name__}", field="lora")
    for key in lora:
        if key not in LORA_KEYS:
            raise BadInput(f"unknown LoRA setting {key!r}; known: {sorted(LORA_KEYS)}", field=f"lora.{key}")
    r = lora.get("r", LORA_DEFAULTS["r"])
    if not is_int(r) or not 1 <= r <= LORA_R_MAX:
        raise BadInput(f"lora.r must be an integer in 1..{LORA_R_MAX}, got {r!r}", field="lora.r")
    alpha = lora.get("alpha")
    alpha = 2.0 * r if alpha is None else alpha
    if not is_number(alpha) or not 0 < alpha <= LORA_ALPHA_PER_R * r:
        raise BadInput(f"lora.alpha must be a number in (0, {LORA_ALPHA_PER_R} * r = {LORA_ALPHA_PER_R * r}], "
                       f"got {alpha!r}", field="lora.alpha")
    dropout = lora.get("dropout", LORA_DEFAULTS["dropout"])
    dropout = LORA_DEFAULTS["dropout"] if dropout is None else dropout
    if not is_number(dropout) or not 0 <= dropout < 1:
        raise BadInput(f"lora.dropout must be a number in [0, 1), got {dropout!r}", field="lora.dropout")
    targets = lora.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    named = [switch for switch in LORA_SWITCHES if lora.get(switch) is not None]
    if targets is not None and named:
        raise BadInput(f"lora.target_modules and lora.{named[0]} both name the targets: give one or the other",
                       field="lora.target_modules")
    switches = _switches(lora)
    if targets is None:
        if available is not None:
            targets = (switched_target_modules(switches, available) if switches is not None
                       else default_target_modules(available))
            if not targets:
                raise BadInput("this architecture has no known attention projections; name lora.target_modules",
                               field="lora.target_modules")
    elif not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise BadInput("lora.target_modules must be a non-empty list of module names", field="lora.target_modules")
    if targets is not None and available is not None:
        missing = [t for t in targets if t not in available]
        if missing:
            raise BadInput(f"lora.target_modules {missing} not in this model; it has {sorted(available)}",
                           field="lora.target_modules")
    if targets is not None:
        return {"r": r, "alpha": float(alpha), "dropout": float(dropout), "target_modules": sorted(set(targets))}
    asked: LoraAsked = {"r": r, "alpha": float(alpha), "dropout": float(dropout), "target_modules": None}
    if switches is not None:  # for the runtime to resolve against its model
        asked["train_attn"], asked["train_mlp"] = switches["train_attn"], switches["train_mlp"]
        asked["train_unembed"] = switches["train_unembed"]
    return asked


def _switches(lora: Mapping[str, object]) -> dict[str, bool] | None:
    """The three switches filled from the defaults, or None when none was set (None counts as unset)."""
    if all(lora.get(s) is None for s in LORA_SWITCHES):
        return None
    switches: dict[str, bool] = {}
    for switch in LORA_SWITCHES:
        value = lora.get(switch)
        if value is not None and not isinstance(value, bool):
            raise BadInput(f"lora.{switch} must be true or false, got {value!r}", field=f"lora.{switch}")
        switches[switch] = LORA_DEFAULTS[switch] if value is None else value
    if not any(switches.values()):
        off = next(s for s in LORA_SWITCHES if lora.get(s) is False)
        raise BadInput(f"lora.{off}: with every switch off LoRA targets nothing; turn one of {list(LORA_SWITCHES)} on "
                       "or name lora.target_modules", field=f"lora.{off}")
    return switches


# ---- batches -------------------------------------------------------------------------------------

# A batch item is one of these key sets (gpu_runtime/compute/batches.py renders them): text, a prompt/answer pair, a chat,
# or token level. Token items take per-token logprobs and advantages for the RL losses.
TEXT_KEYS = ({"text"}, {"input", "output"}, {"input"}, {"output"}, {"messages"})
TOKEN_KEYS = {"tokens", "weights", "logprobs", "advantages"}
# Tinker's datum: {model_input: [ids], loss_fn_inputs: {target_tokens, weights, …}}, every list N = len(model_input).
DATUM_KEYS = {"model_input", "loss_fn_inputs"}
DATUM_INPUTS = ("target_tokens", "weights", "advantages", "logprobs", "clip_low_threshold", "clip_high_threshold",
                "sequence_ratio_mask")
# Soft targets: cross_entropy's target_tokens and weights may be (N, K), a weighted sum over K targets per position
# (a teacher's top-K). The pass gathers (N, K) logprobs: memory grows with K, so K is bounded (sdft's default is 20).
MAX_SOFT_TARGETS = 64
# The packed datum: {"packed": {"model_input": b64, "target_tokens": b64, "weights": b64, …}}, each list as base64 of
# little-endian int32 (token ids) or float32 (the rest). One string per list: GraphQL coerces a typed list element by
# element (about 0.9 µs each), a string at once.
PACKED_KEY = "packed"
PACKED_TOKENS = ("model_input", "target_tokens")
ITEM_KEYS = {"text", "input", "output", "messages", PACKED_KEY} | TOKEN_KEYS | DATUM_KEYS

# ---- losses (docs/LOSSES.md has the formulas) ------------------------------------------------------

DEFAULT_LOSS_FN = "cross_entropy"
# Each loss's loss_fn_config keys and their defaults; per-token loss_fn_inputs of the same name win over these.
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},  # the quadratic penalty's weight on (logp - sampling logp)^2
    # GSPO's sequence ratio bounds: the paper's 1 - 3e-4 and 1 + 4e-4 (a length-normalised ratio moves little).
    "gspo": {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4},
    # The truncated importance weight's cap C: min(r, C), as truncated importance sampling's usual 2.
    "stable_reinforce": {"clip_high_threshold": 2.0},
}
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")  # take the sampler's logprobs and advantages
REDUCTIONS = ("mean", "sum")  # mean: normalised over every call before optim_step; sum: raw, as Tinker
DEFAULT_REDUCTION = "mean"


def loss_settings(loss_fn: Any, config: Any, reduction: Any = DEFAULT_REDUCTION) -> dict[str, float]:
    """The loss's config, its defaults filled in; refuses unknown losses, keys, values and reductions."""
    if loss_fn not in LOSS_CONFIG_DEFAULTS and loss_fn != CUSTOM_LOSS_FN:
        raise BadInput(f"unknown loss_fn {loss_fn!r}; available: {sorted(LOSS_CONFIG_DEFAULTS)}", field="loss_fn")
    if reduction not in REDUCTIONS:
        raise BadInput(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}", field="reduction")
    if config is not None and not isinstance(config, dict):
        raise BadInput("loss_fn_config must be an object or null", field="loss_fn_config")
    if loss_fn == CUSTOM_LOSS_FN and reduction in REDUCTIONS:  # its graph travels as the call's custom_loss
        if config:
            raise BadInput(f"custom takes no loss_fn_config, got key {sorted(config)[0]!r}", field="loss_fn_config")
        return {}
    defaults = LOSS_CONFIG_DEFAULTS[loss_fn]
    unknown = sorted(set(config or {}) - set(defaults))
    if unknown:
        takes = f"takes {sorted(defaults)}" if defaults else "takes no loss_fn_config"
        raise BadInput(f"{loss_fn} {takes}, got key {unknown[0]!r}", field="loss_fn_config")
    settings = dict(defaults)
    for key, value in (config or {}).items():
        if not is_number(value):
            raise BadInput(f"loss_fn_config.{key} must be a finite number, got {value!r}", field=f"loss_fn_config.{key}")
        settings[key] = float(value)
    if "beta" in settings and settings["beta"] < 0:
        raise BadInput("loss_fn_config.beta must be >= 0", field="loss_fn_config.beta")
    if "clip_high_threshold" in settings and not 0 <= settings.get("clip_low_threshold", 0.0) <= settings["clip_high_threshold"]:
        raise BadInput("loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold",
                       field="loss_fn_config.clip_low_threshold")
    return settings
