"""GPU allocation: the README's rules over the catalogue, the memory fit check, overrides, Modal's GPU strings
and the pool key; then createRun and `models` over GraphQL against a live server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from app.catalog import Catalog, available_frameworks
from gpu_runtime.client.allocation import (
    GB,
    GPU_TYPES,
    LORA_STATE_BYTES,
    PARAMS_PER_HIDDEN_SQUARED,
    VOCAB_ESTIMATE,
    GpuAllocation,
    LoraTargets,
    PoolKey,
    allocate,
    check_fit,
    estimate_bytes,
    fits,
    legal_counts,
    lora_parameters,
    modal_gpu,
    parse_gpu_config,
    pool_key,
    require_single_gpu,
    smallest_fit,
    smallest_single_gpu,
)
from gpu_runtime.errors import BadInput
from rewardsignal import SignalClient
from tests.helpers.live_server import TINY_MODEL, LiveServer, error_code, settings_for

CATALOG = Catalog.from_file(Path(__file__).resolve().parents[2] / "config" / "models.yaml")
B = 1_000_000_000
LLAMA_8B, LLAMA_70B, QWEN_32B = 8_030_000_000, 70_600_000_000, 32_800_000_000

# The product README's table, written out as it reads: (parameters, allocation).
README_RULES = [(135_000_000, "L40S:1"), (3 * B, "L40S:1"), (7_620_000_000, "A100-80GB:1"), (9 * B, "A100-80GB:1"),
                (14 * B, "A100-80GB:2"), (32 * B, "A100-80GB:4"), (LLAMA_70B, "A100-80GB:4"), (405 * B, "A100-80GB:8")]
# What Modal is asked for, per catalogue entry.
MODAL_GPU = {"HuggingFaceTB/SmolLM2-135M-Instruct": "L40S", "meta-llama/Llama-3.2-1B": "L40S",
             "meta-llama/Llama-3.2-3B": "L40S", "meta-llama/Llama-3.1-8B": "A100-80GB",
             "meta-llama/Llama-3.1-8B-Instruct": "A100-80GB", "meta-llama/Llama-3.1-70B": "A100-80GB:4",
             "meta-llama/Llama-3.3-70B-Instruct": "A100-80GB:4", "google/gemma-2-2b": "L40S",
             "google/gemma-2-9b": "A100-80GB", "unsloth/gemma-2-9b-it-bnb-4bit": "A100-80GB",
             "Qwen/Qwen2.5-3B": "L40S", "Qwen/Qwen2.5-7B": "A100-80GB", "Qwen/Qwen2.5-14B": "A100-80GB:2",
             "Qwen/Qwen2.5-32B": "A100-80GB:4",
             # Issue 32's current catalogue; mixture-of-experts entries hold every expert (the smallest that fits).
             "meta-llama/Llama-3.2-1B-Instruct": "L40S", "meta-llama/Llama-3.2-3B-Instruct": "L40S",
             "Qwen/Qwen3-0.6B": "L40S", "Qwen/Qwen3-4B": "L40S", "Qwen/Qwen3-8B": "A100-80GB",
             "Qwen/Qwen3-32B": "A100-80GB:4", "Qwen/Qwen3-30B-A3B": "A100-80GB", "Qwen/Qwen3-235B-A22B": "H200:4",
             "Qwen/Qwen3.5-27B": "A100-80GB:2", "Qwen/Qwen3.5-35B-A3B": "A100-80GB",
             "openai/gpt-oss-20b": "L40S", "openai/gpt-oss-120b": "H200:2",
             "google/gemma-3-1b-it": "L40S", "allenai/Olmo-3-7B-Instruct": "A100-80GB"}


@pytest.mark.parametrize("model", CATALOG.list(), ids=lambda model: model.name)
def test_catalogue_entry_follows_the_rules_and_fits(model) -> None:
    allocation = parse_gpu_config(model.gpu)
    targets = model.lora_targets({})  # a MoE entry's: its experts' shape and active parameters
    expected = allocate(model.parameters) if model.experts is None else smallest_fit(model.parameters, targets=targets)
    assert allocation == expected
    assert check_fit(model.name, model.parameters, allocation, targets=targets) == allocation
    assert estimate_bytes(model.parameters, targets=targets) <= allocation.memory_gb * GB
    assert modal_gpu(allocation) == MODAL_GPU[model.name]
    assert model.context_length is not None and model.context_length >= 8192
    assert model.framework == ("unsloth" if model.name.startswith("unsloth/") else "transformers")
    if model.available:
        assert CATALOG.resolve_gpu(model, None) == model.gpu


def test_every_catalogue_entry_has_an_expected_modal_string() -> None:
    assert sorted(MODAL_GPU) == sorted(model.name for model in CATALOG.list())


@pytest.mark.parametrize(("parameters", "expected"), README_RULES)
def test_readme_rules(parameters: int, expected: str) -> None:
    assert str(allocate(parameters)) == expected


@pytest.mark.parametrize(("text", "canonical", "modal"), [
    ("H100:1", "H100:1", "H100"), ("h100", "H100:1", "H100"), ("A10G", "A10:1", "A10"), ("a10g:2", "A10:2", "A10:2"),
    ("L40S:2", "L40S:2", "L40S:2"), ("a100-80gb:4", "A100-80GB:4", "A100-80GB:4"), ("A100-40GB", "A100:1", "A100"),
    ("H200", "H200:1", "H200"), ("B200:8", "B200:8", "B200:8"), ("L4", "L4:1", "L4"), ("T4:8", "T4:8", "T4:8"),
])
def test_overrides_parse_to_canonical_and_modal_strings(text: str, canonical: str, modal: str) -> None:
    assert str(parse_gpu_config(text)) == canonical
    assert modal_gpu(text) == modal == modal_gpu(parse_gpu_config(text))


@pytest.mark.parametrize(("text", "says"), [
    ("Z80", "unknown GPU type"), ("V100:1", "unknown GPU type"), ("H100:0", "between 1 and 8"),
    ("H100:9", "between 1 and 8"), ("A10:5", "between 1 and 4"), ("H100:two", "must be an integer"),
])
def test_invalid_overrides_name_the_field(text: str, says: str) -> None:
    with pytest.raises(BadInput, match=says) as caught:
        parse_gpu_config(text, field="gpuConfig")
    assert caught.value.field == "gpuConfig"


def test_fit_check_refuses_a_70b_on_one_t4_naming_the_smallest_fit() -> None:
    with pytest.raises(BadInput) as caught:
        check_fit("meta-llama/Llama-3.1-70B", LLAMA_70B, "T4:1")
    assert caught.value.field == "gpuConfig"
    need = estimate_bytes(LLAMA_70B) / GB
    assert 170 < need < 180  # 141 GB of bf16 weights, a 20% + 2 GiB margin, LoRA with AdamW
    assert f"~{need:.1f} GB" in caught.value.message
    assert "the smallest that fits is B200:1" in caught.value.message  # fewest GPUs first, then the smallest


@pytest.mark.parametrize(("parameters", "gpu", "fits"), [
    (LLAMA_8B, "H100:1", True), (LLAMA_8B, "L4:1", True), (LLAMA_8B, "A10G", True), (LLAMA_8B, "T4:1", False),
    (LLAMA_8B, "T4:2", True), (LLAMA_70B, "H100:1", False), (LLAMA_70B, "H200:1", False),
    (LLAMA_70B, "H100:4", True), (LLAMA_70B, "A100-80GB:2", False), (LLAMA_70B, "A100-80GB:3", False), (QWEN_32B, "H100:1", False),
    (QWEN_32B, "L40S:2", True), (405 * B, "B200:8", True), (405 * B, "H100:8", False),
])
def test_overrides_are_checked_to_fit(parameters: int, gpu: str, fits: bool) -> None:
    if fits:
        assert str(check_fit("m", parameters, gpu)) == str(parse_gpu_config(gpu))
    else:
        with pytest.raises(BadInput, match="the smallest that fits is") as caught:
            check_fit("m", parameters, gpu)
        assert caught.value.field == "gpuConfig"


def test_a_70b_in_bf16_needs_4_x_80_gb_or_2_x_141_gb_and_in_4bit_one_80_gb_gpu() -> None:
    # FSDP shards the base: each GPU holds its share of the weights, and every run's LoRA with AdamW in full.
    assert legal_counts("A100-80GB", LLAMA_70B) == legal_counts("H100", LLAMA_70B) == [4, 8]
    assert legal_counts("H200", LLAMA_70B) == [2, 4, 8]
    assert legal_counts("H100", LLAMA_70B, "4bit") == [1]  # quantized bases train on one GPU
    assert check_fit("m", LLAMA_70B, "H100", "4bit") == GpuAllocation("H100", 1)
    with pytest.raises(BadInput) as caught:
        check_fit("meta-llama/Llama-3.1-70B", LLAMA_70B, "A100-80GB:2")
    need = estimate_bytes(LLAMA_70B, gpus=2) / GB
    assert caught.value.message == (
        f"A100-80GB:2 has 80 GB per GPU but meta-llama/Llama-3.1-70B needs ~{need:.1f} GB on each (bf16 weights, "
        "LoRA with AdamW state, activations); on A100-80GB it fits with 4 or 8 GPUs; the smallest that fits is B200:1")
    with pytest.raises(BadInput, match="a pool has 1, 2, 4 or 8 GPUs, not 3; on H100 it fits with 4 or 8 GPUs"):
        check_fit("m", LLAMA_70B, "H100:3")
    with pytest.raises(BadInput, match="a 4bit base trains on one GPU, not 2; on H100 it fits with 1 GPU;"):
        check_fit("m", LLAMA_70B, "H100:2", "4bit")


def test_the_fit_counts_every_resident_runs_lora() -> None:
    one, ten = estimate_bytes(LLAMA_8B, runs=1), estimate_bytes(LLAMA_8B, runs=10)
    assert ten - one == 9 * lora_parameters(LLAMA_8B) * 16  # fp32 weight, gradient and two AdamW moments per run
    assert fits(GpuAllocation("L4", 1), LLAMA_8B, runs=1) and not fits(GpuAllocation("L4", 1), LLAMA_8B, runs=10)


def test_quantization_shrinks_the_estimate() -> None:
    bf16, int8, nf4 = (estimate_bytes(LLAMA_70B, q) for q in (None, "8bit", "4bit"))
    assert bf16 > int8 > nf4
    assert str(smallest_fit(LLAMA_70B, "4bit")) == "L40S:1"
    with pytest.raises(BadInput) as caught:
        estimate_bytes(LLAMA_8B, "3bit")
    assert caught.value.field == "quantization"


def test_smallest_single_gpu() -> None:
    assert smallest_single_gpu(LLAMA_70B) == GpuAllocation("B200", 1)  # ~174 GB: more than an H200's 141
    assert smallest_single_gpu(QWEN_32B) == GpuAllocation("H200", 1)  # ~82 GB: just over an H100's 80
    assert smallest_single_gpu(LLAMA_8B) == GpuAllocation("L4", 1)
    assert smallest_single_gpu(100 * B) is None
    assert smallest_single_gpu(100 * B, "8bit") == GpuAllocation("H200", 1)
    assert smallest_single_gpu(405 * B, "4bit") is None


def test_require_single_gpu_names_the_smallest_single_gpu() -> None:
    assert require_single_gpu("H100", LLAMA_8B) == GpuAllocation("H100", 1)
    with pytest.raises(BadInput, match=r"smallest single GPU that holds it is H200:1 \(141 GB\)") as caught:
        require_single_gpu("A100-80GB:4", QWEN_32B)
    assert caught.value.field == "gpuConfig"
    with pytest.raises(BadInput, match="is B200:1"):
        require_single_gpu("H100:4", LLAMA_70B)
    with pytest.raises(BadInput, match="no single GPU holds it .*with 8bit quantization H200:1 does"):
        require_single_gpu("B200:2", 100 * B)
    with pytest.raises(BadInput, match=r"no single GPU holds it \(the largest, B200, has 180 GB\)$"):
        require_single_gpu("B200:8", 405 * B)


def test_pool_key_is_canonical() -> None:
    key = pool_key("meta-llama/Llama-3.1-8B", "H100", None)
    assert key == pool_key("meta-llama/Llama-3.1-8B", "h100:1", "none") == "meta-llama/Llama-3.1-8B|H100:1|none"
    assert pool_key("m", "a10g", "4BIT") == pool_key("m", "A10:1", "4bit") == "m|A10:1|4bit"
    assert pool_key("m", "H100", None) != pool_key("m", "H100:2", None) != pool_key("m", "H100:2", "8bit")
    with pytest.raises(BadInput):
        pool_key("m", "Z80", None)


def test_gpu_types_include_the_readme_and_modal() -> None:
    assert set(GPU_TYPES) == {"T4", "L4", "A10", "L40S", "A100", "A100-80GB", "H100", "H200", "B200"}
    assert (GPU_TYPES["H200"], GPU_TYPES["B200"], GPU_TYPES["L4"]) == (141, 180, 24)


# ---- the catalogue loader ----------------------------------------------------------------------------

def _load(tmp_path: Path, entry: dict, frameworks: set[str] | None = None) -> Catalog:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": [entry]}))
    return Catalog.from_file(path, frameworks=frameworks)


@pytest.mark.parametrize(("extra", "says"), [
    ({"context_length": 0}, "context_length must be a positive integer"),
    ({"context_length": "long"}, "context_length must be a positive integer"),
    ({"framework": "jax"}, "framework must be one of transformers, unsloth"),
    ({"quantization_allowed": "yes"}, "quantization_allowed must be true or false"),
    ({"contxt_length": 4096}, "unknown field"),
    ({"gpu": "T4:1"}, "the smallest that fits is"),
    ({"parameters": -1}, "parameters must be a non-negative integer"),
])
def test_catalogue_loader_rejects_bad_entries(tmp_path: Path, extra: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        _load(tmp_path, {"name": "big", "parameters": LLAMA_70B, **extra})


def test_unsloth_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    entry = {"name": "u", "parameters": 1 * B, "framework": "unsloth", "quantization_allowed": True}
    without = _load(tmp_path, entry, frameworks={"transformers"})
    model = without.get("u")
    assert not model.available and "unsloth" in (model.unavailable or "")
    with pytest.raises(BadInput, match="cannot be used here") as caught:
        without.resolve_gpu(model, None)
    assert caught.value.field == "baseModel"
    with_it = _load(tmp_path, entry, frameworks={"transformers", "unsloth"})
    assert with_it.resolve_gpu(with_it.get("u"), "a10g", quantization="4bit") == "A10:1"


def test_quantization_only_where_allowed(tmp_path: Path) -> None:
    catalog = _load(tmp_path, {"name": "q", "parameters": LLAMA_70B})
    with pytest.raises(BadInput, match="does not allow quantization") as caught:
        catalog.resolve_gpu(catalog.get("q"), None, quantization="4bit")
    assert caught.value.field == "quantization"


def test_a_high_lora_rank_is_part_of_the_fit(tmp_path: Path) -> None:
    catalog = _load(tmp_path, {"name": "m", "parameters": LLAMA_8B, "gpu": "L4:1"})
    assert catalog.resolve_gpu(catalog.get("m"), None) == "L4:1"
    with pytest.raises(BadInput, match="the smallest that fits is"):
        catalog.resolve_gpu(catalog.get("m"), None, lora_r=512)


@pytest.mark.parametrize("vocab", [None, 49_152, 128_256], ids=["estimate", "smollm2", "llama3"])
@pytest.mark.parametrize("r", [8, 32])
def test_the_unembedding_adds_its_vocab_by_r_term_to_the_fit(vocab: int | None, r: int) -> None:
    hidden = (LLAMA_8B / PARAMS_PER_HIDDEN_SQUARED) ** 0.5
    unembed = LoraTargets(unembed=True, vocab=vocab)
    extra = lora_parameters(LLAMA_8B, r, targets=unembed) - lora_parameters(LLAMA_8B, r)
    assert extra == int(r * (hidden + (vocab or VOCAB_ESTIMATE)))  # A is [r, hidden], B is [vocab, r]
    grown = estimate_bytes(LLAMA_8B, lora_r=r, targets=unembed) - estimate_bytes(LLAMA_8B, lora_r=r)
    assert abs(grown - extra * LORA_STATE_BYTES) <= 1  # with its gradient and AdamW's moments


def test_the_mlp_and_every_family_grow_the_fit() -> None:
    attention = lora_parameters(LLAMA_8B)
    assert lora_parameters(LLAMA_8B, targets=LoraTargets(mlp=True)) == pytest.approx(3 * attention, rel=1e-6)
    assert lora_parameters(LLAMA_8B, targets=LoraTargets(attention=False, mlp=True)) == pytest.approx(2 * attention,
                                                                                                     rel=1e-6)
    assert LoraTargets.of({"train_attn": False, "train_unembed": True}) == LoraTargets(False, False, True)


def test_a_run_on_the_unembedding_can_need_a_bigger_gpu(tmp_path: Path) -> None:
    # A 32B on one H200: attention LoRA at r=512 fits; with the MLP and the unembedding it does not, and says why.
    catalog = _load(tmp_path, {"name": "m", "parameters": QWEN_32B, "gpu": "H200:1", "vocab_size": 152_064})
    model = catalog.get("m")
    assert model.vocab_size == 152_064
    assert catalog.resolve_gpu(model, None, lora_r=512) == "H200:1"
    with pytest.raises(BadInput, match=r"LoRA \(with MLP and unembedding\) with AdamW state") as refused:
        catalog.resolve_gpu(model, None, lora_r=512, targets=model.lora_targets(
            {"train_attn": True, "train_mlp": True, "train_unembed": True}))
    assert refused.value.field == "gpuConfig"


# ---- over the API --------------------------------------------------------------------------------------

CREATE = "mutation($input: CreateRunInput) { createRun(input: $input) { id gpuConfig baseModel } }"
MODELS = ("{ models { name gpu contextLength framework quantizationAllowed available unavailableReason "
          "estimatedMemoryGb } }")


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A live server whose catalogue holds, beside the tiny model, a 70B and an unsloth entry (never loaded:
    createRun refuses them before the runtime is asked)."""
    data_dir = tmp_path_factory.mktemp("signal-allocation")
    catalog = data_dir / "catalog.yaml"
    catalog.write_text(yaml.safe_dump({"models": [
        {"name": TINY_MODEL, "path": tiny_model_dir, "family": "llama", "parameters": 1_000_000, "offline": True,
         "context_length": 2048, "quantization_allowed": True},
        {"name": "meta-llama/Llama-3.1-70B", "family": "llama", "parameters": LLAMA_70B, "context_length": 131072},
        {"name": "unsloth/gemma-2-9b-it-bnb-4bit", "family": "gemma", "parameters": 9_240_000_000,
         "context_length": 8192, "framework": "unsloth", "quantized": "4bit"},
    ]}))
    live = LiveServer.start(settings_for(data_dir, tiny_model_dir, models_file=catalog))
    yield live
    live.stop()


