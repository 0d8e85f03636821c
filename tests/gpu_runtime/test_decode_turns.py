"""How decode work takes turns (issue 14 §7, issue 19): a long prompt's prefill goes by pieces across ticks and decodes
what a single pass decodes; one user's many rows decode apart from another user's few, and users of like size share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
    # 16 tokens a piece over 2 prompt rows: 8 columns a pass, one pass a tick (chunks of a microsecond).
    pieces = Engine(tmp_path / "pieces", device="cpu", tick_tokens=16, decode_chunk_seconds=1e-6)
    chunked, ticks = ticked(pieces, params)
    width = max(len(ids) for ids in whole["prompt_tokens"])
    assert width > 16 and ticks >= -(-width // 8) + SETTINGS["max_tokens"] - 1  # the prefill took a tick per piece
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


def groups(engine: Engine) -> list[dict[str, int]]:
    """Each decode group's rows per user still decoding."""
    found = []
    for group in engine.sampling.groups:
        rows: dict[str, int] = {}
        for job in group.jobs:
            if not job.done:
                rows[job.request.user_id] = rows.get(job.request.user_id, 0) + job.end - job.start
        found.append(rows)
    return found


def test_a_users_many_rows_decode_apart_from_anothers_few(tmp_path: Path, tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-6)
    answers: list[Any] = []

    def sample(user: str, rows: int, max_tokens: int) -> None:
        engine.submit_message("sample", {"base_model": tiny_model_dir, "user_id": user, "prompts": ["hello there"],
                                 "num_samples": rows, "max_tokens": max_tokens, "temperature": 1.0}, answers.append)

    sample("flood", 16, 40)
    sample("client-1", 1, 40)
    engine.tick()  # picked in one tick, they start apart: 16 rows and 1 may not share a CPU pass
    assert sorted(groups(engine), key=lambda g: sum(g.values())) == [{"client-1": 1}, {"flood": 16}]
    sample("client-2", 2, 40)
    sample("flood", 16, 40)
    engine.tick()  # the late ones: their first token alone, then each joins the group of its like
    assert sorted(groups(engine), key=lambda g: sum(g.values())) == [{"client-1": 1, "client-2": 2}, {"flood": 32}]
    assert not answers
