"""GPU allocation: which GPUs a run gets (the product README's rules, or the user's `gpu_config`), whether
they can hold the model, and the canonical spellings that Modal and the pools use.

Pure Python (no torch): the server validates `gpu_config` with it and the Modal app uses it.
Every bound and every estimate's constant lives here, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpu_runtime.contract import LORA_DEFAULTS, RuntimeOptions
from gpu_runtime.errors import BadInput

MAX_GPUS = 8  # the most GPUs Modal attaches to one container
# GPU counts a pool may have: a power of two shards every weight (and attention head) of the usual sizes evenly.
LEGAL_COUNTS: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True)
class GpuType:
    name: str  # Modal's spelling
    memory_gb: int
    max_count: int = MAX_GPUS


# The README's list plus what Modal offers today. Ordered smallest first: by memory, and of equal
# memory the one cheaper on Modal first (L4 before A10, A100-80GB before H100). "Smallest that fits"
# walks this order.
GPUS: tuple[GpuType, ...] = (
    GpuType("T4", 16),
    GpuType("L4", 24),
    GpuType("A10", 24, max_count=4),  # Modal attaches at most 4 A10s
    GpuType("A100", 40),
    GpuType("L40S", 48),
    GpuType("A100-80GB", 80),
    GpuType("H100", 80),
    GpuType("H200", 141),
    GpuType("B200", 180),
)
GPU_TYPES: dict[str, int] = {gpu.name: gpu.memory_gb for gpu in GPUS}
GPU_ALIASES: dict[str, str] = {"A10G": "A10", "A100-40GB": "A100"}  # the README says A10G; Modal says A10

QUANTIZATIONS: tuple[str, ...] = ("8bit", "4bit")

# ---- the memory estimate: every constant in one place --------------------------------------------
GB = 10**9  # GPUs are sold in these; estimates are shown in them too
GIB = 2**30
BYTES_PER_WEIGHT: dict[str | None, float] = {None: 2.0, "8bit": 1.0, "4bit": 0.5}  # bf16, int8, nf4
LORA_STATE_BYTES = 16  # per trainable parameter: fp32 weight, its gradient, AdamW's two moments (4 bytes each)
ACTIVATION_FRACTION = 0.20  # activation margin, as a share of the weights' bytes
ACTIVATION_FIXED_BYTES = 2 * GIB  # plus a fixed margin: CUDA context, allocator slack, a modest batch
DEFAULT_TARGET_FRACTION = 1 / 3  # share of parameters in LoRA-targeted matrices (attention q/k/v/o ≈ a third)
MLP_TARGET_FRACTION = 2 / 3  # the MLP's gate/up/down hold the other two thirds
VOCAB_ESTIMATE = 150_000  # the unembedding's rows when the catalogue does not say (Qwen's 151,936 is the largest usual)
PARAMS_PER_HIDDEN_SQUARED = 500  # parameters ≈ 500 × hidden² from 135M to 70B; estimates the hidden size
# What a pass keeps for backward (compute/memory_fit.py reads these too): a decoder layer ≈ 12·hidden + 4·intermediate
# values a token (attention's inputs and outputs, the norms, the MLP's gate, up and product), a recomputed one its input.
ACTIVATION_VALUES_PER_HIDDEN = 12
ACTIVATION_VALUES_PER_INTERMEDIATE = 4
BYTES_PER_ACTIVATION = 2  # bf16, the dtype a GPU pass computes in
PARAMS_PER_LAYER_HIDDEN_SQUARED = 12  # a decoder layer ≈ 12·hidden² parameters (4 in attention, 8 in the MLP)
PASS_TOKENS = RuntimeOptions.tick_tokens  # the token budget a pass is estimated at: the runtime's default

_BILLION = 1_000_000_000


@dataclass(frozen=True)
class ExpertShape:
    """A mixture-of-experts model's expert layers, as the catalogue gives them: every expert's weights count in
    memory (they are all resident), compute goes by the active parameters (the experts a token is routed to)."""

    experts: int  # per MoE layer
    active_experts: int  # routed per token
    hidden: int
    intermediate: int  # one expert's
    layers: int  # MoE layers
    active_parameters: int

    def lora_parameters(self, lora_r: int) -> int:
        """LoRA on every expert's gate_up (hidden → 2·intermediate) and down (intermediate → hidden): r × (in + out)
        per expert per target."""
        per_expert = lora_r * ((self.hidden + 2 * self.intermediate) + (self.intermediate + self.hidden))
        return per_expert * self.experts * self.layers


@dataclass(frozen=True)
class LoraTargets:
    """Which layer families a run's LoRA targets (the contract's three switches), and the vocabulary its
    unembedding would have, for the estimate."""

    attention: bool = True
    mlp: bool = False
    unembed: bool = False
    vocab: int | None = None  # None: VOCAB_ESTIMATE
    experts: ExpertShape | None = None  # a mixture-of-experts model: train_mlp trains every expert

    @classmethod
    def of(cls, switches: dict[str, bool], vocab: int | None = None, experts: ExpertShape | None = None) -> LoraTargets:
        """From `target_families(...)` or the settings' switches: {"train_attn": …, "train_mlp": …, "train_unembed": …}."""
        return cls(bool(switches.get("train_attn", True)), bool(switches.get("train_mlp")),
                   bool(switches.get("train_unembed")), vocab, experts)

    @property
    def fraction(self) -> float:
        """The share of the parameters in targeted dense matrices (a MoE model's MLP is its experts: counted apart)."""
        return DEFAULT_TARGET_FRACTION * self.attention + MLP_TARGET_FRACTION * (self.mlp and self.experts is None)


