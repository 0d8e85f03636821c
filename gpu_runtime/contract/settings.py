"""The engine contract, torch-free: defaults, bounds and validators shared by `app` and `gpu_runtime`.

One source for every default and bound. The server validates with these before a call leaves it;
the runtime validates again with the same functions, so a client that skips the server is held to
the same rules. Errors are `BadInput` naming the field in the contract's own (snake_case) names;
the server renames them to GraphQL's camelCase.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from gpu_runtime.errors import BadInput

# ---- ids ---------------------------------------------------------------------------------------

SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_REQUEST_ID_LENGTH = 128


def check_id(value: Any, field: str) -> str:
    # Run and user ids become directory names, so nothing that could climb out of runs/.
    if not isinstance(value, str) or not SAFE_ID.match(value) or ".." in value:
        raise BadInput(f"{field} must be 1-128 characters of letters, digits, '_', '-', '.', got {value!r}", field=field)
    return value


def check_request_id(request_id: Any) -> None:
    # The runtime journals it with every call: a bounded, printable token (the SDK sends a UUID).
    if request_id is not None and not (isinstance(request_id, str) and 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH
                                       and request_id.isprintable()):
        raise BadInput(f"request_id must be 1..{MAX_REQUEST_ID_LENGTH} printable characters", field="request_id")


def check_text(value: Any, field: str) -> None:
    """A string the tokenizer will see must be encodable: JSON's \\ud800 escapes deliver lone surrogates."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadInput(f"{field} has a character that is not valid Unicode text at {exc.start}", field=field) from None


def check_batch_text(batch: list[Any]) -> None:
    """`check_text` on every string of a batch: its items' values and their messages' fields. Token lists are
    skipped whole: a 64 x 2048 batch is 131k ints the walk need not visit on every call."""
    for i, item in enumerate(batch):
        if not isinstance(item, dict):
            continue  # the renderer names a non-object item
        for key, value in item.items():
            check_text(value, f"batch[{i}].{key}")
            if key == "messages" and isinstance(value, list):
                for j, message in enumerate(value):
                    if isinstance(message, dict):
                        for name, text in message.items():
                            check_text(text, f"batch[{i}].{key}[{j}].{name}")


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
    ok = _is_number(value) and (value >= low if low_ok else value > low) and (value <= high if high_ok else value < high)
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

LORA_DEFAULTS: dict[str, Any] = {
    "r": 32, "alpha": 64.0, "dropout": 0.0,  # alpha = 2r, the usual choice
    # Tinker's three switches (LoraConfig's train_attn/train_mlp/train_unembed; Tinker defaults all three to true).
    # Signal's default stays attention only: the MLP triples the adapter, the unembedding adds a [vocab, r] B.
    "train_attn": True, "train_mlp": False, "train_unembed": False,
}
LORA_R_MAX = 512
# The update is scaled by alpha / r: past 16 it is a typo, not a setting (alpha 1e308 made every loss nan).
LORA_ALPHA_PER_R = 16
LORA_SWITCHES = ("train_attn", "train_mlp", "train_unembed")
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


def lora_settings(lora: Any, available: set[str] | None = None) -> dict[str, Any]:
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
    if not _is_int(r) or not 1 <= r <= LORA_R_MAX:
        raise BadInput(f"lora.r must be an integer in 1..{LORA_R_MAX}, got {r!r}", field="lora.r")
    alpha = lora.get("alpha")
    alpha = 2.0 * r if alpha is None else alpha
    if not _is_number(alpha) or not 0 < alpha <= LORA_ALPHA_PER_R * r:
        raise BadInput(f"lora.alpha must be a number in (0, {LORA_ALPHA_PER_R} * r = {LORA_ALPHA_PER_R * r}], "
                       f"got {alpha!r}", field="lora.alpha")
    dropout = lora.get("dropout", LORA_DEFAULTS["dropout"])
    dropout = LORA_DEFAULTS["dropout"] if dropout is None else dropout
    if not _is_number(dropout) or not 0 <= dropout < 1:
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
    settings = {"r": r, "alpha": float(alpha), "dropout": float(dropout),
                "target_modules": sorted(set(targets)) if targets is not None else None}
    if targets is None and switches is not None:
        settings.update(switches)  # for the runtime to resolve against its model
    return settings


def _switches(lora: dict[str, Any]) -> dict[str, bool] | None:
    """The three switches filled from the defaults, or None when none was set (None counts as unset)."""
    if all(lora.get(s) is None for s in LORA_SWITCHES):
        return None
    switches = {}
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

