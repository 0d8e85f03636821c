"""tinker-cookbook's sl_loop, rl_loop and off-policy distillation (distillation.train_off_policy, soft targets),
unmodified, against a live Signal server on the tiny model (docs/TINKER.md).

Each recipe runs in a subprocess (the SDK's client holder is one thread per process) through
tests/tinker/cookbook_launcher.py, which gives it a local tokenizer, local datasets, a fixed LoRA seed and, for
rl_loop, a reward a random model can earn; the recipes' code is the wheel's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import resources
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
DISTILL_BATCH, TEACHER_TARGETS, DISTILL_MAX_LENGTH = 4, 4, 48
DATASET = "dataset_configs.0"  # train_off_policy's one domain: a supervised dataset and its teacher
DISTILL_ARGS = ["recipe_name=recipe_distillation_off_policy", f"batch_size={DISTILL_BATCH}", "learning_rate=1e-3",
                "lora_rank=4", f"n_teacher_targets={TEACHER_TARGETS}", "max_steps=2", "save_every=0", "eval_every=0",
                f"{DATASET}.dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
                f"{DATASET}.dataset_builder.common_config.model_name_for_tokenizer={COOKBOOK_MODEL}",
                f"{DATASET}.dataset_builder.common_config.renderer_name=role_colon",
                f"{DATASET}.dataset_builder.common_config.max_length={DISTILL_MAX_LENGTH}",
                f"{DATASET}.dataset_builder.common_config.batch_size={DISTILL_BATCH}",
                f"{DATASET}.teacher_config.base_model={COOKBOOK_MODEL}"]


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


def first_batch_losses(tiny_model_dir: str, conversations: str) -> tuple[float, float]:
    """The cookbook's first batch (its own builder, its shuffle) scored by the tiny base model in transformers, the
    step-0 student (LoRA's B starts at 0) and the teacher alike: the summed soft-target loss the recipe's call should
    report (-Σ_k w_k·log p(t_k) over the teacher's renormalised top-K, at the positions the datum trains), and the
    hard-target loss (-log p of the datum's own next token) a 1-D call would report instead."""
    import torch
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
    from transformers import AutoModelForCausalLM

    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=tiny_model_dir, renderer_name="role_colon",
                                            max_length=DISTILL_MAX_LENGTH, batch_size=DISTILL_BATCH)
    train, _ = FromConversationFileBuilder(common_config=common, file_path=conversations)()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    soft = hard = 0.0
    with torch.no_grad():
        for datum in train.get_batch(0):
            logprobs = torch.log_softmax(model(torch.tensor([datum.model_input.to_ints()])).logits[0].float(), -1)
            trained = datum.loss_fn_inputs["weights"].to_torch() > 0
            top = logprobs.topk(TEACHER_TARGETS, dim=-1).values[trained]
            soft -= float((torch.softmax(top, -1) * top).sum())
            targets = datum.loss_fn_inputs["target_tokens"].to_torch()
            hard -= float((logprobs.gather(-1, targets[:, None])[:, 0] * datum.loss_fn_inputs["weights"].to_torch()).sum())
    return soft, hard


def test_off_policy_distillation_trains_on_soft_targets(cookbook_server: LiveServer, tiny_model_dir: str,
                                                        tmp_path: Path) -> None:
    # train_off_policy.main as shipped: the student the tiny model with LoRA, the teacher a sampling client of the
    # same base, the wheel's conversations through the cookbook's own file builder.
    key = cookbook_server.new_user()
    log_path = tmp_path / "distill"
    conversations = resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    run_recipe(cookbook_server, key, "distillation.train_off_policy", log_path, tiny_model_dir, *DISTILL_ARGS,
               f"{DATASET}.dataset_builder.file_path={conversations}")
    run = only_run(cookbook_server, key)
    assert run["step"] == 2
    rows = metrics(log_path)
    assert [row["step"] for row in rows] == [0, 1]  # the recipe logs no optim_step metrics
    assert all(math.isfinite(row["train/loss:sum"]) and row["train/loss:sum"] > 0 for row in rows)
    # Step 0's loss is the teacher's top-K soft targets' (N × K target_tokens and weights on the wire), not the
    # datums' own next tokens'.
    soft, hard = first_batch_losses(tiny_model_dir, str(conversations))
    assert rows[0]["train/loss:sum"] == pytest.approx(soft, rel=1e-4)
    assert hard != pytest.approx(soft, rel=1e-2)
    batches = [b for line in manifest(cookbook_server, run["id"]) if "adam" in line for b in line["batches"]]
    assert [(b["loss_fn"], b["num_examples"]) for b in batches] == [("cross_entropy", DISTILL_BATCH)] * 2
    # The recipe sends hard targets only where the teacher answered no top-K ("falling back to hard targets").
    log = (log_path / "logs.log").read_text()
    assert log.count(f"collecting {TEACHER_TARGETS} teacher targets") == 2
    assert "falling back to hard targets" not in log
    # The recipe prints `loss=` from metrics["total_loss"], a key no server can send through SDK 0.38: its chunk
    # combine splits every metric name on ":" (a plain key raises ValueError) and `total_loss:sum` is another key.
    # Signal sends each metric with its reduction (the SDK keeps them all); the loss is train/loss:sum, checked above.
    assert all(":" in key for row in rows for key in row if key.startswith("train/"))