ATTENTION_ONLY = LoraTargets()  # Signal's default


@dataclass(frozen=True)
class GpuAllocation:
    gpu_type: str
    count: int

    def __str__(self) -> str:
        return f"{self.gpu_type}:{self.count}"

    @property
    def memory_gb(self) -> int:
        return GPU_TYPES[self.gpu_type] * self.count


def parse_gpu_config(value: str | GpuAllocation, field: str = "gpu_config") -> GpuAllocation:
    """Parse "L40S", "L40S:2", "a100-80gb:4", "A10G" (case-insensitive, aliases allowed) into an allocation."""
    if isinstance(value, GpuAllocation):
        value = str(value)
    gpu_type, _, count_text = value.strip().partition(":")
    names = {name.upper(): name for name in GPU_TYPES} | {alias.upper(): name for alias, name in GPU_ALIASES.items()}
    canonical = names.get(gpu_type.strip().upper())
    if canonical is None:
        raise BadInput(f"unknown GPU type {gpu_type!r}; use one of {', '.join(GPU_TYPES)}", field=field)
    try:
        count = int(count_text) if count_text else 1
    except ValueError:
        raise BadInput(f"GPU count must be an integer, got {count_text!r}", field=field) from None
    most = _gpu(canonical).max_count
    if not 1 <= count <= most:
        raise BadInput(f"{canonical} GPU count must be between 1 and {most}, got {count}", field=field)
    return GpuAllocation(canonical, count)


def parse_quantization(value: str | None, field: str = "quantization") -> str | None:
    """None (bf16 weights), "8bit" or "4bit"; "none" and "" mean None."""
    if value is None or value.strip().lower() in ("", "none"):
        return None
    if value.strip().lower() not in QUANTIZATIONS:
        raise BadInput(f"quantization must be none, {' or '.join(QUANTIZATIONS)}; got {value!r}", field=field)
    return value.strip().lower()


def allocate(parameters: int) -> GpuAllocation:
    """The product README's rules, by parameter count."""
    if parameters < 7 * _BILLION:
        return GpuAllocation("L40S", 1)
    if parameters < 13 * _BILLION:
        return GpuAllocation("A100-80GB", 1)
    if parameters < 30 * _BILLION:
        return GpuAllocation("A100-80GB", 2)
    if parameters < 72 * _BILLION:  # "70B" models are 70.6B
        return GpuAllocation("A100-80GB", 4)
    return GpuAllocation("A100-80GB", 8)


# ---- fit --------------------------------------------------------------------------------------------

