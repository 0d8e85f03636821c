"""Multi-GPU pools on 2 CPU ranks over gloo (issue 10 §2): the base sharded by FSDP, rows split across the
ranks, and the same losses, gradients and weights as one process; a rank that dies or hangs stops the group,
its call fails WORKER_FAILED, and the pool restarts with nothing acknowledged lost.

One sharded engine serves the whole module (starting ranks costs seconds); each test uses runs of its own.
The reference is a single-process engine doing the same calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu_runtime.contract import batch_from_dicts
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import WorkerFailed
from tests.helpers.engine_tools import BATCH, assert_same_grads, assert_same_weights, lora_weights, result_of, submit

# AdamW's first steps divide a gradient by its own magnitude: where it is ~eps, fp32 noise of 1e-7 becomes 1e-5
# of the update. Gradients are compared at 1e-5 of their scale; weights after AdamW at this.
WEIGHTS_REL = 2e-4
LORA = {"r": 4, "alpha": 8, "dropout": 0.1}  # dropout on: each rank slices the masks drawn at the whole call's shape
TIMEOUT_S = 8  # a collective waiting longer means a hung rank (the hang test waits this long)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    engine = Engine(tmp_path_factory.mktemp("sharded"), device="cpu", local_ranks=2, rank_timeout_seconds=TIMEOUT_S)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine(tmp_path_factory.mktemp("single"), device="cpu")


def create(engines: list[Engine], run_id: str, model: str, seed: int = 1, lora: dict[str, Any] | None = None) -> None:
    for engine in engines:
        engine.create_run(run_id, "u1", model, lora or LORA, seed=seed)


def grads(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in engine.runs[run_id].named_parameters().items() if p.grad is not None}


def outcome(result: dict[str, Any]) -> dict[str, Any]:
    """A result's counts exactly; its loss and gradient norm to fp32 tolerance (sums in another order)."""
    rounded = {k: pytest.approx(result[k], rel=1e-5) for k in ("loss", "grad_norm") if k in result}
    return {k: v for k, v in result.items() if k not in ("compute_seconds", "replayed", "loss", "grad_norm")} | rounded