def test_create_run_refuses_a_gpu_config_that_cannot_hold_the_model(server: LiveServer) -> None:
    key = server.new_user()
    body = server.graphql(CREATE, {"input": {"baseModel": "meta-llama/Llama-3.1-70B", "gpuConfig": "T4:1"}}, key=key)
    assert error_code(body) == "BAD_INPUT", body
    error = body["errors"][0]
    assert error["extensions"]["field"] == "gpuConfig"
    assert "smallest that fits is B200:1" in error["message"]
    assert server.graphql("{ runs { id } }", key=key)["data"]["runs"] == []


def test_create_run_stores_the_chosen_gpu(server: LiveServer) -> None:
    key = server.new_user()
    body = server.graphql(CREATE, {"input": {"loraR": 4, "gpuConfig": "a10g"}}, key=key)
    assert "errors" not in body, body
    assert body["data"]["createRun"]["gpuConfig"] == "A10:1"
    run_id = body["data"]["createRun"]["id"]
    shown = server.graphql("query($id: ID!) { run(id: $id) { gpuConfig } }", {"id": run_id}, key=key)
    assert shown["data"]["run"]["gpuConfig"] == "A10:1"
    default = server.graphql(CREATE, {"input": {"loraR": 4}}, key=key)
    assert default["data"]["createRun"]["gpuConfig"] == "L40S:1"