def lora_parameters(parameters: int, lora_r: int = LORA_DEFAULTS["r"], target_fraction: float | None = None,
                    targets: LoraTargets = ATTENTION_ONLY) -> int:
    """Trainable LoRA parameters, roughly: each targeted hidden×hidden matrix gains 2·r·hidden, and the unembedding
    (lm_head, [vocab, hidden]) gains r·(hidden + vocab). Its B is [vocab, r]: at r=32 that is 1.6M parameters on
    SmolLM2-135M against 3.7M for all its attention LoRA, and 4.2M on Llama-3.2-1B (vocab 128,256) against 6.8M:
    the same order as all of attention. It is counted whenever the unembedding is targeted (16 bytes a parameter
    with AdamW's state), with the catalogue's vocab_size or VOCAB_ESTIMATE."""
    if parameters <= 0:
        return 0
    dense = targets.experts.active_parameters if targets.experts else parameters  # attention is in the active share
    hidden = targets.experts.hidden if targets.experts else math.sqrt(parameters / PARAMS_PER_HIDDEN_SQUARED)
    targeted = dense * (targets.fraction if target_fraction is None else target_fraction)
    layers = int(min(targeted, targeted * 2 * lora_r / hidden))
    unembedding = lora_r * (hidden + (targets.vocab or VOCAB_ESTIMATE)) if targets.unembed else 0
    experts = targets.experts.lora_parameters(lora_r) if targets.experts and targets.mlp else 0
    return layers + int(unembedding) + experts


def layer_activation_values(hidden: int, intermediate: int) -> tuple[int, int]:
    """(values a decoder layer keeps a token for backward, values a recomputed one keeps: its input)."""
    return ACTIVATION_VALUES_PER_HIDDEN * hidden + ACTIVATION_VALUES_PER_INTERMEDIATE * intermediate, hidden


def pass_activation_bytes(layers: int, tokens: int, per_token: tuple[int, int], checkpointed: int = 0) -> int:
    """Bytes a pass of `tokens` tokens keeps for backward when `checkpointed` of its `layers` decoder layers are
    recomputed; `per_token`: one layer's (whole, recomputed) bytes a token."""
    full, kept = per_token
    return tokens * ((layers - checkpointed) * full + checkpointed * kept)


def estimated_pass_bytes(parameters: int, tokens: int = PASS_TOKENS, experts: ExpertShape | None = None) -> int:
    """The least a pass of `tokens` tokens keeps for backward: every decoder layer recomputed (its input kept, in
    bf16), the way compute/memory_fit.py checkpoints a pass that would not fit. From the catalogue's shape for a
    mixture of experts, else from the parameters (hidden ≈ √(parameters / 500), layers ≈ parameters / 12·hidden²)."""
    if parameters <= 0 or tokens <= 0:
        return 0
    if experts is not None:
        layers, hidden = experts.layers, experts.hidden
    else:
        hidden = max(1, round(math.sqrt(parameters / PARAMS_PER_HIDDEN_SQUARED)))
        layers = max(1, round(parameters / (PARAMS_PER_LAYER_HIDDEN_SQUARED * hidden * hidden)))
    return pass_activation_bytes(layers, tokens, (0, hidden * BYTES_PER_ACTIVATION), checkpointed=layers)


def estimate_bytes(parameters: int, quantization: str | None = None, lora_r: int = LORA_DEFAULTS["r"],
                   target_fraction: float | None = None, gpus: int = 1, runs: int = 1,
                   targets: LoraTargets = ATTENTION_ONLY, tokens: int = PASS_TOKENS) -> int:
    """GPU memory each of `gpus` GPUs needs for a pool of `runs` LoRA runs: its shard of the base weights (FSDP
    splits them evenly; a MoE model's every expert) + every run's LoRA with its AdamW state (replicated on each GPU;
    the unembedding's [vocab, r] B included when targeted, and on a MoE model every expert's A and B under
    train_mlp) + activations: a fixed margin plus the larger of a pass's activations at the token budget `tokens`
    (its rows split over the GPUs; `estimated_pass_bytes`) and a share of the active weights (the loss head's blocks
    and the allocator's slack grow with the model)."""
    per_weight = BYTES_PER_WEIGHT[parse_quantization(quantization)]
    weights = parameters * per_weight / gpus  # every expert's weights: all resident
    lora_state = lora_parameters(parameters, lora_r, target_fraction, targets) * LORA_STATE_BYTES * runs
    active = targets.experts.active_parameters if targets.experts else parameters  # what a token computes through
    pass_bytes = estimated_pass_bytes(parameters, math.ceil(tokens / gpus), targets.experts)
    activations = max(active * per_weight / gpus * ACTIVATION_FRACTION, pass_bytes) + ACTIVATION_FIXED_BYTES
    return int(weights + lora_state + activations)


