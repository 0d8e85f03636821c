"""tinker-cookbook's sl_loop and rl_loop, unmodified, against a live Signal server on the tiny model (docs/TINKER.md).

Each recipe runs in a subprocess (the SDK's client holder is one thread per process) through
tests/tinker/cookbook_launcher.py, which gives it a local tokenizer, local datasets, a fixed LoRA seed and, for
rl_loop, a reward a random model can earn; the recipes' code is the wheel's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.live_server import LiveServer, settings_for

# The cookbook refuses model names outside its registry before it calls the server, so this test's catalogue (test
# configuration only) gives the tiny model a name the cookbook knows. Its renderer is role_colon ("User: …"), which
# any tokenizer can encode.
COOKBOOK_MODEL = "meta-llama/Llama-3.2-1B"
CONTEXT_LENGTH = 256  # the tiny model's max_position_embeddings
SEED = 11  # the launcher's LoRA seed: both sl_loop runs of the resume test start from the same weights
RECIPE_TIMEOUT_S = 300
SL_ARGS = ["batch_size=4", "max_length=48", "learning_rate=1e-2", "lora_rank=4"]
RL_ARGS = ["batch_size=4", "group_size=4", "max_tokens=32", "learning_rate=1e-3",
           "lora_rank=4"]


@pytest.fixture(scope="module")
def cookbook_server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = settings_for(tmp_path_factory.mktemp("cookbook-data"), tiny_model_dir)
    catalog = yaml.safe_load(settings.models_file.read_text())
    for model in catalog["models"]:
        if model["name"] == COOKBOOK_MODEL:
            model.update(path=tiny_model_dir, tokenizer=tiny_model_dir, offline=True, context_length=CONTEXT_LENGTH)
    settings.models_file.write_text(yaml.safe_dump(catalog))
    with pytest.MonkeyPatch.context() as patch:
        # The runtime it starts decodes one token at a time: on a shared CPU, torch's default thread pool makes
        # rl_loop's sampling an order of magnitude slower, not faster.
        patch.setenv("OMP_NUM_THREADS", "1")
        server = LiveServer.start(settings)
    yield server
    server.stop()


def run_recipe(server: LiveServer, key: str, recipe: str, log_path: Path, tokenizer_dir: str, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "TINKER_TELEMETRY": "0", "TINKER_BASE_URL": server.url, "TINKER_API_KEY": "tml-" + key,
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(log_path.parent / "datasets")}
    command = [sys.executable, "-m", "tests.tinker.cookbook_launcher", recipe, tokenizer_dir, str(SEED),
               f"model_name={COOKBOOK_MODEL}", f"log_path={log_path}", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]


def metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def only_run(server: LiveServer, key: str) -> dict[str, Any]:
    body = server.graphql("{ runs { id step baseModel } }", key=key)
    (run,) = body["data"]["runs"]
    return run


def manifest(server: LiveServer, run_id: str) -> list[dict[str, Any]]:
    """The run's manifest.jsonl: one line per step (its AdamW settings and its batches) and per other event."""
    (path,) = (server.settings.data_dir / "runs").glob(f"*/{run_id}/manifest.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]



def test_sl_loop_trains_and_resumes(cookbook_server: LiveServer, tiny_model_dir: str, tmp_path: Path) -> None:
    # Uninterrupted: 4 steps, a fresh user so its only run is this one.
    key = cookbook_server.new_user()
    whole = tmp_path / "whole"
    run_recipe(cookbook_server, key, "sl_loop", whole, tiny_model_dir, *SL_ARGS, "max_steps=4", "save_every=0")
    run = only_run(cookbook_server, key)
    assert (run["step"], run["baseModel"]) == (4, COOKBOOK_MODEL)
    rows = metrics(whole)
    # The cookbook's step is its batch index; Signal's own step (optim_step's metrics) is one ahead after the step.
    assert [(row["step"], row["optim/step"]) for row in rows] == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0)]
    uninterrupted = {row["step"]: row["train_mean_nll"] for row in rows}

    # Interrupted: 2 steps saving state every step, the `final` record dropped, then resumed up to 4.
    key = cookbook_server.new_user()
    resumed = tmp_path / "resumed"
    run_recipe(cookbook_server, key, "sl_loop", resumed, tiny_model_dir, *SL_ARGS, "max_steps=2", "save_every=1")
    records = (resumed / "checkpoints.jsonl").read_text().splitlines()
    kept = [line for line in records if json.loads(line)["name"] != "final"]
    assert len(kept) == len(records) - 1
    (resumed / "checkpoints.jsonl").write_text("".join(line + "\n" for line in kept))
    run_recipe(cookbook_server, key, "sl_loop", resumed, tiny_model_dir, *SL_ARGS, "max_steps=4", "save_every=1")

    # The resumed session trains a new Signal run made from the step-1 checkpoint (createRun fromCheckpoint).
    runs = cookbook_server.graphql("{ runs(sort: NEWEST) { step } }", key=key)["data"]["runs"]
    assert [run["step"] for run in runs] == [4, 2]
    second = {row["step"]: row["train_mean_nll"] for row in metrics(resumed)[2:]}  # the first run logged steps 0, 1
    assert sorted(second) == [1, 2, 3]
    for step in (1, 2, 3):
        assert second[step] == pytest.approx(uninterrupted[step], abs=1e-5)
    assert uninterrupted[3] < uninterrupted[0]  # it did train: the loss fell


# None: the recipe's own default, stable_reinforce (sampling with record_stability_info, datums with provenance).
@pytest.mark.parametrize("loss_fn", [None, "importance_sampling", "gspo"], ids=["default", "importance_sampling", "gspo"])
def test_rl_loop_trains_every_step(cookbook_server: LiveServer, tiny_model_dir: str, tmp_path: Path,
                                   loss_fn: str | None) -> None:
    key = cookbook_server.new_user()
    chosen = [] if loss_fn is None else [f"loss_fn={loss_fn}"]
    run_recipe(cookbook_server, key, "rl_loop", tmp_path / "rl", tiny_model_dir, *RL_ARGS, *chosen, "max_steps=2",
               "save_every=0")
    run = only_run(cookbook_server, key)
    assert run["step"] == 2
    # The manifest (append-only: the journal is compacted at each snapshot, the final save_state's included) lists
    # every step's batches with their loss functions.
    batches = [b for line in manifest(cookbook_server, run["id"]) if "adam" in line for b in line["batches"]]
    assert [b["loss_fn"] for b in batches] == [loss_fn or "stable_reinforce"] * 2
    assert all(b["num_examples"] == 16 for b in batches)  # batch_size 4 × group_size 4
