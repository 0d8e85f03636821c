from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.client.persistence import RunPaths, atomic_dir, find_run_dir, read_json, write_json


def test_atomic_dir_replaces_an_old_directory_whole(tmp_path: Path) -> None:
    target = tmp_path / "step_1"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with atomic_dir(target) as tmp:
        assert not (tmp / "a.txt").exists()
        (tmp / "b.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_a_failed_atomic_dir_leaves_the_old_one_and_no_debris(tmp_path: Path) -> None:
    target = tmp_path / "step_1"
    with atomic_dir(target) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("disk full")
    assert (target / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]


def test_write_json_round_trips(tmp_path: Path) -> None:
    write_json(tmp_path / "x" / "config.json", {"b": 1, "a": [1, 2]})
    assert read_json(tmp_path / "x" / "config.json") == {"a": [1, 2], "b": 1}
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["config.json"]


def test_run_paths_and_lookup_by_run_id(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path, "u1", "r1")
    write_json(paths.config, {})
    for step in (1, 2, 10):
        paths.adapter_step(step).mkdir(parents=True)
    assert paths.saved_steps() == [1, 2, 10]
    paths.prune_steps(2)
    assert paths.saved_steps() == [2, 10]
    assert find_run_dir(tmp_path, "r1") == paths.root
    assert find_run_dir(tmp_path, "r2") is None
