"""The memory a pass and the resident runs are given (issue 30, item 6): the resident budget sized from the device's
free memory when none is set, a pass's activations at the token budget set aside, and the fit estimate counting those
activations. Free memory is passed in as a figure (what `torch.cuda.mem_get_info` would say), so these run anywhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.client.allocation import (
    ACTIVATION_FIXED_BYTES,
    GB,
    estimate_bytes,
    estimated_pass_bytes,
    layer_activation_values,
    pass_activation_bytes,
)
from gpu_runtime.compute.memory_fit import layers_to_checkpoint, pass_reserve, resident_budget
from gpu_runtime.contract import RuntimeOptions
from gpu_runtime.contract.runtime_options import RESIDENT_BYTES_UNMEASURED
from gpu_runtime.engine.engine import Engine
from gpu_runtime.errors import BadInput

# Llama-3.1-8B: 32 decoder layers, hidden 4096, intermediate 14336, bf16; 16.06 GB of weights
LLAMA_8B_LAYERS = 32
LLAMA_8B_PER_TOKEN = (2 * layer_activation_values(4096, 14336)[0], 2 * layer_activation_values(4096, 14336)[1])
TOKENS = RuntimeOptions.tick_tokens  # 8192


def test_a_pass_of_8192_tokens_on_llama_8b_keeps_56_gb_whole_and_2_gb_with_every_layer_recomputed() -> None:
    assert LLAMA_8B_PER_TOKEN == (212_992, 8192)  # (12·4096 + 4·14336)·2 bytes, and the layer's input
    whole = pass_activation_bytes(LLAMA_8B_LAYERS, TOKENS, LLAMA_8B_PER_TOKEN)
    floor = pass_activation_bytes(LLAMA_8B_LAYERS, TOKENS, LLAMA_8B_PER_TOKEN, checkpointed=LLAMA_8B_LAYERS)
    assert (whole, floor) == (55_834_574_848, 2_147_483_648)


@pytest.mark.parametrize(("free_gb", "reserve"), [
    (200, 55_834_574_848),  # an H200 and more: the pass keeps its activations whole (≤ half the free memory)
    (63, 31_500_000_000),  # an 80 GB GPU beside the 8B base: half the free memory, the pass recomputes some layers
    (3, 2_147_483_648),  # nearly full: never less than the every-layer-recomputed floor
])
def test_the_pass_reserve_is_its_activations_whole_up_to_half_the_free_memory(free_gb: int, reserve: int) -> None:
    assert pass_reserve(LLAMA_8B_LAYERS, TOKENS, LLAMA_8B_PER_TOKEN, free_gb * GB) == reserve


def test_the_resident_budget_of_an_80_gb_gpu_beside_an_8b_base_holds_forty_runs_where_2_gib_held_four() -> None:
    free = 63 * GB
    budget = resident_budget(free, 0, pass_reserve(LLAMA_8B_LAYERS, TOKENS, LLAMA_8B_PER_TOKEN, free))
    assert budget == int(0.8 * 63 * GB) - 31_500_000_000 == 18_900_000_000
    one_run = 27_262_976 * 16  # r=32 on q, k, v, o of 32 layers: 27.3M parameters, 16 bytes each with AdamW
    assert budget // one_run == 43 and RESIDENT_BYTES_UNMEASURED // one_run == 4
    # what runs hold counts as theirs: the budget stays put as they grow into the free memory
    assert resident_budget(free - 10 * GB, 10 * GB, 31_500_000_000) == budget
    # and the pass then checkpoints what no longer fits beside them
    assert layers_to_checkpoint(LLAMA_8B_LAYERS, TOKENS, LLAMA_8B_PER_TOKEN, free - budget) == 13


def test_where_nothing_is_measured_the_budget_is_2_gib() -> None:
    assert resident_budget(None, 5 * GB, 0) == RESIDENT_BYTES_UNMEASURED == 2 * 1024**3


def test_a_set_resident_bytes_wins_and_zero_asks_for_sizing(tmp_path: Path) -> None:
    assert RuntimeOptions().resident_bytes == 0
    assert Engine(tmp_path / "set", device="cpu", resident_bytes=12345).residency.budget_bytes() == 12345
    engine = Engine(tmp_path / "sized", device="cpu")
    assert engine.residency.budget_bytes() == RESIDENT_BYTES_UNMEASURED  # a CPU: nothing measured
    assert engine.runtime_state()["budget"]["bytes"] == RESIDENT_BYTES_UNMEASURED
    with pytest.raises(BadInput, match=r"resident_bytes must be a positive number \(or 0: sized by the runtime\)") as caught:
        RuntimeOptions(resident_bytes=-1)
    assert caught.value.field == "resident_bytes"
    with pytest.raises(BadInput, match="tick_tokens must be a positive number, got 0"):
        RuntimeOptions(tick_tokens=0)


def test_the_fit_counts_a_pass_at_the_token_budget() -> None:
    one_b = 1_240_000_000  # a 1B-class model (hidden ≈ 1575, 42 layers by the rule): its pass's floor (1.1 GB) is past 20% of its weights (0.5 GB)
    assert estimated_pass_bytes(one_b) == 1_083_801_600
    base = estimate_bytes(one_b, tokens=0)  # no pass: the 20% share of the weights stands in
    assert estimate_bytes(one_b) - base == 1_083_801_600 - int(0.2 * 2 * one_b)
    # a bigger token budget needs more; on two GPUs each holds half the rows
    assert estimated_pass_bytes(one_b, 4 * TOKENS) == 4 * 1_083_801_600
    assert estimate_bytes(one_b, tokens=4 * TOKENS) > estimate_bytes(one_b)
    assert estimate_bytes(one_b, gpus=2, tokens=2 * TOKENS) - estimate_bytes(one_b, gpus=2, tokens=0) == (
        1_083_801_600 - int(0.2 * 2 * one_b / 2))
    # a 70B's 20% weight margin (28 GB) is past its pass's floor (8 GB): unchanged from before
    assert estimate_bytes(70_600_000_000) == estimate_bytes(70_600_000_000, tokens=0)
    assert estimate_bytes(one_b, tokens=0) > ACTIVATION_FIXED_BYTES