def test_unsloth_entry_over_the_api(server: LiveServer) -> None:
    key = server.new_user()
    body = server.graphql(CREATE, {"input": {"baseModel": "unsloth/gemma-2-9b-it-bnb-4bit"}}, key=key)
    if "unsloth" in available_frameworks():
        assert error_code(body) != "BAD_INPUT", body
    else:
        assert error_code(body) == "BAD_INPUT" and body["errors"][0]["extensions"]["field"] == "baseModel", body
        assert "unsloth" in body["errors"][0]["message"]


@pytest.mark.parametrize(("switches", "targets"), [
    ({"train_unembed": True}, ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]),
    ({"train_attn": False, "train_mlp": True}, ["down_proj", "gate_proj", "up_proj"]),
], ids=["unembed", "mlp-only"])
def test_create_run_takes_tinkers_switches(server: LiveServer, switches: dict, targets: list[str]) -> None:
    key = server.new_user()
    with SignalClient(api_key=key, base_url=server.url) as client:
        run = client.create_run(lora_r=4, **switches)
    assert run.info.lora_target_modules == targets
    shown = server.graphql("query($id: ID!) { run(id: $id) { loraTargetModules } }", {"id": run.id}, key=key)
    assert shown["data"]["run"]["loraTargetModules"] == targets


