"""Joined rows (issue 30, item 6): a training pass puts several datums of one call side by side in a model row instead
of padding each to the longest. What a user relies on: the same per-datum logprobs, losses and LoRA gradients as
padded (fp32, within 1e-5), for every loss kind; a co-batched run that cannot join (dropout) beside one that does; a
family whose attention cannot confine a datum (sliding windows, linear attention) never joins and still trains; a
journaled joined call replays to the same bits, whatever the setting is at the restart; and still one host copy."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_runtime.compute import joined_rows
from gpu_runtime.compute.batches import Datum, soft
from gpu_runtime.compute.plan import PartOutcome, PassPart
from gpu_runtime.compute.training import forward_backward_pass
from gpu_runtime.engine.engine import Engine
from gpu_runtime.engine.journal_records import FbRecord
from tests.gpu_runtime.test_host_syncs import CountSyncs
from tests.helpers.engine_tools import assert_relatively_close, assert_same_weights, lora_weights
from tests.helpers.tiny_families import FAMILIES, build_family

LENGTHS = [40, 9, 25, 31, 6, 17, 12, 3]  # first-fit-decreasing at width 40: 4 rows instead of 8
CLOSE = 1e-5  # fp32: the same terms summed over rows of another shape


def datums(loss_fn: str, seed: int = 0, lengths: list[int] = LENGTHS) -> list[Datum]:
    """Random datums; loss_fn "soft": cross_entropy's (N, K) soft targets (a teacher's top 3)."""
    rng = random.Random(seed)
    made = []
    for n in lengths:
        if loss_fn == "soft":
            made.append(soft([rng.randrange(1, 2000) for _ in range(n)],
                             [[rng.randrange(1, 2000) for _ in range(3)] for _ in range(n)],
                             [[rng.random() for _ in range(3)] for _ in range(n)], {}))
            continue
        tokens = [rng.randrange(1, 2000) for _ in range(n)]
        targets = [rng.randrange(1, 2000) for _ in range(n)]
        weights = [float(rng.random() < 0.8) for _ in range(n)]
        inputs = {}
        if loss_fn != "cross_entropy":
            inputs = {"advantages": [rng.uniform(-1, 1) for _ in range(n)],
                      "logprobs": [rng.uniform(-9.0, -6.0) for _ in range(n)]}
        made.append(Datum(tokens, targets, weights, inputs))
    return made


def part(run_id: str, rows: list[Datum], loss_fn: str, seed: int = 7, forward_only: bool = False) -> PassPart:
    return PassPart(run_id, rows, 0, call_rows=len(rows), call_width=max(d.length for d in rows),
                    dropout_seed=None if forward_only else seed, loss_fn="cross_entropy" if loss_fn == "soft" else loss_fn,
                    loss_config=dict(LOSS_CONFIG.get(loss_fn, {})), return_outputs=True, forward_only=forward_only)


LOSS_CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "importance_sampling": {}}


def engine_with(tmp_path: Path, name: str, base: str, runs: dict[str, dict[str, Any]]) -> Engine:
    engine = Engine(tmp_path / name, device="cpu")
    for i, (run_id, lora) in enumerate(runs.items()):
        engine.create_run(run_id, f"user-{i}", base, lora, seed=1 + i)
    return engine


def one_pass(engine: Engine, parts: list[PassPart]) -> tuple[list[PartOutcome], dict[str, dict[str, torch.Tensor]]]:
    entry = engine.residency.bases[next(iter(engine.runs.values())).base_key]
    outcomes = forward_backward_pass(entry, engine.residency.runs, parts, torch.device("cpu"))
    assert all(isinstance(o, PartOutcome) for o in outcomes), outcomes
    grads = {run_id: {name: p.grad.clone() for name, p in state.named_parameters().items() if p.grad is not None}
             for run_id, state in engine.runs.items()}
    return [o for o in outcomes if isinstance(o, PartOutcome)], grads


def assert_same_outcome(joined: PartOutcome, padded: PartOutcome) -> None:
    assert joined.loss_sum == pytest.approx(padded.loss_sum, rel=CLOSE, abs=CLOSE)
    assert joined.normaliser == padded.normaliser
    assert joined.outputs is not None and padded.outputs is not None
    for mine, theirs in zip(joined.outputs, padded.outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            assert len(mine[key]) == len(theirs[key])
            assert torch.allclose(torch.tensor(mine[key]), torch.tensor(theirs[key]), rtol=CLOSE, atol=CLOSE), key


def assert_same_grads(joined: dict[str, torch.Tensor], padded: dict[str, torch.Tensor]) -> None:
    assert joined.keys() == padded.keys() and joined
    for name in joined:
        assert_relatively_close(joined[name], padded[name], rel=CLOSE, name=name)


@pytest.mark.parametrize(("lengths", "rows"), [
    ([40, 9, 25, 31, 6, 17, 12, 3], [[0], [3, 1], [2, 6, 7], [5, 4]]),
    ([8, 8, 8], [[0], [1], [2]]),  # equal lengths: nothing to join
    ([10, 5, 5, 5, 5], [[0], [1, 2], [3, 4]]),
])
def test_first_fit_decreasing_never_makes_more_or_wider_rows(lengths: list[int], rows: list[list[int]]) -> None:
    got = joined_rows.first_fit_decreasing(lengths)
    assert got == rows
    assert sorted(d for row in got for d in row) == list(range(len(lengths)))
    assert all(sum(lengths[d] for d in row) <= max(lengths) for row in got)


@pytest.mark.parametrize(("lengths", "joins"), [(LENGTHS, True), ([8, 8, 8], False), ([10, 6, 6, 6], False), ([10, 5, 5, 5], True),
                                                ([64, 3, 3, 3, 3], True)])
def test_a_part_joins_only_when_it_saves_a_quarter_of_its_rows(lengths: list[int], joins: bool) -> None:
    assert joined_rows.saves(lengths) is joins


@pytest.mark.parametrize(("loss_fn", "attention"), [("cross_entropy", "sdpa"), ("importance_sampling", "sdpa"),
                                                   ("ppo", "sdpa"), ("gspo", "sdpa"), ("soft", "sdpa"),
                                                   ("cross_entropy", "eager")])
def test_joined_rows_give_the_padded_losses_logprobs_and_gradients(tmp_path: Path, tiny_model_dir: str, loss_fn: str,
                                                                   attention: str, monkeypatch: pytest.MonkeyPatch) -> None:
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(joined_rows.JOIN_ROWS_ENV, setting)
        engine = engine_with(tmp_path, f"data-{setting}", tiny_model_dir, {"run": {"r": 4, "alpha": 8}})
        model = engine.residency.bases[engine.runs["run"].base_key].model
        model.set_attn_implementation(attention)  # eager takes the additive form of the same mask
        with CountSyncs() as syncs:
            results[setting] = one_pass(engine, [part("run", datums(loss_fn), loss_fn)])
        assert syncs.total == 1, syncs.counts  # the joined layout is built from the host's lengths: no read-back
    (padded,), padded_grads = results["0"]
    (joined,), joined_grads = results["1"]
    assert (padded.join_rows, joined.join_rows) == (False, True)
    assert_same_outcome(joined, padded)
    assert_same_grads(joined_grads["run"], padded_grads["run"])


def test_a_cobatched_pass_joins_one_run_and_pads_the_one_with_dropout(tmp_path: Path, tiny_model_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    runs: dict[str, dict[str, Any]] = {"plain": {"r": 4, "alpha": 8}, "dropping": {"r": 8, "alpha": 8, "dropout": 0.1}}
    engine = engine_with(tmp_path, "together", tiny_model_dir, runs)
    together = one_pass(engine, [part("plain", datums("cross_entropy", 1), "cross_entropy"),
                                 part("dropping", datums("importance_sampling", 2), "importance_sampling", seed=9)])
    assert [o.join_rows for o in together[0]] == [True, False]
    monkeypatch.setenv(joined_rows.JOIN_ROWS_ENV, "0")
    alone = engine_with(tmp_path, "alone", tiny_model_dir, runs)
    plain, plain_grads = one_pass(alone, [part("plain", datums("cross_entropy", 1), "cross_entropy")])
    dropping, dropping_grads = one_pass(alone, [part("dropping", datums("importance_sampling", 2), "importance_sampling",
                                                     seed=9)])
    assert_same_outcome(together[0][0], plain[0])
    assert_same_outcome(together[0][1], dropping[0])
    assert_same_grads(together[1]["plain"], plain_grads["plain"])
    assert_same_grads(together[1]["dropping"], dropping_grads["dropping"])


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("joined-families")
    tokenizer = Path(tiny_model_dir).parent / "smollm2-tokenizer"
    return {family: build_family(family, root / family, tokenizer) for family in FAMILIES}


# sliding-window layers need their own mask, linear-attention layers ignore masks and positions: those never join
JOINS = {"llama": True, "qwen": True, "qwen3": True, "qwen3_moe": True, "phi3": True, "mistral": False, "gemma": False,
         "gemma3": False, "gpt_oss": False, "olmo": False, "qwen3_5": False, "qwen3_5_moe": False}


def test_every_family_is_classified() -> None:
    assert set(JOINS) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_joins_where_its_attention_allows_and_trains_either_way(tmp_path: Path, family_dirs: dict[str, str],
                                                                         family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = datums("cross_entropy", 4, lengths=[20, 5, 9, 14, 3, 11])
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(joined_rows.JOIN_ROWS_ENV, setting)
        engine = engine_with(tmp_path, f"data-{setting}", family_dirs[family], {"run": {"r": 4, "alpha": 8}})
        results[setting] = one_pass(engine, [part("run", rows, "cross_entropy")])
    (padded,), padded_grads = results["0"]
    (joined,), joined_grads = results["1"]
    assert joined.join_rows is JOINS[family]
    assert torch.isfinite(torch.tensor(joined.loss_sum)) and any(g.abs().sum() > 0 for g in joined_grads["run"].values())
    assert_same_outcome(joined, padded)
    assert_same_grads(joined_grads["run"], padded_grads["run"])


def test_a_journaled_joined_call_replays_bitwise_whatever_the_setting(tmp_path: Path, tiny_model_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    batch = [d.to_dict() for d in datums("cross_entropy", 5)]
    live = Engine(tmp_path, device="cpu", snapshot_every_steps=1000)
    live.create_run("run", "user", tiny_model_dir, {"r": 4, "alpha": 8}, seed=3)
    live.forward_backward("run", batch)
    live.optim_step("run", {"learning_rate": 1e-2})
    live.forward_backward("run", batch)  # pending gradients at the crash
    state = live.runs["run"]
    assert [r.get("join_rows") for r in state.journal.read() if r["type"] == "forward_backward"] == [True, True]
    state.journal.close()

    monkeypatch.setenv(joined_rows.JOIN_ROWS_ENV, "0")  # live passes only: a replay joins as its record says
    restarted = Engine(tmp_path, device="cpu", snapshot_every_steps=1000)  # a crash: no shutdown snapshot
    assert restarted.run_info("run")["pending_forward_backward"] == 1
    assert_same_weights(lora_weights(restarted, "run"), lora_weights(live, "run"))
    for mine, theirs in zip(restarted.runs["run"].parameters(), live.runs["run"].parameters(), strict=True):
        assert (mine.grad is None) == (theirs.grad is None)
        if mine.grad is not None and theirs.grad is not None:
            assert torch.equal(mine.grad, theirs.grad)


@pytest.mark.parametrize("joined", [True, False])
def test_a_record_says_join_rows_only_when_its_datums_joined_and_older_records_read_as_padded(joined: bool) -> None:
    record = FbRecord(request_id="r", loss_fn="cross_entropy", loss_fn_config={}, reduction="mean", call=0, step=0,
                      batch_sha256="", body_sha256=None, datums=datums("cross_entropy")[:2], result={}, join_rows=joined)
    written = record.to_dict()
    assert ("join_rows" in written) is joined  # a padded call's record is byte for byte what it was before
    assert FbRecord.from_dict(written).join_rows is joined
