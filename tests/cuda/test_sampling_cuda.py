"""sample() on CUDA: seeded draws repeat, results have their shape, logprobs are the model's own (sampled and the
prompt's, with the prefill repeated for several samples), co-batched decoding equals decoding alone, and sampling
leaves the training state alone."""

from __future__ import annotations

from typing import Any

import torch

from gpu_runtime.engine.engine import Engine
from tests.cuda.cuda_tools import requires_cuda, teacher_forced_logprobs, weights
from tests.helpers.engine_tools import BATCH, result_of, submit

pytestmark = requires_cuda
PROMPTS = ["hello", "The capital of France is"]
# A sampled token's logprob from the batched, left-padded, KV-cached decode against one plain unpadded pass of the
# same tokens: bf16 activations along two routes, on log-probabilities of ~10 (the tiny model's vocabulary is 49k).
LOGPROB_ABS = 0.1


def trained(engine: Engine, model: str, run_id: str, seed: int) -> str:
    engine.create_run(run_id, "u", model, {"r": 4, "alpha": 8}, seed=seed)
    engine.forward_backward(run_id, BATCH)
    engine.optim_step(run_id, {"learning_rate": 5e-2})  # a step, so the adapter changes the logits
    return run_id


def test_seeded_sampling_repeats_and_greedy_is_deterministic(cuda_engine: Engine, tiny_model_dir: str) -> None:
    run = trained(cuda_engine, tiny_model_dir, "r", seed=1)
    a = cuda_engine.sample(run, PROMPTS, max_tokens=8, seed=11)
    b = cuda_engine.sample(run, PROMPTS, max_tokens=8, seed=11)
    assert a["sequences"] == b["sequences"]
    greedy = [cuda_engine.sample(run, PROMPTS, max_tokens=8, temperature=0, seed=s)["sequences"] for s in (1, 2)]
    assert greedy[0] == greedy[1]
    result = cuda_engine.sample(run, PROMPTS, max_tokens=5, num_samples=3, seed=0)
    assert [len(s) for s in result["sequences"]] == [3, 3]
    for prompt_sequences in result["sequences"]:
        for seq in prompt_sequences:
            assert len(seq["tokens"]) == len(seq["logprobs"]) == 5 and seq["stop_reason"] == "length"
            assert all(lp <= 0 for lp in seq["logprobs"])


def test_logprobs_are_the_models_own_for_each_token(cuda_engine: Engine, tiny_model_dir: str) -> None:
    run = trained(cuda_engine, tiny_model_dir, "r", seed=2)
    result = cuda_engine.sample(run, PROMPTS, max_tokens=6, seed=5)
    for prompt, sequences in zip(result["prompt_tokens"], result["sequences"]):
        seq = sequences[0]
        expected = teacher_forced_logprobs(cuda_engine, run, prompt, seq["tokens"])
        error = (torch.tensor(seq["logprobs"]) - expected).abs().max().item()
        assert error <= LOGPROB_ABS, f"sampled logprobs off the model's by {error:.3g}"


def test_repeated_prefill_and_prompt_logprobs_are_the_models_own(cuda_engine: Engine, tiny_model_dir: str) -> None:
    # Each prompt prefilled once and its cache repeated for 3 samples; the prompt's logprobs from the chunked head.
    run = trained(cuda_engine, tiny_model_dir, "r", seed=7)
    result = cuda_engine.sample(run, ["The capital of France is"], max_tokens=6, num_samples=3, temperature=0.7,
                                seed=5, prompt_logprobs=True)
    prompt = result["prompt_tokens"][0]
    for seq in result["sequences"][0]:
        expected = teacher_forced_logprobs(cuda_engine, run, prompt, seq["tokens"])
        assert (torch.tensor(seq["logprobs"]) - expected).abs().max().item() <= LOGPROB_ABS
    scores = result["prompt_logprobs"][0]
    assert len(scores) == len(prompt) and scores[0] is None
    expected = teacher_forced_logprobs(cuda_engine, run, prompt[:1], prompt[1:])
    assert (torch.tensor(scores[1:]) - expected).abs().max().item() <= LOGPROB_ABS


def test_two_runs_decode_in_shared_passes_as_each_alone(cuda_engine: Engine, tiny_model_dir: str) -> None:
    runs = [trained(cuda_engine, tiny_model_dir, "a", seed=3), trained(cuda_engine, tiny_model_dir, "d", seed=4)]
    prompt: dict[str, Any] = {"prompts": ["The quick brown fox"], "max_tokens": 6, "temperature": 0}
    futures = {run: submit(cuda_engine, "sample", run_id=run, **prompt) for run in runs}
    for _ in range(50):  # bounded: a prefill and five decode passes
        if all(f.done() for f in futures.values()):
            break
        cuda_engine.tick()
    together = {run: result_of(f)["sequences"][0][0] for run, f in futures.items()}
    for run in runs:
        alone = cuda_engine.sample(run, **prompt)["sequences"][0][0]
        # Greedy tokens agree up to a tie of two logits within bf16's rounding; their logprobs agree to it.
        shared = next((i for i, (x, y) in enumerate(zip(alone["tokens"], together[run]["tokens"])) if x != y), 6)
        assert shared >= 1, "the first greedy token differs between a shared decode and one alone"
        error = (torch.tensor(alone["logprobs"][:shared]) - torch.tensor(together[run]["logprobs"][:shared])).abs().max()
        assert error.item() <= LOGPROB_ABS


def test_sampling_leaves_training_state_untouched(cuda_engine: Engine, tiny_model_dir: str) -> None:
    run = trained(cuda_engine, tiny_model_dir, "r", seed=6)
    cuda_engine.forward_backward(run, BATCH)  # pending gradients
    before = weights(cuda_engine, run)
    grads = [p.grad.detach().clone() for p in cuda_engine.runs[run].parameters() if p.grad is not None]
    cuda_engine.sample(run, PROMPTS, max_tokens=4, seed=0)
    after = weights(cuda_engine, run)
    assert all(torch.equal(before[n], after[n]) for n in before)
    now = [p.grad for p in cuda_engine.runs[run].parameters() if p.grad is not None]
    assert len(now) == len(grads) and all(torch.equal(g, h) for g, h in zip(grads, now))
    assert cuda_engine.optim_step(run, {"learning_rate": 1e-2})["step"] == 2