@pytest.mark.parametrize(("spec", "field"), [
    ({"loraTargetModules": ["q_proj"], "trainMlp": True}, "loraTargetModules"),
    ({"trainAttn": False}, "trainAttn"),
], ids=["targets-and-switch", "all-off"])
def test_create_run_refuses_bad_switches_naming_the_field(server: LiveServer, spec: dict, field: str) -> None:
    key = server.new_user()
    body = server.graphql(CREATE, {"input": spec}, key=key)
    assert error_code(body) == "BAD_INPUT" and body["errors"][0]["extensions"]["field"] == field, body


def test_models_query_and_sdk_show_the_catalogue_fields(server: LiveServer) -> None:
    key = server.new_user()
    models = {model["name"]: model for model in server.graphql(MODELS, key=key)["data"]["models"]}
    big = models["meta-llama/Llama-3.1-70B"]
    assert big == {"name": "meta-llama/Llama-3.1-70B", "gpu": "A100-80GB:4", "contextLength": 131072,
                   "framework": "transformers", "quantizationAllowed": False, "available": True,
                   "unavailableReason": None, "estimatedMemoryGb": round(estimate_bytes(LLAMA_70B) / GB, 1)}
    assert models[TINY_MODEL]["contextLength"] == 2048 and models[TINY_MODEL]["quantizationAllowed"] is True
    unsloth = models["unsloth/gemma-2-9b-it-bnb-4bit"]
    assert unsloth["framework"] == "unsloth" and unsloth["available"] == ("unsloth" in available_frameworks())
    with SignalClient(api_key=key, base_url=server.url) as client:
        detailed = {model["name"]: model for model in client.list_models(detailed=True)}
    assert detailed["meta-llama/Llama-3.1-70B"].context_length == 131072  # the SDK's results are snake_case
    assert detailed["meta-llama/Llama-3.1-70B"]["quantization_allowed"] is False
    assert detailed[TINY_MODEL].framework == "transformers" and detailed[TINY_MODEL].gpu == "L40S:1"


