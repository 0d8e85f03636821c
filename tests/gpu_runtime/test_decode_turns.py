"""How decode work takes turns (issue 14 §7, issue 31): a long prompt's prefill goes by pieces across ticks and decodes
what a single pass decodes; every call on a base decodes in its one engine, late ones joining the running batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpu_runtime.compute.decode.engine import DecodeEngine
from gpu_runtime.engine.engine import Engine

PROMPTS = ["a prompt long enough to be prefilled in several pieces when the budget is tiny, " * 2, "short"]
SETTINGS = {"max_tokens": 6, "temperature": 0.0, "num_samples": 2, "prompt_logprobs": True, "topk_prompt_logprobs": 3}


def ticked(engine: Engine, params: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A sample submitted alone and ticked until answered: its result and the ticks it took."""
    answer: list[Any] = []
    engine.submit_message("sample", params, answer.append)
    for ticks in range(1, 200):  # bounded: each tick prefills a piece or decodes a token
        engine.tick()
        if answer:
            return answer[0]["result"], ticks
    raise AssertionError("the sample was not answered")


def test_a_chunked_prefill_decodes_what_one_pass_does(tmp_path: Path, tiny_model_dir: str) -> None:
    params = {"base_model": tiny_model_dir, "user_id": "u1", "prompts": PROMPTS, **SETTINGS}
    whole, _ = ticked(Engine(tmp_path / "whole", device="cpu"), params)
    # 16 prompt tokens a step, one step a tick (chunks of a microsecond).
    pieces = Engine(tmp_path / "pieces", device="cpu", tick_tokens=16, decode_chunk_seconds=1e-6)
    chunked, ticks = ticked(pieces, params)
    width = max(len(ids) for ids in whole["prompt_tokens"])
    prompt_tokens = sum(len(ids) for ids in whole["prompt_tokens"])
    # 16 prompt tokens a step (one step a tick): the prefill took a tick per piece
    assert width > 16 and ticks >= -(-prompt_tokens // 16) + SETTINGS["max_tokens"] - 1
    assert chunked["prompt_tokens"] == whole["prompt_tokens"]
    for got, expected in zip(chunked["sequences"], whole["sequences"]):
        for a, b in zip(got, expected):
            assert a["tokens"] == b["tokens"]
            assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-5)
    for got_row, expected_row in zip(chunked["prompt_logprobs"], whole["prompt_logprobs"]):
        assert got_row[0] is None and expected_row[0] is None
        assert got_row[1:] == pytest.approx(expected_row[1:], abs=1e-5)
    for got_top, expected_top in zip(chunked["topk_prompt_logprobs"], whole["topk_prompt_logprobs"]):
        assert [[pair[0] for pair in position] for position in got_top[1:]] == \
            [[pair[0] for pair in position] for position in expected_top[1:]]


def decoding(engine: Engine) -> dict[str, int]:
    """Rows decoding in the engines' batches, per user."""
    rows: dict[str, int] = {}
    for decoder in engine.sampling.decoders.values():
        for handle in decoder.engine.by_slot.values() if decoder.engine is not None else []:
            user = handle.tag.request.user_id
            rows[user] = rows.get(user, 0) + 1
    return rows


def test_calls_on_one_base_decode_in_one_batch_whenever_they_arrive(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-6)
    answers: list[Any] = []

    def sample(user: str, rows: int, max_tokens: int) -> None:
        engine.submit_message("sample", {"base_model": tiny_model_dir, "user_id": user, "prompts": ["hello there"],
                                 "num_samples": rows, "max_tokens": max_tokens, "temperature": 1.0}, answers.append)

    sample("flood", 16, 40)
    sample("client-1", 1, 40)
    engine.tick()  # one prefill each, the first tokens drawn: one batch of 17 rows
    assert decoding(engine) == {"flood": 16, "client-1": 1}
    sample("client-2", 2, 40)
    sample("client-3", 16, 40)
    sample("flood", 16, 40)
    engine.tick()  # the late ones join the running batch at their first step (the cache grew for them)…
    # …but the flood's second call, whose user already has more than its share of a capped pass decoding (turns.py)
    assert decoding(engine) == {"flood": 16, "client-1": 1, "client-2": 2, "client-3": 16}
    assert len(engine.sampling.decoders) == 1 and not answers
    while len(answers) < 5:
        engine.tick()
    assert all("result" in answer for answer in answers)
    assert not decoding(engine)