# A batch item is one of these key sets (gpu_runtime/batches.py renders them): text, a prompt/answer pair, a chat,
# or token level. Token items take per-token logprobs and advantages for the RL losses.
TEXT_KEYS = ({"text"}, {"input", "output"}, {"input"}, {"output"}, {"messages"})
TOKEN_KEYS = {"tokens", "weights", "logprobs", "advantages"}
# Tinker's datum: {model_input: [ids], loss_fn_inputs: {target_tokens, weights, …}}, every list N = len(model_input).
DATUM_KEYS = {"model_input", "loss_fn_inputs"}
DATUM_INPUTS = ("target_tokens", "weights", "advantages", "logprobs", "clip_low_threshold", "clip_high_threshold")
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
}
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")  # take the sampler's logprobs and advantages
REDUCTIONS = ("mean", "sum")  # mean: normalised over every call before optim_step; sum: raw, as Tinker
DEFAULT_REDUCTION = "mean"


def loss_settings(loss_fn: Any, config: Any, reduction: Any = DEFAULT_REDUCTION) -> dict[str, float]:
    """The loss's config, its defaults filled in; refuses unknown losses, keys, values and reductions."""
    if loss_fn not in LOSS_CONFIG_DEFAULTS:
        raise BadInput(f"unknown loss_fn {loss_fn!r}; available: {sorted(LOSS_CONFIG_DEFAULTS)}", field="loss_fn")
    if reduction not in REDUCTIONS:
        raise BadInput(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}", field="reduction")
    if config is not None and not isinstance(config, dict):
        raise BadInput("loss_fn_config must be an object or null", field="loss_fn_config")
    defaults = LOSS_CONFIG_DEFAULTS[loss_fn]
    unknown = sorted(set(config or {}) - set(defaults))
    if unknown:
        takes = f"takes {sorted(defaults)}" if defaults else "takes no loss_fn_config"
        raise BadInput(f"{loss_fn} {takes}, got key {unknown[0]!r}", field="loss_fn_config")
    settings = dict(defaults)
    for key, value in (config or {}).items():
        if not _is_number(value):
            raise BadInput(f"loss_fn_config.{key} must be a finite number, got {value!r}", field=f"loss_fn_config.{key}")
        settings[key] = float(value)
    if "beta" in settings and settings["beta"] < 0:
        raise BadInput("loss_fn_config.beta must be >= 0", field="loss_fn_config.beta")
    if "clip_low_threshold" in settings and not 0 <= settings["clip_low_threshold"] <= settings["clip_high_threshold"]:
        raise BadInput("loss_fn_config needs 0 <= clip_low_threshold <= clip_high_threshold",
                       field="loss_fn_config.clip_low_threshold")
    return settings

# ---- sampling ----------------------------------------------------------------------------------

MAX_TOKENS_LIMIT = 4096
MAX_SAMPLES = 16
MAX_TOPK_LOGPROBS = 20  # most (token, logprob) pairs per position, as vLLM's max_logprobs
MAX_TEMPERATURE = 2.0  # OpenAI's bound; past it sampling is noise (the playground and /v1 share it)
MAX_TOP_P = 1.0  # top_p is a probability mass in (0, MAX_TOP_P] (the playground and /v1 share it)
MAX_TOP_K = 1024  # past this top-k keeps the tail anyway; 0 (or -1) turns it off
MAX_STOP = 16  # stop strings or stop token ids per call: each is checked after every decoded token
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_SEED = 2**63 - 1  # a sampling seed: int64, what torch's generator and JSON's readers hold
MAX_RUN_SEED = 2**31 - 1  # a run's seed: runs.seed is a 32-bit column on PostgreSQL (and GraphQL's Int is 32-bit)
SAMPLE_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "num_samples": 1,
                                   "prompt_logprobs": False, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0}


