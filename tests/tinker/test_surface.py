"""Tinker 0.38's surface beyond the basics, through the real SDK (docs/TINKER.md): sampling's top-k and target prompt
logprobs against Signal's own sample and forward, cross_entropy's (N, K) soft targets in one pass with hard ones,
and publishing a checkpoint to other users."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.live_server import TINY_MODEL, LiveServer
from tests.tinker.test_wire import TOKENS, as_list

PROMPT = TOKENS[:6]
SEED = 11

SIGNAL_SAMPLE = """mutation($model: String!, $prompt: [[Int!]!]!, $seed: Int!) {
  sample(baseModel: $model, promptTokens: $prompt, maxTokens: 4, temperature: 1.0, seed: $seed, promptLogprobs: true,
         topkPromptLogprobs: 5, topkSampleLogprobs: 3) {
    sequences { tokens logprobs topkLogprobs { token logprob } }
    promptLogprobs topkPromptLogprobs { token logprob } } }"""
SIGNAL_FORWARD = """mutation($model: String!, $batch: [BatchItem!]!) {
  forward(baseModel: $model, batch: $batch) { outputs { logprobs } } }"""


@pytest.fixture(scope="module")
def secret(tinker_key: str) -> str:
    return tinker_key.removeprefix("tml-")


@pytest.fixture(scope="module")
def sampler(service_client: Any) -> Any:
    return service_client.create_sampling_client(base_model=TINY_MODEL).result()


def tinker_sample(sampler: Any, **extras: Any) -> Any:
    from tinker import types

    return sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=SEED),
                          **extras).result()


def signal_forward(live_server: LiveServer, secret: str, targets: list[list[int]]) -> list[list[float]]:
    """Signal's own forward on the base: one datum per target column, each position's logprob of its target."""
    batch = [{"modelInput": PROMPT[:-1], "lossFnInputs": {"targetTokens": column}} for column in targets]
    answer = live_server.graphql(SIGNAL_FORWARD, {"model": TINY_MODEL, "batch": batch}, key=secret)
    assert "errors" not in answer, answer
    return [output["logprobs"] for output in answer["data"]["forward"]["outputs"]]


def test_topk_sample_and_prompt_logprobs_equal_signals_own_sample(live_server: LiveServer, secret: str,
                                                                  sampler: Any) -> None:
    got = tinker_sample(sampler, include_prompt_logprobs=True, topk_prompt_logprobs=5, topk_sample_logprobs=3)
    answer = live_server.graphql(SIGNAL_SAMPLE, {"model": TINY_MODEL, "prompt": [PROMPT], "seed": SEED}, key=secret)
    assert "errors" not in answer, answer
    own = answer["data"]["sample"]
    (sequence,), (expected,) = got.sequences, own["sequences"][0]
    assert sequence.tokens == expected["tokens"]  # the same seed on the same weights: the same draw
    assert sequence.logprobs == pytest.approx(expected["logprobs"], abs=1e-4)
    assert len(sequence.topk_logprobs) == len(sequence.tokens)
    for mine, theirs in zip(sequence.topk_logprobs, expected["topkLogprobs"]):
        assert [t for t, _ in mine] == [c["token"] for c in theirs]
        assert [v for _, v in mine] == pytest.approx([c["logprob"] for c in theirs], abs=1e-4)
    assert got.prompt_logprobs[0] is None and got.topk_prompt_logprobs[0] is None  # nothing predicts position 0
    assert got.prompt_logprobs[1:] == pytest.approx(own["promptLogprobs"][0][1:], abs=1e-4)
    for mine, theirs in zip(got.topk_prompt_logprobs[1:], own["topkPromptLogprobs"][0][1:]):
        assert len(mine) == 5 and [t for t, _ in mine] == [c["token"] for c in theirs]
        assert [v for _, v in mine] == pytest.approx([c["logprob"] for c in theirs], abs=1e-4)


def test_target_prompt_logprobs_equal_signals_forward_dense_and_sparse(live_server: LiveServer, secret: str,
                                                                       sampler: Any) -> None:
    import torch
    from tinker import types

    rows = len(PROMPT) - 1
    ids = torch.tensor([[PROMPT[i + 1], 7 + i, 300 + i] for i in range(rows)], dtype=torch.int64)
    ids[1, 2] = -1  # asks for nothing: 0.0 back
    got = tinker_sample(sampler, include_prompt_logprobs=True,
                        target_prompt_logprobs=types.TensorData.from_torch(ids))
    dense = got.target_prompt_logprobs.to_torch()
    assert list(dense.shape) == [rows, 3]
    columns = signal_forward(live_server, secret, [[max(int(v), 0) for v in ids[:, k]] for k in range(3)])
    for k in range(3):
        expected = [0.0 if ids[i, k] < 0 else columns[k][i] for i in range(rows)]
        assert dense[:, k].tolist() == pytest.approx(expected, abs=1e-4)
    assert dense[:, 0].tolist() == pytest.approx(got.prompt_logprobs[1:], abs=1e-4)  # column 0 is the prompt itself
    # Sparse: only the listed cells ask; the answer keeps the layout.
    sparse_ids = torch.full((rows, 3), -1, dtype=torch.int64)
    sparse_ids[0, 1], sparse_ids[3, 2] = ids[0, 1], ids[3, 2]
    sparse = tinker_sample(sampler, target_prompt_logprobs=types.TensorData.from_torch_sparse(sparse_ids, pad_value=-1))
    assert sparse.target_prompt_logprobs.sparse_crow_indices is not None
    values = sparse.target_prompt_logprobs.to_torch().to_dense()
    assert float(values[0, 1]) == pytest.approx(float(dense[0, 1]), abs=1e-4)
    assert float(values[3, 2]) == pytest.approx(float(dense[3, 2]), abs=1e-4)


def test_prompt_logprobs_last_n_leaves_the_earlier_positions_out(sampler: Any) -> None:
    got = tinker_sample(sampler, include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=2)
    whole = tinker_sample(sampler, include_prompt_logprobs=True)
    assert got.prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert got.prompt_logprobs[-2:] == pytest.approx(whole.prompt_logprobs[-2:], abs=1e-6)
    assert got.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2) and all(got.topk_prompt_logprobs[-2:])


@pytest.mark.parametrize(("extras", "field"), [
    ({"topk_sample_logprobs": 21}, "topk_sample_logprobs"),
    ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)}, "prompt_logprobs_last_n"),
])
def test_an_extra_it_cannot_serve_or_out_of_bounds_is_a_user_error_naming_it(sampler: Any, extras: dict[str, Any],
                                                                             field: str) -> None:
    import tinker

    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError)) as caught:  # 400 at submit, or a user failure
        tinker_sample(sampler, **extras)
    assert field in str(caught.value)


# ---- soft targets ---------------------------------------------------------------------------------------------


def test_soft_targets_beside_a_hard_datum_score_the_weighted_sum_of_forwards_logprobs(service_client: Any) -> None:
    import torch
    from tinker import types

    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=2).result()
    n, k = len(PROMPT) - 1, 3
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, 400, (n, k), generator=g)
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)
    weights[0] = 0.0  # a prompt position, as the cookbook zeroes them
    soft = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData.from_torch(ids),
                                       "weights": types.TensorData.from_torch(weights)})
    hard = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                       loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * n})  # type: ignore[dict-item]  # Datum converts lists
    columns = training.forward([types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                                            loss_fn_inputs={"target_tokens": ids[:, j].tolist()})  # type: ignore[dict-item]
                                for j in range(k)], "cross_entropy").result()
    logp = torch.tensor([as_list(out["logprobs"]) for out in columns.loss_fn_outputs]).T  # [n, k]
    hard_logp = as_list(training.forward([hard], "cross_entropy").result().loss_fn_outputs[0]["logprobs"])
    out = training.forward_backward([soft, hard], "cross_entropy").result()  # one call: one pass
    per_position = (weights * logp).sum(-1)
    assert as_list(out.loss_fn_outputs[0]["logprobs"]) == pytest.approx(per_position.tolist(), abs=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(float(-per_position.sum()) - sum(hard_logp), rel=1e-5)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_soft_targets_for_another_loss_are_a_user_error_naming_the_field(service_client: Any) -> None:
    import tinker
    import torch
    from tinker import types

    training = service_client.create_lora_training_client(base_model=TINY_MODEL, rank=4, seed=2).result()
    n = len(PROMPT) - 1
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_torch(torch.ones(n, 2, dtype=torch.int64)),
        "weights": types.TensorData.from_torch(torch.ones(n, 2)),
        "logprobs": [-1.0] * n, "advantages": [1.0] * n})  # type: ignore[dict-item]
    with pytest.raises(tinker.RequestFailedError) as caught:
        training.forward_backward([datum], "importance_sampling").result()
    assert "target_tokens" in str(caught.value) and "cross_entropy" in str(caught.value)
