"""GraphQL input types. Batch items are typed, so an unknown key is refused with its item index."""

from __future__ import annotations

import strawberry

from app.services.runs import RunSpec
from app.tables import RUN_NAME_LENGTH, RUN_NOTE_LENGTH, RUN_TAG_LENGTH, RUN_TAGS_MOST
from gpu_runtime import contract
from gpu_runtime.contract import ADAM_DEFAULTS, DATUM_INPUTS, LORA_DEFAULTS
from gpu_runtime.contract.json_types import JSONObject


@strawberry.input
class CreateRunInput:
    base_model: str | None = strawberry.field(default=None, description="Catalogue name; default: the server's")
    lora_r: int | None = strawberry.field(
        default=None, description=f"Default: {LORA_DEFAULTS['r']} (from a checkpoint: the checkpoint's)")
    lora_alpha: float | None = strawberry.field(default=None, description="Default: 2 * loraR")
    lora_dropout: float | None = strawberry.field(
        default=None, description=f"Default: {LORA_DEFAULTS['dropout']} (from a checkpoint: the checkpoint's)")
    lora_target_modules: list[str] | None = strawberry.field(
        default=None, description="Layer names; or the three switches below, not both. Default: attention projections")
    train_attn: bool | None = strawberry.field(
        default=None, description=f"LoRA on the attention projections (default: {str(LORA_DEFAULTS['train_attn']).lower()})")
    train_mlp: bool | None = strawberry.field(
        default=None, description=f"LoRA on the MLP: gate, up, down (default: {str(LORA_DEFAULTS['train_mlp']).lower()})")
    train_unembed: bool | None = strawberry.field(
        default=None, description="LoRA on the unembedding, lm_head; on tied embeddings the output side only (default: "
                                  f"{str(LORA_DEFAULTS['train_unembed']).lower()})")
    learning_rate: float = ADAM_DEFAULTS["learning_rate"]
    weight_decay: float = ADAM_DEFAULTS["weight_decay"]
    grad_clip_norm: float = strawberry.field(default=ADAM_DEFAULTS["grad_clip_norm"],
                                             description="0 turns clipping off")
    seed: int | None = strawberry.field(default=None, description="Default: 0 (from a checkpoint: the checkpoint's)")
    from_checkpoint: str | None = strawberry.field(
        default=None, description="signal://<runId>/<kind>/<name> (a Checkpoint's path): start from it, inheriting "
        "its base model, seed, step and LoRA settings; LoRA settings or a seed given too must agree")
    with_optimizer: bool = strawberry.field(default=True, description="With fromCheckpoint: its AdamW state too")
    gpu_config: str | None = strawberry.field(default=None, description='e.g. "L40S:2"; default: allocation rules')
    quantization: str | None = strawberry.field(
        default=None, description='"8bit" or "4bit" (NF4, bitsandbytes) on one GPU; default: none (bf16)')
    name: str | None = strawberry.field(
        default=None, description=f"At most {RUN_NAME_LENGTH} characters, not unique; default: the base model's "
        "short name and the UTC minute")
    tags: list[str] | None = strawberry.field(
        default=None, description=f"At most {RUN_TAGS_MOST}, of {RUN_TAG_LENGTH} characters each")
    note: str | None = strawberry.field(default=None, description=f"At most {RUN_NOTE_LENGTH} characters")

    def to_spec(self) -> RunSpec:
        return RunSpec(
            base_model=self.base_model, lora_r=self.lora_r, lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout, lora_target_modules=self.lora_target_modules,
            train_attn=self.train_attn, train_mlp=self.train_mlp, train_unembed=self.train_unembed,
            learning_rate=self.learning_rate, weight_decay=self.weight_decay, grad_clip_norm=self.grad_clip_norm,
            seed=self.seed, gpu_config=self.gpu_config, quantization=self.quantization,
            from_checkpoint=self.from_checkpoint, with_optimizer=self.with_optimizer,
            name=self.name, tags=self.tags, note=self.note,
        )


@strawberry.input
class MessageInput:
    role: str
    content: str


@strawberry.input(description="A datum's per-position inputs, each as long as modelInput (Tinker's loss_fn_inputs)")
class LossFnInputs:
    target_tokens: list[int] = strawberry.field(description="Position i predicts targetTokens[i]: already shifted")
    weights: list[float] | None = strawberry.field(default=None, description="Per-position weights (cross_entropy)")
    advantages: list[float] | None = None
    logprobs: list[float] | None = strawberry.field(default=None, description="The sampler's logprobs (RL losses)")
    clip_low_threshold: list[float] | None = strawberry.field(
        default=None, description="Per-position clip thresholds (ppo, cispo); win over lossFnConfig")
    clip_high_threshold: list[float] | None = None
    sequence_ratio_mask: list[float] | None = strawberry.field(
        default=None, description="The positions gspo's sequence ratio spans (default: those that count)")

    def to_dict(self) -> dict[str, list[float]]:
        return {name: value for name in DATUM_INPUTS if (value := getattr(self, name)) is not None}