def test_a_single_sample_behind_a_flood_of_200_is_answered_in_a_few_small_passes(tmp_path: Path,
                                                                                tiny_model_dir: str) -> None:
    """Issue 34 #10: user B's one 4-token sample, sent while user A's 200 samples decode, is answered within a few
    decode steps, each of at most the CPU's fair rows (turns.py), not behind passes of A's 200 rows."""
    from gpu_runtime.compute.decode.turns import CPU_FAIR_PASS_ROWS

    # one step a tick; all of A's 200 calls in flight (the runtime's default bound is 64 a user)
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-6, max_user_calls_in_flight=256)
    a_answers: list[Any] = []
    for seed in range(200):
        engine.submit_message("sample", {"base_model": tiny_model_dir, "user_id": "a", "prompts": ["hello there"],
                                         "max_tokens": 40, "temperature": 1.0, "seed": seed}, a_answers.append)
    for _ in range(10):  # bounded: the prompts are short, one prefill pass takes them all
        if decoding(engine).get("a", 0) == 200:
            break
        engine.tick()
    assert decoding(engine) == {"a": 200}
    decoder = next(iter(engine.sampling.decoders.values()))
    assert decoder.engine is not None
    steps, rows = decoder.engine.steps, decoder.engine.rows_decoded
    b_answer: list[Any] = []
    engine.submit_message("sample", {"base_model": tiny_model_dir, "user_id": "b", "prompts": ["hello there"],
                                     "max_tokens": 4, "temperature": 0.0}, b_answer.append)
    while not b_answer:
        engine.tick()
    b_steps, b_rows = decoder.engine.steps - steps, decoder.engine.rows_decoded - rows
    assert len(b_answer[0]["result"]["sequences"][0][0]["tokens"]) == 4
    # its prefill and first token in one step, then three decode steps; each pass at most the fair rows
    assert b_steps <= 5 and b_rows <= b_steps * CPU_FAIR_PASS_ROWS
    assert not a_answers  # A's rows took turns meanwhile, none done yet (40 tokens each)
    for _ in range(400):  # bounded: A's rows need at most 40 steps once alone
        if len(a_answers) == 200:
            break
        engine.tick()
    assert all("result" in answer for answer in a_answers)  # once alone, A's batch decodes whole again


class Flood:
    """User A's samples of 40 tokens on the tiny model, one step a tick, and user B's 4-token one beside them."""

    def __init__(self, tmp_path: Path, model: str) -> None:
        self.engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-6, max_user_calls_in_flight=256)
        self.model = model
        self.a_answers: list[Any] = []
        self.b_answers: list[Any] = []

    def a_calls(self, seeds: range) -> None:
        for seed in seeds:
            self.engine.submit_message("sample", {"base_model": self.model, "user_id": "a", "prompts": ["hello there"],
                                                  "max_tokens": 40, "temperature": 1.0, "seed": seed},
                                       self.a_answers.append)

    def decoding_a(self, rows: int) -> DecodeEngine:
        """A's `rows` calls decoding (ticked until they are): the base's decode engine."""
        self.a_calls(range(rows))
        for _ in range(10):  # bounded: the prompts are short, one prefill pass takes them all
            if decoding(self.engine).get("a", 0) == rows:
                break
            self.engine.tick()
        assert decoding(self.engine) == {"a": rows}
        decoder = next(iter(self.engine.sampling.decoders.values()))
        assert decoder.engine is not None
        return decoder.engine

    def b_call(self) -> dict[str, Any]:
        """B's sample, ticked until answered: its result."""
        self.engine.submit_message("sample", {"base_model": self.model, "user_id": "b", "prompts": ["hello there"],
                                              "max_tokens": 4, "temperature": 0.0}, self.b_answers.append)
        while not self.b_answers:
            self.engine.tick()
        return dict(self.b_answers.pop()["result"])


def test_a_flood_past_its_share_prefills_nothing_while_another_user_decodes(tmp_path: Path,
                                                                            tiny_model_dir: str) -> None:
    """Issue 34 #10: A's new prompts (its next calls, as a flood sends them) wait while B's sample decodes beside A's
    64 rows: B's steps carry B's prefill alone (on one CPU thread a 64-token prefill of A's doubled a 16-row step)."""
    flood = Flood(tmp_path, tiny_model_dir)
    engine = flood.engine
    decode = flood.decoding_a(64)
    prefilled = decode.prefilled
    flood.a_calls(range(64, 96))  # A's next 32 calls arrive with B's
    b_result = flood.b_call()
    assert decode.prefilled - prefilled == len(b_result["prompt_tokens"][0])
    a_answers = flood.a_answers
    assert decoding(engine) == {"a": 64} and not a_answers
    for _ in range(400):  # bounded: once alone, A's waiting prompts prefill and every row decodes each step
        if len(a_answers) == 96:
            break
        engine.tick()
    assert len(a_answers) == 96 and all("result" in answer for answer in a_answers)


def test_passes_stay_capped_for_a_few_steps_after_another_users_call_ends(tmp_path: Path,
                                                                          tiny_model_dir: str) -> None:
    """Issue 34 #10: B's calls in a loop: the next one is sent as the last is answered, so the passes right after
    stay capped (FAIR_GRACE_STEPS) and it does not wait out an uncapped pass of A's 64 rows before its own begin."""
    from gpu_runtime.compute.decode.turns import CPU_FAIR_PASS_ROWS, FAIR_GRACE_STEPS

    flood = Flood(tmp_path, tiny_model_dir)
    decode = flood.decoding_a(64)
    assert len(flood.b_call()["sequences"][0][0]["tokens"]) == 4
    passes = []
    for _ in range(FAIR_GRACE_STEPS + 1):
        rows = decode.rows_decoded
        flood.engine.tick()
        passes.append(decode.rows_decoded - rows)
    assert passes == [CPU_FAIR_PASS_ROWS] * FAIR_GRACE_STEPS + [64]  # then A alone: its whole batch again
