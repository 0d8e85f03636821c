"""GraphQL types of what this server offers: the catalogue's base models, their tokenizers, its call limits.

Parameter counts are Floats: GraphQL's Int is 32-bit and a 70B model does not fit.
"""

from __future__ import annotations

import strawberry

from app.catalog import CatalogModel
from gpu_runtime import contract


@strawberry.type(name="BaseModel")
class ModelInfo:
    name: str
    family: str
    parameters: float
    gpu: str = strawberry.field(description="GPU allocation the rules pick for it, e.g. L40S:1")
    offline: bool = strawberry.field(description="Ships with Signal; needs no download")
    description: str
    context_length: int | None = strawberry.field(description="Context window in tokens; null when unknown")
    framework: str = strawberry.field(description="What trains it: transformers, or unsloth (CUDA only)")
    quantization_allowed: bool = strawberry.field(description="Whether its base may be loaded in 8 or 4 bits")
    quantized: str | None = strawberry.field(description='"4bit" / "8bit" when its published weights already are')
    available: bool = strawberry.field(description="Whether runs can be created on it on this server")
    unavailable_reason: str | None = strawberry.field(description="Why not, when it is unavailable")
    estimated_memory_gb: float = strawberry.field(
        description="GPU memory a run needs at the default LoRA rank: bf16 weights, LoRA with AdamW state, activations")

    @classmethod
    def from_catalog(cls, model: CatalogModel) -> ModelInfo:
        return cls(name=model.name, family=model.family, parameters=float(model.parameters), gpu=model.gpu,
                   offline=model.offline, description=model.description, context_length=model.context_length,
                   framework=model.framework, quantization_allowed=model.quantization_allowed, quantized=model.quantized,
                   available=model.available, unavailable_reason=model.unavailable,
                   estimated_memory_gb=model.estimated_memory_gb)


@strawberry.type(description="What this server accepts in one call")
class Limits:
    max_batch_size: int = strawberry.field(description="Most items one forwardBackward carries (SIGNAL_MAX_BATCH_SIZE)")


@strawberry.type(description="A base model's tokenizer: what a client without it needs for token-level calls")
class TokenizerInfo:
    name: str = strawberry.field(description="The name or path the tokenizer loads from")
    vocab_size: int = strawberry.field(description="Token ids are 0..vocabSize-1")
    eos_token_ids: list[int] = strawberry.field(description="The ids that stop sampling when stop is omitted")
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template: str | None = strawberry.field(description="Its Jinja chat template, if it has one")

    @classmethod
    def from_result(cls, result: contract.TokenizerResult) -> TokenizerInfo:
        return cls(name=result.name, vocab_size=result.vocab_size, eos_token_ids=list(result.eos_token_ids),
                   bos_token_id=result.bos_token_id, pad_token_id=result.pad_token_id,
                   chat_template=result.chat_template)