# ---- quantization ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "field", "message"), [
    ({"baseModel": "meta-llama/Llama-3.1-70B", "quantization": "4bit"}, "quantization", "does not allow quantization"),
    ({"quantization": "4bit", "gpuConfig": "L40S:2"}, "quantization", "trains on one GPU only"),
    ({"quantization": "2bit"}, "quantization", "quantization must be none, 8bit or 4bit"),
    ({"baseModel": "unsloth/gemma-2-9b-it-bnb-4bit", "quantization": "8bit"}, "baseModel", "unsloth"),
], ids=["catalogue-forbids", "multi-gpu", "unknown", "unsloth-missing-first"])
def test_quantization_refusals_name_the_field(server: LiveServer, spec: dict, field: str, message: str) -> None:
    key = server.new_user()
    body = server.graphql(CREATE, {"input": {"loraR": 4, **spec}}, key=key)
    assert error_code(body) == "BAD_INPUT", body
    assert body["errors"][0]["extensions"]["field"] == field and message in body["errors"][0]["message"], body
    assert server.graphql("{ runs { id } }", key=key)["data"]["runs"] == []


def test_a_pre_quantized_model_says_so_and_refuses_another_precision(tmp_path: Path) -> None:
    catalog = _load(tmp_path, {"name": "q", "parameters": 1 * B, "quantized": "4bit"})
    model = catalog.get("q")
    assert model.quantized == "4bit" and model.quantization_allowed
    assert catalog.resolve_quantization(model, None) == "4bit"
    with pytest.raises(BadInput, match="already quantized to 4bit") as caught:
        catalog.resolve_quantization(model, "8bit")
    assert caught.value.field == "quantization"


