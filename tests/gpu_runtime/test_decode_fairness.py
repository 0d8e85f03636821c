"""Decode turns by user (issue 34 #10; gpu_runtime/compute/decode/turns.py): which rows a capped decode pass takes and
which prompts prefill first, as plain data (no torch in turns.py); and, on a tiny model, that rows taking turns draw
exactly the tokens they draw in one batch."""

from __future__ import annotations

import pytest

from gpu_runtime.compute.decode.turns import CPU_FAIR_PASS_ROWS, Row, decode_turn, fair_pass_rows, prefill_order


def rows_of(owner: str, count: int, first_slot: int, turn: int = 0) -> list[Row]:
    return [Row(owner, turn, first_slot + i) for i in range(count)]


def test_a_single_row_beside_a_flood_is_in_every_capped_pass() -> None:
    flood, single = rows_of("a", 200, 0), rows_of("b", 1, 200)
    rows = flood + single
    taken: dict[int, int] = {}
    clock = 0
    for _ in range(40):
        chosen = decode_turn(rows, 16)
        assert len(chosen) == 16 and 200 in chosen
        turns = {slot: clock + 1 + i for i, slot in enumerate(chosen)}  # numbered as the engine numbers them
        clock += len(chosen)
        rows = [Row(r.owner, turns.get(r.slot, r.turn), r.slot) for r in rows]
        for slot in chosen:
            taken[slot] = taken.get(slot, 0) + 1
    # the flood's rows take turns: 40 passes × 15 rows = 600 = 3 each
    assert {taken[slot] for slot in range(200)} == {3}


@pytest.mark.parametrize(("counts", "cap", "expected"), [
    ({"a": 200, "b": 1}, 16, {"a": 15, "b": 1}),
    ({"a": 200, "b": 30}, 16, {"a": 8, "b": 8}),
    ({"a": 100, "b": 3, "c": 100}, 16, {"a": 6, "b": 3, "c": 7}),
    ({"a": 5, "b": 5, "c": 5, "d": 5}, 2, {"a": 1, "b": 1, "c": 1, "d": 1}),  # each user a row, past the cap
    ({"a": 200}, 16, {"a": 200}),  # one user alone: the whole batch
    ({"a": 10, "b": 5}, 16, {"a": 10, "b": 5}),  # within the cap: everyone
    ({"a": 200, "b": 1}, None, {"a": 200, "b": 1}),  # no cap (CUDA)
])
def test_a_capped_pass_shares_its_rows_equally_by_user(counts: dict[str, int], cap: int | None,
                                                       expected: dict[str, int]) -> None:
    rows: list[Row] = []
    for owner, count in counts.items():
        rows += rows_of(owner, count, len(rows))
    owner_of = {r.slot: r.owner for r in rows}
    chosen = decode_turn(rows, cap)
    got: dict[str, int] = {}
    for slot in chosen:
        got[owner_of[slot]] = got.get(owner_of[slot], 0) + 1
    assert got == expected


def test_a_user_waiting_to_prefill_caps_the_pass_it_waits_for() -> None:
    assert len(decode_turn(rows_of("a", 200, 0), 16, waiting={"b"})) == 16
    assert len(decode_turn(rows_of("a", 200, 0), 16, waiting={"a"})) == 200


def test_within_a_user_the_least_recently_decoded_rows_go_first() -> None:
    rows = [Row("a", 5, 0), Row("a", 3, 1), Row("a", 3, 2), Row("a", 4, 3), Row("b", 5, 4)]
    assert decode_turn(rows, 3) == [1, 2, 4]  # least recently decoded first, ties by slot


def test_the_cap_applies_where_rows_cost_time() -> None:
    assert fair_pass_rows("cpu") == CPU_FAIR_PASS_ROWS and fair_pass_rows("cuda") is None


def test_prompts_prefill_fewest_rows_first_begun_ones_before_all() -> None:
    # a's 3 prompts queued first, b's one behind them, a's prompt begun (its slots held) at the end
    waiting = [("a", False, 1), ("a", False, 1), ("a", False, 1), ("b", False, 1), ("a", True, 4)]
    assert prefill_order(waiting, {"a": 200}) == [4, 3, 0, 1, 2]
    # with nothing running, the users alternate: a's first, b's first, then a's next
    assert prefill_order([("a", False, 1), ("a", False, 1), ("b", False, 1)], {}) == [0, 2, 1]


def test_a_user_with_its_share_of_a_pass_running_waits_to_prefill_beside_another() -> None:
    waiting = [("a", False, 1)] * 4 + [("b", False, 1), ("a", True, 4)]
    # a's 200 rows are past its share of a 16-row pass: its new prompts wait, b's prefills (a's begun one goes on)
    assert prefill_order(waiting, {"a": 200}, cap=16) == [5, 4]
    # with 5 running, a's prompts bring it up to its share: 8 of the 16 rows with two users
    assert prefill_order([("a", False, 1)] * 6 + [("b", False, 1)], {"a": 5}, cap=16) == [6, 0, 1, 2]
    # alone, or with no cap (CUDA), every prompt prefills
    assert prefill_order([("a", False, 1)] * 3, {"a": 200}, cap=16) == [0, 1, 2]
    assert prefill_order(waiting, {"a": 200}) == [5, 4, 0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5_moe"])
def test_rows_taking_turns_draw_what_one_batch_draws(kind: str) -> None:
    """Two users' seeded rows in capped passes (3 rows a pass) give the tokens and logprobs of uncapped passes: a
    skipped row keeps its place and its counter-based draws (and, on a hybrid model, its recurrent state)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu_runtime.compute.decode.engine import DecodeEngine, DecodeSettings
    from gpu_runtime.compute.decode.slot_cache import SlotCache
    from tests.gpu_runtime.test_decode_engine import _hybrid

    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
                             initializer_range=0.3)
        config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(config).eval()
    else:
        model = _hybrid(kind)
        config = model.config

    def run(cap: int | None) -> tuple[list[list[int]], list[list[float]], int]:
        engine = DecodeEngine(model, SlotCache(config, 64, slots=8), prefill_tokens=64, fair_rows=cap)
        handles = engine.add([5, 6, 7, 8], DecodeSettings(max_tokens=12, temperature=1.0, seed=3), num_samples=6,
                             owner="a")
        handles += engine.add([9, 10], DecodeSettings(max_tokens=5, temperature=0.7, top_p=0.9, seed=4),
                              num_samples=1, owner="b")
        while engine.busy:
            engine.step()
        return [h.tokens for h in handles], [h.logprobs for h in handles], engine.rows_decoded

    tokens, logprobs, capped_rows = run(3)
    expected_tokens, expected_logprobs, _ = run(None)
    assert tokens == expected_tokens
    for got, expected in zip(logprobs, expected_logprobs):
        assert got == pytest.approx(expected, abs=1e-5)
    assert capped_rows > 0