@dataclass
class SamplingSettings:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0: off (the caller's -1 is read as 0)
    stop: list[str]  # stop strings
    num_samples: int
    seed: int
    stop_tokens: list[int] = field(default_factory=list)
    eos: bool = True  # EOS ids stop; `stop=[]` turns them off
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt_logprobs > 0


def sampling_prompts(prompts: Any, prompt_tokens: Any) -> list[str] | list[list[int]]:
    """Exactly one of text prompts or token-id prompts; ids are checked against the vocabulary in the runtime."""
    if (prompts is None) == (prompt_tokens is None):
        raise BadInput("give exactly one of prompts (text) or prompt_tokens (token ids)", field="prompts")
    if prompts is not None:
        if not isinstance(prompts, list) or not prompts:
            raise BadInput("prompts must be a non-empty list of strings", field="prompts")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise BadInput(f"prompts[{i}] must be a non-empty string", field=f"prompts[{i}]")
            check_text(prompt, f"prompts[{i}]")
        return prompts
    if not isinstance(prompt_tokens, list) or not prompt_tokens:
        raise BadInput("prompt_tokens must be a non-empty list of token id lists", field="prompt_tokens")
    for i, ids in enumerate(prompt_tokens):
        if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
            raise BadInput(f"prompt_tokens[{i}] must be a non-empty list of token ids (integers >= 0)",
                           field=f"prompt_tokens[{i}]")
    return prompt_tokens


def stop_settings(stop: Any) -> tuple[list[str], list[int], bool]:
    """(stop strings, stop token ids, whether EOS stops). None: EOS alone; []: nothing stops but max_tokens;
    a non-empty list of strings or of token ids stops there and at EOS too (vLLM's and Tinker's reading)."""
    if stop is None:
        return [], [], True
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list):
        raise BadInput("stop must be a string, a list of strings or a list of token ids", field="stop")
    if len(stop) > MAX_STOP:
        raise BadInput(f"stop has {len(stop)} entries; at most {MAX_STOP}", field="stop")
    if all(isinstance(s, str) for s in stop):
        if not all(stop):
            raise BadInput("stop strings must be non-empty", field="stop")
        longest = max((len(s) for s in stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise BadInput(f"a stop string is {longest} characters; at most {MAX_STOP_CHARS}", field="stop")
        return list(stop), [], bool(stop)
    if all(_is_int(s) for s in stop):
        if any(s < 0 for s in stop):
            raise BadInput("stop token ids must be integers >= 0", field="stop")
        return [], list(stop), True
    raise BadInput("stop must be all strings or all token ids, not a mix", field="stop")


def check_seed(seed: Any, most: int) -> int:
    """A seed the caller gave: an integer in 0..`most` (MAX_SEED for sampling, MAX_RUN_SEED for a run)."""
    if not _is_int(seed) or not 0 <= seed <= most:
        raise BadInput(f"seed must be an integer in 0..{most} or null, got {seed!r}", field="seed")
    return int(seed)


def sampling_settings(
    max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, stop: Any, num_samples: Any, seed: Any,
    prompt_logprobs: Any = False, topk_prompt_logprobs: Any = 0, topk_sample_logprobs: Any = 0,
) -> SamplingSettings:
    if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadInput(f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {max_tokens!r}", field="max_tokens")
    if not _is_number(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise BadInput(f"temperature must be a number in [0, {MAX_TEMPERATURE}], got {temperature!r}",
                       field="temperature")
    if not _is_number(top_p) or not 0 < top_p <= MAX_TOP_P:
        raise BadInput(f"top_p must be a number in (0, {MAX_TOP_P:g}], got {top_p!r}", field="top_p")
    if not _is_int(top_k) or not -1 <= top_k <= MAX_TOP_K:
        raise BadInput(f"top_k must be an integer in -1..{MAX_TOP_K} (0 or -1 = off), got {top_k!r}", field="top_k")
    strings, tokens, eos = stop_settings(stop)
    if not _is_int(num_samples) or not 1 <= num_samples <= MAX_SAMPLES:
        raise BadInput(f"num_samples must be an integer in 1..{MAX_SAMPLES}, got {num_samples!r}", field="num_samples")
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    else:
        check_seed(seed, MAX_SEED)
    if not isinstance(prompt_logprobs, bool):
        raise BadInput(f"prompt_logprobs must be a boolean, got {prompt_logprobs!r}", field="prompt_logprobs")
    for name, k in (("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs)):
        if not _is_int(k) or not 0 <= k <= MAX_TOPK_LOGPROBS:
            raise BadInput(f"{name} must be an integer in 0..{MAX_TOPK_LOGPROBS} (0 = off), got {k!r}", field=name)
    return SamplingSettings(max_tokens, float(temperature), float(top_p), max(top_k, 0), strings, num_samples, seed,
                            stop_tokens=tokens, eos=eos, prompt_logprobs=prompt_logprobs,
                            topk_prompt_logprobs=topk_prompt_logprobs, topk_sample_logprobs=topk_sample_logprobs)


# ---- saving ------------------------------------------------------------------------------------

SAVE_MODES = ("adapter", "merged", "state")
CHECKPOINT_KINDS = (*SAVE_MODES, "sampler")  # a checkpoint's kind (its `mode`); "sampler": save_weights_for_sampler's
LOADABLE_KINDS = ("state", "adapter")  # what load_state and create_run(from_checkpoint=…) read: an adapter, ± AdamW
CHECKPOINT_SCHEME = "signal://"  # signal://<run_id>/<kind>/<name>, like Tinker's tinker:// paths (docs/CHECKPOINTS.md)
DEFAULT_NAME = re.compile(r"^step-(\d+)$")  # the name of a save_state without one: step-N, as migration 0009 named old rows
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def default_checkpoint_name(step: int) -> str:
    return f"step-{step}"


def check_checkpoint_name(name: Any, field: str = "name") -> str:
    if not isinstance(name, str) or not CHECKPOINT_NAME.match(name):
        raise BadInput(f"{field} must be 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit, "
                       f"got {name!r}", field=field)
    return name


@dataclass(frozen=True)
class CheckpointRef:
    """Where a checkpoint is: a run, a kind and a name."""

    run_id: str
    kind: str
    name: str

    @property
    def path(self) -> str:
        return f"{CHECKPOINT_SCHEME}{self.run_id}/{self.kind}/{self.name}"


def checkpoint_ref(value: Any, field: str, run_id: str | None = None, kinds: tuple[str, ...] = LOADABLE_KINDS,
                   ) -> CheckpointRef:
    """`signal://<run_id>/<kind>/<name>`, or (with `run_id`, a call on that run) a bare name: that run's state
    checkpoint. The kind must be one of `kinds`."""
    if not isinstance(value, str) or not value:
        raise BadInput(f"{field} must be a checkpoint path signal://<run_id>/<kind>/<name>", field=field)
    if value.startswith(CHECKPOINT_SCHEME):
        parts = value[len(CHECKPOINT_SCHEME):].split("/")
        if len(parts) != 3:
            raise BadInput(f"{field} must be signal://<run_id>/<kind>/<name>, got {value!r}", field=field)
        ref = CheckpointRef(check_id(parts[0], field), parts[1], check_checkpoint_name(parts[2], field))
    elif run_id is not None:
        ref = CheckpointRef(run_id, "state", check_checkpoint_name(value, field))
    else:
        raise BadInput(f"{field} must be a checkpoint path signal://<run_id>/<kind>/<name>, got {value!r}", field=field)
    if ref.kind not in kinds:
        raise BadInput(f"{field}: a {ref.kind!r} checkpoint cannot be loaded; the kinds are {list(kinds)}",
                       field=field)
    return ref


# ---- the runtime's own settings (the server passes them through; `signal runtime` takes them) ----


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime schedules, remembers and persists. Every default lives here and only here."""

    max_batch_size: int = 64  # most items in one forward_backward
    # Per-call sizes (docs/ERRORS.md#bounds): past them a call is BAD_INPUT naming its field, so that no one call holds
    # the runtime for minutes. The server checks what it can before a call leaves; the runtime checks again, tokenized.
    max_batch_tokens: int = 65536  # most tokens in one forward_backward or forward, its rows summed
    max_sample_rows: int = 2048  # most sequences one sample makes: prompts x num_samples (an RL step's 128 x 16)
    max_sample_prompt_tokens: int = 65536  # most prompt tokens one sample prefills: their sum x num_samples
    max_sample_tokens: int = 32768  # most tokens one sample may generate: its rows x max_tokens
    tick_tokens: int = 8192  # most tokens of forward_backward rows in one co-batched pass
    decode_chunk_seconds: float = 0.25  # a decode group yields to other work after this long
    resident_bytes: int = 2 * 1024**3  # LoRA + AdamW + gradients of resident runs; LRU idle runs are evicted past it
    resident_runs: int = 256  # and at most this many runs in memory
    snapshot_every_steps: int = 50  # a run that changed is snapshotted every N optim_steps…
    snapshot_every_seconds: float = 600.0  # …or after this long, whichever comes first
    keep_snapshots: int = 2  # snapshots kept per run (the newest ones)
    base_idle_seconds: float = 900.0  # a base with no resident runs is unloaded after this long idle
    local_ranks: int = 1  # rank processes of the pool: N > 1 shards each base with FSDP (N GPUs, or N CPU processes)
    rank_timeout_seconds: float = 300.0  # a collective that waits longer means a hung rank: every rank stops
    unnamed_snapshot_seconds: float = 3600.0  # an unnamed sampler snapshot expires this long after it was made
    min_free_disk_bytes: int = 64 * 1024**2  # below this free space, calls that write are refused (RESOURCE_EXHAUSTED)
    # A user's calls in flight in the runtime (scheduler.py): past the first, calls wait their turn; past the second
    # waiting too, RESOURCE_EXHAUSTED (resource "calls", retry_after_s). An RL loop's 128 samples at once wait, not fail.
    max_user_calls_in_flight: int = 64
    max_user_calls_waiting: int = 1024
    # Most bytes of one checkpoint sent through the runtime's export_checkpoint (base64 in one JSON answer: Modal's
    # downloads); a bigger one is copied with `signal pull`, and the dashboard says so instead of offering a link.
    export_limit_bytes: int = 256 * 1024**2

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not _is_number(value) or value <= 0:
                raise BadInput(f"runtime option {f.name} must be a positive number, got {value!r}", field=f.name)
            if f.type in ("int", int) and not _is_int(value):
                raise BadInput(f"runtime option {f.name} must be an integer, got {value!r}", field=f.name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuntimeOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BadInput(f"unknown runtime options {unknown}; known: {sorted(known)}", field=unknown[0])
        return cls(**data)


def check_sample_size(prompt_count: int, settings: SamplingSettings, options: RuntimeOptions, field: str,
                      prompt_lengths: list[int] | None = None) -> None:
    """One sample call's size against the bounds: its rows (prompts x num_samples), the tokens it may generate (rows
    x max_tokens) and, given the prompts' lengths in tokens, the tokens its prefill holds (their sum x num_samples).
    `field` names the prompts (prompts or prompt_tokens)."""
    rows = prompt_count * settings.num_samples
    if rows > options.max_sample_rows:
        raise BadInput(f"{prompt_count} prompts x num_samples {settings.num_samples} = {rows} sequences; a sample "
                       f"makes at most {options.max_sample_rows}",
                       field=field if prompt_count > options.max_sample_rows else "num_samples")
    generated = rows * settings.max_tokens
    if generated > options.max_sample_tokens:
        raise BadInput(f"{rows} sequences x max_tokens {settings.max_tokens} = {generated} tokens; a sample "
                       f"generates at most {options.max_sample_tokens}", field="max_tokens")
    if prompt_lengths is not None:
        prefill = sum(prompt_lengths) * settings.num_samples
        if prefill > options.max_sample_prompt_tokens:
            raise BadInput(f"{sum(prompt_lengths)} prompt tokens x num_samples {settings.num_samples} = {prefill}; a "
                           f"sample takes at most {options.max_sample_prompt_tokens}", field=field)


def check_batch_size(items: int, tokens: int, options: RuntimeOptions) -> None:
    """One forward_backward's (or forward's) size: its items and its rows' tokens. The server passes the tokens it
    can count without a tokenizer (token items), a lower bound; the runtime passes the rendered rows' own."""
    if items > options.max_batch_size:
        raise BadInput(f"batch has {items} items; a call takes at most {options.max_batch_size}", field="batch")
    if tokens > options.max_batch_tokens:
        raise BadInput(f"batch has {tokens} tokens; a call takes at most {options.max_batch_tokens}", field="batch")


def known_batch_tokens(batch: list[Any]) -> int:
    """The tokens of a batch's token items (tokens, model_input, packed), counted without a tokenizer: text items
    count 0, so this is a lower bound of what the runtime renders."""
    total = 0
    for item in batch:
        if not isinstance(item, dict):
            continue
        ids = item.get("tokens", item.get("model_input"))
        if isinstance(ids, list):
            total += len(ids)
        packed = item.get(PACKED_KEY)
        if isinstance(packed, dict) and isinstance(packed.get("model_input"), str):
            total += len(packed["model_input"].rstrip("=")) * 3 // 4 // 4  # base64 of int32s
    return total


def check_snapshot_name(value: Any, field: str) -> str:
    """A snapshot's name: a checkpoint name (CHECKPOINT_NAME: a path segment, no slashes, no "@"), and no ".."
    anywhere, since it also becomes half of a routing key ("<run>@<name>")."""
    if not isinstance(value, str) or not CHECKPOINT_NAME.match(value) or ".." in value:
        raise BadInput(f"{field} must be 1-128 letters, digits, '.', '_' or '-' (starting with a letter or digit), "
                       f"got {value!r}", field=field)
    return value


# ---- shared checks ----------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