def test_a_4bit_run_trains_through_the_sdk_and_shows_its_quantization(server: LiveServer) -> None:
    key = server.new_user()
    models = {m["name"]: m for m in server.graphql("{ models { name quantized } }", key=key)["data"]["models"]}
    assert models["unsloth/gemma-2-9b-it-bnb-4bit"]["quantized"] == "4bit" and models[TINY_MODEL]["quantized"] is None
    with SignalClient(api_key=key, base_url=server.url) as client:
        run = client.create_run(lora_r=4, quantization="4bit")
        plain = client.create_run(lora_r=4)
        assert run.info["quantization"] == "4bit" and plain.info["quantization"] is None
        batch = [{"input": "Q: 2 + 2?\nA:", "output": " 4"}]
        first = run.forward_backward(batch)
        run.optim_step(learning_rate=1e-2)
        assert run.forward_backward(batch).loss < first.loss
        assert plain.forward_backward(batch).loss != pytest.approx(first.loss, abs=1e-6)  # the unquantized base
    shown = server.graphql("query($id: ID!) { run(id: $id) { quantization gpuConfig } }", {"id": run.id}, key=key)
    assert shown["data"]["run"] == {"quantization": "4bit", "gpuConfig": "L40S:1"}


@pytest.mark.parametrize(("base", "gpu", "quantization", "key"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "l40s", None, "HuggingFaceTB/SmolLM2-135M-Instruct|L40S:1|none"),
    ("m", "h100:4", "4BIT", "m|H100:4|4bit"),
    ("/tmp/tiny model", "A10G", "none", "/tmp/tiny model|A10:1|none"),
])
def test_a_pool_key_has_one_spelling_and_parses_back(base: str, gpu: str, quantization: str | None, key: str) -> None:
    assert pool_key(base, gpu, quantization) == key
    parsed = PoolKey.parse(key)
    assert (parsed.base_model, str(parsed.gpu)) == (base, key.split("|")[1])
    assert parsed.quantization == (None if key.endswith("|none") else key.rsplit("|", 1)[1])
    assert str(parsed) == key


@pytest.mark.parametrize(("key", "field"), [("no-bars", "pool"), ("|L40S:1|none", "pool"), ("m|L40S|none|x", "pool"),
                                            ("m|TPU:1|none", "gpuConfig"), ("m|L40S:1|3bit", "quantization")])
def test_a_malformed_pool_key_is_refused_naming_the_part(key: str, field: str) -> None:
    with pytest.raises(BadInput) as refused:
        PoolKey.parse(key)
    assert refused.value.field == field
