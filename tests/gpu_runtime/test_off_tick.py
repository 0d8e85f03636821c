"""render_chat off the tick: answered as it is submitted when its base is resident, even while a decode group is
mid-generation; a base not loaded yet waits for the tick, which loads it; both give the same ids and text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_runtime.engine.engine import Engine

MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def test_render_chat_is_answered_without_a_tick_once_its_base_is_resident(tmp_path: Path,
                                                                          tiny_model_dir: str) -> None:
    engine = Engine(tmp_path / "data", device="cpu", decode_chunk_seconds=1e-6)
    params = {"base_model": tiny_model_dir, "messages": MESSAGES, "prompts": ["héllo 🌊"], "decode": [1, 2, 300]}
    cold: list[dict[str, Any]] = []
    engine.submit_message("render_chat", params, cold.append)
    assert cold == []  # no base loaded: the tick loads it
    engine.tick()
    assert "result" in cold[0]

    engine.create_run("r1", "u1", tiny_model_dir, {"r": 4})
    sampled: list[dict[str, Any]] = []
    engine.submit_message("sample", {"run_id": "r1", "prompts": ["hello"], "max_tokens": 50, "temperature": 0.0,
                             "latest": True, "stream": True}, sampled.append, lambda chunk: None)
    engine.tick()
    assert engine.sampling.busy and not sampled  # a group is mid-generation

    for where in ({"base_model": tiny_model_dir}, {"run_id": "r1"}):
        warm: list[dict[str, Any]] = []
        engine.submit_message("render_chat", {**params, "base_model": None, **where}, warm.append)
        assert warm == [cold[0]]  # answered at submit, with no tick in between: the same ids and pieces
    assert cold[0]["result"]["prompt_tokens"] and cold[0]["result"]["pieces"][2]