def test_each_rank_holds_half_the_base_and_processes_its_own_rows(sharded: Engine, tiny_model_dir: str) -> None:
    create([sharded], "halves", tiny_model_dir)
    sharded.forward_backward("halves", BATCH)
    assert sharded.ranks is not None
    ranks = sharded.ranks.report(sharded.residency)
    params = sharded.residency.bases[tiny_model_dir].params
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"]
    # fp32, dim 0 of every weight split in two (every dim 0 here is even): exactly half each.
    assert [r["base_bytes"][tiny_model_dir] for r in ranks] == [params * 4 // 2] * 2
    assert ranks[0]["lora_bytes"] == ranks[1]["lora_bytes"] > 0  # LoRA replicated on both
    # Each rank's (first row, end row, tokens), as each rank reported them: rows 0-1 on rank 0, 2-3 on rank 1.
    tokens = [e.cost for e in sharded.residency.bases[tiny_model_dir].renderer.render_batch(batch_from_dicts(BATCH), 64, "cross_entropy")]
    assert sharded.ranks.last_pass == [(0, 2, sum(tokens[:2])), (2, 4, sum(tokens[2:]))]


# The unembedding too: lm_head is wrapped with the rest, in FSDP's root. Its B has a row per token, and the rows of
# tokens no datum predicts get gradients near AdamW's eps, where fp32 noise (rows summed on two ranks) becomes more
# than WEIGHTS_REL of the update. Attention alone has such elements too (a q_proj B entry with a gradient of ~6e-8
# after the first step: 2.4e-4 of the update apart), so both cases step with a larger eps. Gradients are compared at
# 1e-5 as the rest.
@pytest.mark.parametrize(("targets", "adam"), [
    ({}, {"learning_rate": 1e-2, "eps": 1e-6}),
    ({"train_mlp": True, "train_unembed": True}, {"learning_rate": 1e-2, "eps": 1e-6}),
], ids=["attention", "all"])
def test_forward_backward_gives_one_process_loss_gradients_and_weights(
    sharded: Engine, single: Engine, tiny_model_dir: str, targets: dict[str, bool], adam: dict[str, float]
) -> None:
    run_id = f"same-{len(targets)}"
    create([sharded, single], run_id, tiny_model_dir, lora={**LORA, **targets})
    for step, batch in enumerate([BATCH, BATCH[1:]]):
        got, expected = sharded.forward_backward(run_id, batch), single.forward_backward(run_id, batch)
        assert outcome(got) == outcome(expected)
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert_same_grads(grads(sharded, run_id), grads(single, run_id))  # the gradients, before AdamW can hide a factor
        got, expected = sharded.optim_step(run_id, adam), single.optim_step(run_id, adam)
        assert got["step"] == expected["step"] == step + 1
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
        assert_same_weights(lora_weights(sharded, run_id), lora_weights(single, run_id), exact=False, rel=WEIGHTS_REL)
    # Sampling goes through the same ranks: greedy decoding gives one process's tokens.
    params = {"max_tokens": 6, "temperature": 0.0, "seed": 3}
    got_sample, expected_sample = sharded.sample(run_id, ["Hello"], **params), single.sample(run_id, ["Hello"], **params)
    assert got_sample["sequences"][0][0]["tokens"] == expected_sample["sequences"][0][0]["tokens"]


def test_prompt_logprobs_and_repeated_prefill_on_a_sharded_base_are_one_process_ones(
    sharded: Engine, single: Engine, tiny_model_dir: str
) -> None:
    # The prompt's vocabulary projection runs inside the sharded forward (its head gathered there), then the cache
    # is repeated for the samples: both as one process does them.
    create([sharded, single], "scored", tiny_model_dir)
    params: dict[str, Any] = {"max_tokens": 4, "temperature": 0.0, "num_samples": 2, "prompt_logprobs": True,
                              "topk_prompt_logprobs": 3}
    prompts = ["Hello", "The capital of France is"]
    got, expected = sharded.sample("scored", prompts, **params), single.sample("scored", prompts, **params)
    assert [[s["tokens"] for s in p] for p in got["sequences"]] == [[s["tokens"] for s in p] for p in expected["sequences"]]
    for ours, theirs in zip(got["prompt_logprobs"], expected["prompt_logprobs"]):
        assert ours[0] is None and theirs[0] is None
        torch.testing.assert_close(torch.tensor(ours[1:]), torch.tensor(theirs[1:]), rtol=1e-5, atol=1e-5)
    assert [[None if p is None else [t for t, _ in p] for p in row] for row in got["topk_prompt_logprobs"]] == \
        [[None if p is None else [t for t, _ in p] for p in row] for row in expected["topk_prompt_logprobs"]]


def test_outputs_and_forward_gather_every_ranks_rows_in_order(sharded: Engine, single: Engine,
                                                              tiny_model_dir: str) -> None:
    create([sharded, single], "outputs", tiny_model_dir, seed=4)
    got = sharded.forward_backward("outputs", BATCH, return_outputs=True)
    expected = single.forward_backward("outputs", BATCH, return_outputs=True)
    assert len(got["outputs"]) == len(BATCH)  # rows 0-1 from rank 0, 2-3 from rank 1
    for mine, theirs in zip(got["outputs"], expected["outputs"]):
        assert mine["logprobs"] == pytest.approx(theirs["logprobs"], rel=1e-5, abs=1e-6)
    before = grads(sharded, "outputs")
    got_forward, expected_forward = sharded.forward(BATCH, run_id="outputs"), single.forward(BATCH, run_id="outputs")
    for mine, theirs in zip(got_forward["outputs"], expected_forward["outputs"]):
        assert mine["elementwise_loss"] == pytest.approx(theirs["elementwise_loss"], rel=1e-5, abs=1e-6)
    assert_same_grads(grads(sharded, "outputs"), before)  # the forward kept no gradient
    assert sharded.runs["outputs"].pending.calls == 1


def test_two_runs_share_the_sharded_pool_in_one_tick(sharded: Engine, single: Engine, tiny_model_dir: str) -> None:
    lora_b = {"r": 8, "alpha": 8, "target_modules": ["o_proj", "down_proj"]}  # LoRA in other layers than "pair-a"
    create([sharded, single], "pair-a", tiny_model_dir, seed=2)
    create([sharded, single], "pair-b", tiny_model_dir, seed=3, lora=lora_b)
    batches = {"pair-a": BATCH[:3], "pair-b": BATCH[3:]}  # pair-b's one row lands on rank 1 alone
    futures = {run_id: submit(sharded, "forward_backward", run_id=run_id, batch=batch) for run_id, batch in batches.items()}
    stats = sharded.tick()
    assert (stats.base_passes, stats.fb_runs, stats.fb_rows) == (1, 2, 4)
    for run_id, batch in batches.items():
        expected = single.forward_backward(run_id, batch)
        assert result_of(futures[run_id])["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert_same_grads(grads(sharded, run_id), grads(single, run_id))


# ---- a rank that dies or hangs ---------------------------------------------------------------------

SCRIPT: list[tuple[str, dict[str, Any]]] = [("forward_backward", {"batch": BATCH[:2], "request_id": "fb-1"}),
          ("optim_step", {"adam": {"learning_rate": 1e-2}, "request_id": "opt-1"}),
          ("forward_backward", {"batch": BATCH[2:], "request_id": "fb-2"})]
FAILING: tuple[str, dict[str, Any]] = ("forward_backward", {"batch": BATCH, "request_id": "fb-3"})


@pytest.mark.parametrize("fault", ["rank_dies", "rank_hangs"])
def test_a_rank_that_fails_mid_call_fails_the_call_then_the_pool_recovers_everything_acknowledged(
    sharded: Engine, single: Engine, tiny_model_dir: str, fault: str
) -> None:
    run_id = f"fails-{fault}"
    create([sharded, single], run_id, tiny_model_dir)
    for method, params in SCRIPT:  # acknowledged: journaled before they were answered
        assert outcome(sharded.call(method, run_id=run_id, **params)) == outcome(single.call(method, run_id=run_id, **params))
    assert sharded.ranks is not None
    restarts, pids = sharded.ranks.restarts, sharded.ranks.describe()["pids"]
    sharded.ranks.arm(fault)
    method, params = FAILING
    with pytest.raises(WorkerFailed) as failed:
        sharded.call(method, run_id=run_id, **params)
    expected_reason = "rank 1 exited with code -9" if fault == "rank_dies" else f"Timed out waiting {TIMEOUT_S * 1000}ms"
    assert expected_reason in failed.value.message
    assert sharded.ranks.restarts == restarts + 1 and sharded.ranks.failed is None
    assert set(sharded.ranks.describe()["pids"][1:]).isdisjoint(pids[1:])  # a fresh follower
    assert run_id not in sharded.runs  # dropped unsaved: its journal holds every acknowledged call

    info = sharded.run_info(run_id)  # restored from the journal, through the new group
    assert (info["step"], info["pending_forward_backward"]) == (1, 1)
    retried = sharded.call(method, run_id=run_id, **params)  # the SDK's retry, same request id: never applied before
    assert "replayed" not in retried
    assert outcome(retried) == outcome(single.call(method, run_id=run_id, **params))
    # After an AdamW step both sides' weights differ by fp32 noise, so their gradients do a little more.
    assert_same_weights(grads(sharded, run_id), grads(single, run_id), exact=False, rel=WEIGHTS_REL)
    sharded.optim_step(run_id, {"learning_rate": 1e-2})
    single.optim_step(run_id, {"learning_rate": 1e-2})
    assert_same_weights(lora_weights(sharded, run_id), lora_weights(single, run_id), exact=False, rel=WEIGHTS_REL)



def test_a_split_call_cancelled_between_parts_is_undone_on_every_rank(sharded: Engine, single: Engine,
                                                                      tiny_model_dir: str) -> None:
    """A deadline between the parts of a split forward_backward withdraws it on a multi-rank pool too: every rank puts
    back its gradients from before the call, so the next step's weights on both ranks are one process's without it."""
    row = {"tokens": [300 + i for i in range(200)], "weights": [0] + [1] * 199}
    create([sharded, single], "split-cancel", tiny_model_dir)
    for engine in (sharded, single):
        engine.forward_backward("split-cancel", BATCH)  # gradients before the split call
    # 64 rows of 200 tokens: more than one pass's budget (tick_tokens, 8192), so the call is split in two parts.
    call = submit(sharded, "forward_backward", run_id="split-cancel", batch=[row] * 64, request_id="split")
    assert sharded.tick().fb_seconds > 0 and not call.done()  # its first part is in every rank's gradients
    assert sharded.call("cancel", request_id="split", user_id="u1", deadline=True) == {"found": True}
    assert call.result(timeout=0)["error"]["code"] == "DEADLINE_EXCEEDED"  # never applied
    assert_same_grads(grads(sharded, "split-cancel"), grads(single, "split-cancel"))
    assert sharded.optim_step("split-cancel")["step"] == single.optim_step("split-cancel")["step"] == 1
    # Rank 1 trains on its own replica: had it kept the withdrawn part's gradients, its rows' loss would differ.
    got, expected = sharded.forward_backward("split-cancel", BATCH), single.forward_backward("split-cancel", BATCH)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert_same_grads(grads(sharded, "split-cancel"), grads(single, "split-cancel"))