def fits(allocation: GpuAllocation, parameters: int, quantization: str | None = None,
         lora_r: int = LORA_DEFAULTS["r"], runs: int = 1, targets: LoraTargets = ATTENTION_ONLY) -> bool:
    """Whether the allocation can serve the pool: a legal GPU count (one, if quantized) with room on each GPU."""
    if allocation.count not in LEGAL_COUNTS or (quantization and allocation.count > 1):
        return False
    need = estimate_bytes(parameters, quantization, lora_r, gpus=allocation.count, runs=runs, targets=targets)
    return need <= GPU_TYPES[allocation.gpu_type] * GB


def legal_counts(gpu_type: str, parameters: int, quantization: str | None = None, lora_r: int = LORA_DEFAULTS["r"],
                 runs: int = 1, targets: LoraTargets = ATTENTION_ONLY) -> list[int]:
    """The GPU counts of this type that hold the model (quantized bases train on one GPU only)."""
    most = _gpu(gpu_type).max_count
    return [n for n in LEGAL_COUNTS if n <= most and fits(GpuAllocation(gpu_type, n), parameters, quantization, lora_r, runs, targets)]


def smallest_fit(parameters: int, quantization: str | None = None, lora_r: int = LORA_DEFAULTS["r"],
                 max_count: int = MAX_GPUS, runs: int = 1, targets: LoraTargets = ATTENTION_ONLY) -> GpuAllocation | None:
    """The smallest configuration that holds the model: fewest GPUs first, then the smallest GPU."""
    for count in [n for n in LEGAL_COUNTS if n <= max_count]:
        for gpu in GPUS:
            candidate = GpuAllocation(gpu.name, count)
            if count <= gpu.max_count and fits(candidate, parameters, quantization, lora_r, runs, targets):
                return candidate
    return None


def smallest_single_gpu(parameters: int, quantization: str | None = None, lora_r: int = LORA_DEFAULTS["r"],
                        targets: LoraTargets = ATTENTION_ONLY) -> GpuAllocation | None:
    """The smallest single GPU that holds the model, or None when none does."""
    return smallest_fit(parameters, quantization, lora_r, max_count=1, targets=targets)


def check_fit(model_name: str, parameters: int, allocation: GpuAllocation | str, quantization: str | None = None,
              lora_r: int = LORA_DEFAULTS["r"], field: str = "gpuConfig", runs: int = 1,
              targets: LoraTargets = ATTENTION_ONLY) -> GpuAllocation:
    """The allocation, if it can hold the model (and `runs` runs' LoRA state); otherwise BadInput naming the legal
    GPU counts of that type and the smallest configuration that can."""
    allocation = parse_gpu_config(allocation, field=field)
    if fits(allocation, parameters, quantization, lora_r, runs, targets):
        return allocation
    smallest = smallest_fit(parameters, quantization, lora_r, runs=runs, targets=targets)
    remedy = f"the smallest that fits is {smallest}" if smallest else f"no configuration up to {MAX_GPUS} GPUs holds it"
    counts = legal_counts(allocation.gpu_type, parameters, quantization, lora_r, runs, targets)
    legal = (f"on {allocation.gpu_type} it fits with {_counts(counts)} GPU{'s' if counts != [1] else ''}" if counts
             else f"no count of {allocation.gpu_type} GPUs holds it")
    if allocation.count not in LEGAL_COUNTS:
        problem = f"a pool has {_counts(list(LEGAL_COUNTS))} GPUs, not {allocation.count}"
    elif quantization and allocation.count > 1:
        problem = f"a {quantization} base trains on one GPU, not {allocation.count}"
    else:
        need = estimate_bytes(parameters, quantization, lora_r, gpus=allocation.count, runs=runs, targets=targets)
        per_gpu = f"{GPU_TYPES[allocation.gpu_type]} GB per GPU" if allocation.count > 1 else f"{allocation.memory_gb} GB"
        problem = (f"{allocation} has {per_gpu} but {model_name} needs ~{_gb(need)} GB"
                   + (" on each" if allocation.count > 1 else "")
                   + f" ({_weights_kind(quantization)} weights, LoRA{_lora_kind(targets)} with AdamW state, activations)")
    raise BadInput(f"{problem}; {legal}; {remedy}", field=field)


