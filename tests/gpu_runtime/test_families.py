"""Every family the catalogue serves (issue 32), each a tiny random model of transformers' own classes served through
the catalogue's `path:` field, as a new user meets it: attention-only and MLP (on a mixture-of-experts base: every
expert's) runs train; sampled logprobs equal forward's; two runs co-batched equal each alone; the adapter loads in
PEFT and the merged model in transformers with equal logprobs; a `state` checkpoint with its optimizer resumes
bitwise. One live server for the module; a new family is one line of tests/helpers/tiny_families.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from gpu_runtime.engine.engine import Engine
from rewardsignal import SignalClient
from tests.helpers.engine_tools import assert_same_grads, result_of, submit
from tests.helpers.live_server import LiveServer, settings_for
from tests.helpers.tiny_families import FAMILIES, MOE_FAMILIES, WINDOW, build_family, catalog_entry

PROMPT = [28120, 905, 314, 260, 3575, 282, 11, 99, 1116, 4722]  # longer than the sliding window
BATCH = [{"input": "The quick brown fox jumps over the lazy dog.", "output": " It runs and runs."},
         {"text": "Machine learning is transforming technology, one model at a time."}]
EXPERTS = ["down_proj", "gate_up_proj"]
assert len(PROMPT) > WINDOW
# PEFT 0.21 reads a property transformers 5 deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    tokenizer = Path(tiny_model_dir).parent / "smollm2-tokenizer"  # the session's, already read from the GGUF
    return {family: build_family(family, root / family, tokenizer) for family in FAMILIES}


@pytest.fixture(scope="module")
def server(family_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    data_dir = tmp_path_factory.mktemp("families-data")
    catalog = data_dir / "families.yaml"  # not models.yaml: settings_for writes its own there
    catalog.write_text(yaml.safe_dump({"models": [catalog_entry(family, path) for family, path in family_dirs.items()]}))
    live = LiveServer.start(settings_for(data_dir, family_dirs["llama"], models_file=catalog, default_model="tiny-llama"))
    yield live
    live.stop()


def test_every_family_the_runtime_serves_is_tested_here() -> None:
    from gpu_runtime.contract.families import MOE_FAMILIES as MOE_IN_CONTRACT
    from gpu_runtime.contract.families import SERVED_FAMILIES

    assert set(FAMILIES) == set(SERVED_FAMILIES) and set(MOE_FAMILIES) == MOE_IN_CONTRACT


def datum(tokens: list[int]) -> dict[str, Any]:
    return {"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:]}}


def logprobs(model: Any, tokens: list[int]) -> list[float]:
    """What `forward` reports, from a plain transformers model: each next token's log-probability."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1).tolist()


def trained(client: SignalClient, family: str, steps: int = 3, **lora: Any) -> tuple[Any, list[float]]:
    run = client.create_run(base_model=f"tiny-{family}", lora_r=4, lora_alpha=8, seed=1, **lora)
    losses = []
    for _ in range(steps):
        losses.append(run.forward_backward(batch=BATCH).loss)
        run.optim_step(learning_rate=5e-2)
    return run, losses


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_samples_and_exports(server: LiveServer, family_dirs: dict[str, str], family: str,
                                             tmp_path: Path) -> None:
    client = SignalClient(api_key=server.new_user(), base_url=server.url)
    attention, attention_losses = trained(client, family, steps=2)
    assert attention_losses[-1] < attention_losses[0]
    mlp, mlp_losses = trained(client, family, train_mlp=True)
    assert mlp_losses[-1] < mlp_losses[0]
    if family in MOE_FAMILIES:  # the experts' 3-D weights, not only attention
        assert set(EXPERTS) <= set(mlp.info.lora_target_modules)

    sampled = mlp.sample(prompt_tokens=[PROMPT], max_tokens=6, temperature=1.0, seed=3, stop=[]).sequences[0][0]
    tokens = PROMPT + sampled.tokens
    forward = mlp.forward(batch=[datum(tokens)]).outputs[0].logprobs
    assert forward[len(PROMPT) - 1:] == pytest.approx(sampled.logprobs, abs=1e-4)

    adapter = mlp.save_state(mode="adapter").download(tmp_path / "adapter")
    merged = mlp.save_state(mode="merged").download(tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    assert logprobs(peft, tokens) == pytest.approx(forward, abs=1e-4)
    loaded: Any = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32, output_loading_info=True)
    plain, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert logprobs(plain.eval(), tokens) == pytest.approx(forward, abs=1e-4)
    greedy = mlp.sample(prompt_tokens=[PROMPT], max_tokens=6, temperature=0.0, stop=[]).sequences[0][0].tokens
    with torch.no_grad():
        generated = plain.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert greedy == generated[0, len(PROMPT):].tolist()

    state = mlp.save_state(mode="state", with_optimizer=True)
    resumed = client.create_run(from_checkpoint=state)
    for run in (mlp, resumed):
        run.forward_backward(batch=BATCH)
        run.optim_step(learning_rate=5e-2)
    assert resumed.forward(batch=[datum(tokens)]).outputs[0].logprobs == mlp.forward(batch=[datum(tokens)]).outputs[0].logprobs


def test_merged_qwen3_moe_writes_one_tensor_per_expert(server: LiveServer, tmp_path: Path) -> None:
    from safetensors import safe_open

    client = SignalClient(api_key=server.new_user(), base_url=server.url)
    run, _ = trained(client, "qwen3_moe", steps=1, train_mlp=True)
    merged = run.save_state(mode="merged").download(tmp_path / "merged")
    with safe_open(str(Path(merged) / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    assert {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_runs_cobatched_equal_each_alone(family: str, family_dirs: dict[str, str], tmp_path: Path) -> None:
    # Dropout on the experts too: the masks are keyed by run and call, so sharing a pass draws the same ones.
    runs: dict[str, tuple[dict[str, Any], list[dict[str, Any]], int]]
    runs = {"a": ({"r": 4, "alpha": 8, "dropout": 0.1, "train_mlp": True}, BATCH[:1], 1),
            "b": ({"r": 8, "alpha": 8, "target_modules": ["gate_up_proj", "q_proj"]}, BATCH[1:], 2)}

    def engine_with(path: Path, names: list[str]) -> Engine:
        engine = Engine(path, device="cpu")
        for name in names:
            engine.create_run(name, "u1", family_dirs[family], runs[name][0], seed=runs[name][2])
        return engine

    def grads(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in engine.runs[run_id].named_parameters().items() if p.grad is not None}

    together = engine_with(tmp_path / "together", list(runs))
    futures = {name: submit(together, "forward_backward", run_id=name, batch=runs[name][1]) for name in runs}
    assert together.tick().base_passes == 1
    losses = {name: result_of(future)["loss"] for name, future in futures.items()}
    for name in runs:
        alone = engine_with(tmp_path / f"alone-{name}", [name])
        assert alone.forward_backward(name, runs[name][1])["loss"] == pytest.approx(losses[name], rel=1e-5)
        assert_same_grads(grads(alone, name), grads(together, name))
    expert_grads = [n for n in grads(together, "a") if ".experts." in n]
    assert expert_grads and all(grads(together, "a")[n].abs().max() > 0 for n in expert_grads if "lora_B" in n)