@strawberry.input(description="A datum with each list as one base64 string (little-endian int32 token ids, float32 "
                  "values): for large batches, GraphQL coerces a string at once and a typed list element by element")
class PackedDatum:
    model_input: str
    target_tokens: str
    weights: str | None = None
    advantages: str | None = None
    logprobs: str | None = None
    clip_low_threshold: str | None = None
    clip_high_threshold: str | None = None
    sequence_ratio_mask: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {name: value for name in ("model_input", *DATUM_INPUTS) if (value := getattr(self, name)) is not None}


@strawberry.input(description="One training example; set exactly one of the formats")
class BatchItem:
    text: str | None = strawberry.field(default=None, description="Loss on every token")
    input: str | None = strawberry.field(default=None, description="Prompt; with output, loss on output only")
    output: str | None = None
    messages: list[MessageInput] | None = strawberry.field(default=None, description="Chat; loss on assistant turns")
    tokens: list[int] | None = strawberry.field(default=None, description="Token ids, with weights")
    weights: list[float] | None = None
    logprobs: list[float] | None = strawberry.field(
        default=None, description="The sampler's per-token logprobs (importance_sampling)")
    advantages: list[float] | None = strawberry.field(default=None, description="Per-token advantages (importance_sampling)")
    model_input: list[int] | None = strawberry.field(
        default=None, description="A datum's input token ids (N), with lossFnInputs: Tinker's token-level form")
    loss_fn_inputs: LossFnInputs | None = None
    packed: PackedDatum | None = strawberry.field(default=None, description="A datum in base64 (rewardsignal.pack_datum)")

    def to_item(self, where: str) -> contract.BatchItem:
        """The contract's item, built directly from the one format set; several formats at once (or half of one)
        go through the contract's reader of JSON items, so the error names the field as on every wire."""
        given = {key for key in ("text", "input", "output", "messages", "tokens", "weights", "logprobs", "advantages",
                                 "model_input", "loss_fn_inputs", "packed") if getattr(self, key) is not None}
        item: contract.BatchItem
        if given == {"text"}:
            item = contract.TextItem(str(self.text))
        elif given and given <= {"input", "output"}:
            item = contract.PromptCompletion(self.input, self.output)
        elif given == {"messages"} and self.messages is not None:
            item = contract.ChatItem([contract.Message(m.role, m.content) for m in self.messages])
        elif "tokens" in given and given <= contract.TOKEN_KEYS and self.tokens is not None:
            item = contract.TokensItem(self.tokens, self.weights, self.logprobs, self.advantages)
        elif given == {"model_input", "loss_fn_inputs"} and self.model_input is not None and self.loss_fn_inputs:
            item = contract.DatumItem(self.model_input, self.loss_fn_inputs.to_dict())
        elif given == {"packed"} and self.packed is not None:
            item = contract.PackedItem(self.packed.to_dict())
        else:
            return contract.item_from_dict(self.to_dict(), where)
        item.check(where)
        return item

    def to_dict(self) -> JSONObject:
        """The item as JSON carries it (what the contract's reader takes)."""
        item: JSONObject = {}
        for key in ("text", "input", "output", "tokens", "weights", "logprobs", "advantages"):
            value = getattr(self, key)
            if value is not None:
                item[key] = value
        if self.messages is not None:
            item["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        if self.model_input is not None:
            item["model_input"] = self.model_input
        if self.loss_fn_inputs is not None:
            item["loss_fn_inputs"] = self.loss_fn_inputs.to_dict()
        if self.packed is not None:
            item["packed"] = self.packed.to_dict()
        return item


def batch_items(batch: list[BatchItem]) -> list[contract.BatchItem]:
    """A GraphQL batch as the contract's items; an error names its item (`batch[3].messages[0].role`)."""
    return [item.to_item(f"batch[{i}]") for i, item in enumerate(batch)]


@strawberry.input(description="AdamW settings for this step; unset fields use the run's defaults")
class AdamInput:
    learning_rate: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    grad_clip_norm: float | None = strawberry.field(default=None, description="0 turns clipping off")

    def to_dict(self) -> dict[str, float]:
        names = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