def require_single_gpu(allocation: GpuAllocation | str, parameters: int, quantization: str | None = None,
                       lora_r: int = LORA_DEFAULTS["r"], field: str = "gpuConfig") -> GpuAllocation:
    """Modal pools run on one GPU until multi-GPU training (FSDP) lands; refuse a count above 1, naming the
    smallest single GPU that holds the model, or the quantization that would let one. Not applied locally."""
    allocation = parse_gpu_config(allocation, field=field)
    if allocation.count == 1:
        return allocation
    need = estimate_bytes(parameters, quantization, lora_r)
    single = smallest_single_gpu(parameters, quantization, lora_r)
    if single is not None:
        remedy = f"the smallest single GPU that holds it is {single} ({single.memory_gb} GB)"
    else:
        largest = GPUS[-1]
        remedy = f"no single GPU holds it (the largest, {largest.name}, has {largest.memory_gb} GB)"
        quantized = [(q, smallest_single_gpu(parameters, q, lora_r)) for q in QUANTIZATIONS]
        quantized_fit = [(q, gpu) for q, gpu in quantized if gpu is not None]
        if quantization is None and quantized_fit:
            q, gpu = quantized_fit[0]
            remedy += f"; with {q} quantization {gpu} does"
    raise BadInput(f"{allocation} asks for {allocation.count} GPUs, but Modal pools run on a single GPU for now; "
                   f"the model needs ~{_gb(need)} GB and {remedy}", field=field)


# ---- canonical spellings ----------------------------------------------------------------------------

def modal_gpu(allocation: GpuAllocation | str) -> str:
    """Modal's GPU string: "H100" for one, "H100:2" for several ("A10G" becomes Modal's "A10")."""
    allocation = parse_gpu_config(allocation)
    return allocation.gpu_type if allocation.count == 1 else str(allocation)


@dataclass(frozen=True)
class PoolKey:
    """A pool: the runs that share one base model, GPU configuration and quantization (on Modal, one container).
    It crosses the wire and names Modal's variants as its string, `base|GPU:count|quantization`."""

    base_model: str
    gpu: GpuAllocation
    quantization: str | None  # None: bf16 weights

    def __str__(self) -> str:
        return f"{self.base_model}|{self.gpu}|{self.quantization or 'none'}"

    @classmethod
    def of(cls, base_model: str, gpu: str, quantization: str | None) -> PoolKey:
        """The pool of runs on `base_model` with that GPU configuration and quantization, each checked."""
        if not base_model or "|" in base_model:
            raise BadInput(f"base model {base_model!r} cannot name a pool", field="baseModel")
        return cls(base_model, parse_gpu_config(gpu), parse_quantization(quantization))

    @classmethod
    def parse(cls, key: str) -> PoolKey:
        parts = key.split("|")
        if len(parts) != 3 or not parts[0]:
            raise BadInput(f"{key!r} is not a pool key (base model|GPU configuration|quantization)", field="pool")
        return cls(parts[0], parse_gpu_config(parts[1], field="gpuConfig"), parse_quantization(parts[2]))


def pool_key(base_model: str, gpu: str, quantization: str | None) -> str:
    """The one canonical spelling of a pool (base model, GPU configuration, quantization).

    Modal scales each distinct parameter set as its own variant, so "h100", "H100" and "H100:1" must agree.
    """
    return str(PoolKey.of(base_model, gpu, quantization))


def _gpu(name: str) -> GpuType:
    return next(gpu for gpu in GPUS if gpu.name == name)


def _counts(counts: list[int]) -> str:
    return ", ".join(map(str, counts[:-1])) + (" or " if len(counts) > 1 else "") + str(counts[-1])


def _gb(nbytes: int) -> str:
    return f"{nbytes / GB:.1f}"


def _lora_kind(targets: LoraTargets) -> str:
    """What the LoRA share counts beyond attention: said, since the unembedding's B alone is [vocab, r]."""
    extra = [name for name, on in (("MLP", targets.mlp), ("unembedding", targets.unembed)) if on]
    return f" (with {' and '.join(extra)})" if extra else ""


def _weights_kind(quantization: str | None) -> str:
    return "bf16" if quantization is None else quantization
