"""Streamed samples in the engine: each decode chunk's settled text and ids arrive as progress and add up, with the
answer, to the answer; a stop string never leaks into a chunk; `cancel` answers a decoding sample at the next tick
with what it has; and the incremental detokeniser on SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from gpu_runtime.engine.detokenize import IncrementalText, settled
from gpu_runtime.engine.engine import Engine
from tests.helpers.tiny_model import smollm2_tokenizer


@pytest.fixture
def chunky(tmp_path: Path, tiny_model_dir: str) -> tuple[Engine, str]:
    """An engine whose decode chunks are a token each, and a run on the tiny model."""
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-6)
    engine.create_run("r1", "u1", tiny_model_dir, {"r": 4})
    return engine, "r1"


def streamed(engine: Engine, params: dict[str, Any], until: Any = None) -> tuple[list[dict[str, Any]], list[Any]]:
    """Submit a streamed sample and tick until it is answered (or `until(chunks)` holds): its chunks and answer."""
    chunks: list[dict[str, Any]] = []
    answer: list[Any] = []
    engine.submit_message("sample", {**params, "stream": True}, answer.append, chunks.append)
    for _ in range(500):  # bounded: a tick decodes at least one token of at most max_tokens
        if answer or (until is not None and until(chunks)):
            break
        engine.tick()
    return chunks, answer


def joined(chunks: list[dict[str, Any]], key: str) -> Any:
    parts = [c["sequences"][0][0][key] for c in chunks]
    return "".join(parts) if key == "text" else [t for part in parts for t in part]


def test_chunks_and_the_answer_add_up(chunky: tuple[Engine, str]) -> None:
    engine, run = chunky
    chunks, answer = streamed(engine, {"run_id": run, "prompts": ["hello"], "max_tokens": 12, "temperature": 0.0})
    sequence = answer[0]["result"]["sequences"][0][0]
    assert len(chunks) > 1  # one chunk per decoded token, less what was held back
    assert sequence["text"].startswith(joined(chunks, "text"))
    assert sequence["tokens"][:len(joined(chunks, "tokens"))] == joined(chunks, "tokens")
    plain = engine.sample(run, ["hello"], max_tokens=12, temperature=0.0)["sequences"][0][0]
    assert plain["text"] == sequence["text"] and plain["tokens"] == sequence["tokens"]


def test_a_stop_string_never_reaches_a_chunk(chunky: tuple[Engine, str]) -> None:
    engine, run = chunky
    full = engine.sample(run, ["hello"], max_tokens=12, temperature=0.0)["outputs"][0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    chunks, answer = streamed(engine, {"run_id": run, "prompts": ["hello"], "max_tokens": 12, "temperature": 0.0,
                                       "stop": [stop]})
    sequence = answer[0]["result"]["sequences"][0][0]
    assert sequence["stop_reason"] == "stop" and sequence["text"] == full[:full.find(stop)]
    assert stop not in joined(chunks, "text") and sequence["text"].startswith(joined(chunks, "text"))


def answered(engine: Engine, params: dict[str, Any]) -> dict[str, Any]:
    """A sample submitted alone, ticked until it is answered: its first sequence."""
    answer: list[Any] = []
    engine.submit_message("sample", params, answer.append)
    for _ in range(500):  # bounded: a tick decodes at least one token of at most max_tokens
        if answer:
            break
        engine.tick()
    return dict(answer[0]["result"]["sequences"][0][0])


@pytest.mark.parametrize("source", ["latest", "base"])  # the late sample on the run's latest weights, or a base alone
def test_a_late_sample_joins_the_decoding_group(chunky: tuple[Engine, str], tiny_model_dir: str,
                                                source: str) -> None:
    engine, run = chunky
    first = {"run_id": run, "prompts": ["hello"], "max_tokens": 30, "temperature": 0.0, "latest": True}
    weights = {"run_id": run, "latest": True} if source == "latest" else {"base_model": tiny_model_dir, "user_id": "u2"}
    second = {**weights, "prompts": ["a longer prompt than the first one, so the rows are padded"], "max_tokens": 12,
              "temperature": 0.0}
    chunks, first_answer = streamed(engine, first, until=lambda chunks: len(chunks) >= 3)
    second_answer: list[Any] = []
    engine.submit_message("sample", second, second_answer.append)
    engine.tick()  # its own group: prefill and one token, then it joins the first's
    assert [group["calls"] for group in engine.call("runtime_state")["decode_groups"]] == [2]
    for _ in range(100):  # bounded: each tick decodes a token of both
        if first_answer and second_answer:
            break
        engine.tick()
    for params, answer in ((first, first_answer), (second, second_answer)):
        sequence, alone = answer[0]["result"]["sequences"][0][0], answered(engine, params)
        assert sequence["tokens"] == alone["tokens"]  # what it decodes alone, to its own max_tokens
        assert sequence["logprobs"] == pytest.approx(alone["logprobs"], abs=1e-4)


def test_cancel_answers_a_decoding_sample_with_what_it_has(chunky: tuple[Engine, str]) -> None:
    engine, run = chunky
    params = {"run_id": run, "prompts": ["hello"], "max_tokens": 200, "request_id": "v1-x"}
    chunks, answer = streamed(engine, params, until=lambda chunks: len(chunks) >= 2)
    assert not answer and engine.sampling.busy
    assert engine.call("cancel", request_id="v1-x", user_id="somebody-else") == {"found": False}  # not theirs
    assert engine.sampling.busy
    assert engine.call("cancel", request_id="v1-x", user_id="u1") == {"found": True}
    sequence = answer[0]["result"]["sequences"][0][0]
    assert sequence["stop_reason"] == "cancelled" and 2 <= len(sequence["tokens"]) < 200
    assert not engine.sampling.busy and not engine.call("runtime_state")["decode_groups"]


def test_a_cancel_before_the_start_withdraws_it(chunky: tuple[Engine, str]) -> None:
    engine, run = chunky
    assert engine.call("cancel", request_id="v1-early", user_id="u1") == {"found": False}
    chunks, answer = streamed(engine, {"run_id": run, "prompts": ["hello"], "max_tokens": 50, "request_id": "v1-early"})
    assert answer[0]["error"]["code"] == "CANCELLED" and chunks == []  # never applied: nothing to record or bill


def test_a_deadline_stops_a_decoding_sample_unapplied(chunky: tuple[Engine, str]) -> None:
    engine, run = chunky
    params = {"run_id": run, "prompts": ["hello"], "max_tokens": 200, "request_id": "late"}
    chunks, answer = streamed(engine, params, until=lambda chunks: len(chunks) >= 2)
    assert engine.call("cancel", request_id="late", user_id="u1", deadline=True) == {"found": True}
    error = answer[0]["error"]
    assert error["code"] == "DEADLINE_EXCEEDED" and error["details"]["compute_seconds"] > 0
    assert not engine.call("runtime_state")["decode_groups"]
    again = engine.call("sample", **{**params, "max_tokens": 3})  # not remembered as answered: the id runs afresh
    assert len(again["sequences"][0][0]["tokens"]) == 3 and not again.get("replayed")


@pytest.mark.parametrize("text, stops, expected", [
    ("Hello wor", ["world"], "Hello "),
    ("Hello wor", ["xyz"], "Hello wor"),
    ("Hello w\ufffd", [], "Hello w"),
    ("ab\n", ["\n\n", "b\nc"], "a"),  # the longest end that starts a stop
    ("", ["x"], ""),
])
def test_settled_holds_back_what_could_still_change(text: str, stops: list[str], expected: str) -> None:
    assert settled(text, stops) == expected


def test_incremental_text_on_the_real_tokenizer_never_splits_a_character(tiny_model_dir: str) -> None:
    tokenizer = smollm2_tokenizer(Path(tiny_model_dir).parent / "smollm2-tokenizer")
    text = "Café 😀 naïve — 東京 do"  # ends with the start of the stop string "done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = IncrementalText(lambda t: cast(str, tokenizer.decode(t, skip_special_tokens=True)), ["done"])
    pieces, counted = [], 0
    for n in range(1, len(ids) + 1):
        piece, count = stream.step(ids[:n])
        pieces.append(piece)
        counted += count
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text[:-len("do")]
    assert "".join(pieces).startswith(cast(str, tokenizer.decode(ids[:counted]))) and counted < len(ids)  # " do" held too
    assert len([p for p in pieces if p]) > 3


def test_a_cancel_after_the_answer_leaves_its_retry_alone(chunky: tuple[Engine, str]) -> None:
    engine, run = chunky
    params = {"run_id": run, "prompts": ["hello"], "max_tokens": 3, "request_id": "done-1"}
    first = engine.call("sample", **params)
    assert engine.call("cancel", request_id="done-1", user_id="u1", deadline=True) == {"found": False}
    again = engine.call("sample", **params)  # the cancel came too late: not remembered against the retry
    assert again["replayed"] is True and again["sequences"] == first["sequences"]
