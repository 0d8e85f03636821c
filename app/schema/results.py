"""GraphQL types of what the calls answer: forwardBackward, forward, optimStep, sample, loadState,
saveWeightsForSampler; each built from an engine result."""

from __future__ import annotations

import strawberry

from gpu_runtime import contract
from gpu_runtime.contract import RenderedDatum


@strawberry.type(description="What loadState did: the run's step is the checkpoint's now")
class LoadStateResult:
    checkpoint: str
    step: int
    with_optimizer: bool
    pending_dropped: int = strawberry.field(description="forwardBackward calls pending before the load, now gone")


@strawberry.type(description="One datum's per-position values, each as long as its modelInput")
class DatumOutput:
    logprobs: list[float] = strawberry.field(description="log p(targetTokens[i]) under the weights that ran, at T=1")
    elementwise_loss: list[float]


def datum_outputs(outputs: list[dict[str, list[float]]] | None) -> list[DatumOutput] | None:
    if outputs is None:
        return None
    return [DatumOutput(logprobs=o["logprobs"], elementwise_loss=o["elementwise_loss"]) for o in outputs]


@strawberry.type
class ForwardBackwardResult:
    loss: float = strawberry.field(description='reduction "mean": the loss per counted position; "sum": the raw sum')
    num_tokens: int
    num_examples: int
    step: int
    reduction: str
    outputs: list[DatumOutput] | None = strawberry.field(
        default=None, description="Per datum, per position; computed only when selected. A retried call's answer has none")


@strawberry.type
class ForwardResult:
    loss: float = strawberry.field(description="The loss per counted position (a mean)")
    loss_sum: float
    num_tokens: int
    num_examples: int
    step: int | None = strawberry.field(description="The run's step whose weights ran; null for a base model")
    outputs: list[DatumOutput]


@strawberry.type(description="A datum's per-position inputs, as the server renders them")
class DatumInputs:
    target_tokens: list[int]
    weights: list[float] | None = None
    advantages: list[float] | None = None
    logprobs: list[float] | None = None
    clip_low_threshold: list[float] | None = None
    clip_high_threshold: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None


@strawberry.type(description="A datum at token level (Tinker's shape): position i predicts targetTokens[i]")
class Datum:
    model_input: list[int]
    loss_fn_inputs: DatumInputs

    @classmethod
    def from_dict(cls, datum: RenderedDatum) -> Datum:
        return cls(model_input=list(datum["model_input"]), loss_fn_inputs=DatumInputs(**datum["loss_fn_inputs"]))


@strawberry.type
class OptimStepResult:
    step: int
    grad_norm: float
    learning_rate: float


@strawberry.type(description="A token and the model's logprob of it")
class TokenLogprob:
    token: int
    logprob: float

    @classmethod
    def pairs(cls, pairs: list[list[float]] | None) -> list[TokenLogprob] | None:
        return None if pairs is None else [cls(token=int(t), logprob=float(v)) for t, v in pairs]


@strawberry.type
class SampledSequence:
    text: str = strawberry.field(description="The decoded tokens, cut before a stop string, stop token or EOS")
    tokens: list[int] = strawberry.field(description="Sampled token ids, the stop token (or the one completing a "
                                         "stop string) included")
    logprobs: list[float] = strawberry.field(
        description="Each token's logprob under the unmodified model (temperature 1, no top-k/top-p): what a "
        "teacher-forced forward returns, so samples at another temperature are off-policy (docs/SAMPLING.md)")
    stop_reason: str = strawberry.field(description="stop (a stop or EOS) or length (maxTokens)")
    topk_logprobs: list[list[TokenLogprob]] | None = strawberry.field(
        default=None, description="Per token, the topkSampleLogprobs most likely tokens, most likely first")


@strawberry.type(description="A frozen copy of a run's weights to sample from (docs/SNAPSHOTS.md)")
class SamplerSnapshot:
    run_id: strawberry.ID
    name: str = strawberry.field(description="Pass it as sample's `snapshot` with the run's id")
    step: int = strawberry.field(description="The run's step when it was frozen")
    named: bool = strawberry.field(description="Named: kept on disk, listed and downloadable; unnamed: expires")
    expires_in_seconds: float | None = strawberry.field(description="Unnamed only: seconds until it expires")

    @classmethod
    def from_result(cls, result: contract.SaveWeightsForSamplerResult) -> SamplerSnapshot:
        return cls(run_id=strawberry.ID(result.run_id), name=result.name, step=result.step, named=result.named,
                   expires_in_seconds=result.expires_in_seconds)


@strawberry.type
class SampleResult:
    outputs: list[str] = strawberry.field(description="The first sample of each prompt, in prompt order")
    sequences: list[list[SampledSequence]]
    prompt_tokens: list[list[int]] = strawberry.field(description="Each prompt's token ids, as the model saw them")
    step: int = strawberry.field(description="The run's step (optim_steps applied) whose weights sampled")
    prompt_logprobs: list[list[float | None]] | None = strawberry.field(
        default=None, description="With promptLogprobs: per prompt, each prompt token's logprob (null at position 0)")
    topk_prompt_logprobs: list[list[list[TokenLogprob] | None]] | None = strawberry.field(
        default=None, description="With topkPromptLogprobs: per prompt, per position, the most likely tokens, most "
        "likely first (null at position 0)")
    prompt_cache_hit_tokens: int = strawberry.field(
        default=0, description="Prompt tokens already in the decode cache (a prefix sent before), not prefilled again: "
        "summed over prompts, once per prompt whatever its numSamples")

    @classmethod
    def from_result(cls, result: contract.SampleResult) -> SampleResult:
        topk_prompt = result.topk_prompt_logprobs
        return cls(
            outputs=list(result.outputs),
            prompt_tokens=[list(ids) for ids in result.prompt_tokens],
            step=result.step,
            sequences=[
                [SampledSequence(text=s.text, tokens=list(s.tokens), logprobs=[float(x) for x in s.logprobs],
                                 stop_reason=s.stop_reason,
                                 topk_logprobs=None if s.topk_logprobs is None else
                                 [TokenLogprob.pairs(p) or [] for p in s.topk_logprobs])
                 for s in per_prompt]
                for per_prompt in result.sequences
            ],
            prompt_logprobs=result.prompt_logprobs,
            prompt_cache_hit_tokens=result.prompt_cache_hit_tokens,
            topk_prompt_logprobs=None if topk_prompt is None else
            [[TokenLogprob.pairs(p) for p in per_prompt] for per_prompt in topk_prompt],
        )
