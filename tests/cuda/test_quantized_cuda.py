"""Training steps on 8-bit and 4-bit (NF4) bases on CUDA, with bitsandbytes' CUDA kernels (skipped without
bitsandbytes: bench/gpu_prepare.py carries its wheel to the GPU machine)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gpu_runtime.compute.quantization import count_quantized
from gpu_runtime.engine.engine import Engine
from tests.cuda.cuda_tools import base_entry, requires_cuda
from tests.helpers.engine_tools import BATCH

pytestmark = [requires_cuda, pytest.mark.filterwarnings("ignore::UserWarning")]
bnb = pytest.importorskip("bitsandbytes")
LINEARS = 2 * 7  # two layers of q, k, v, o, gate, up, down; lm_head stays unquantized
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
# The tiny model's weights are random, so quantizing them moves its loss (~10.8, ln of the vocabulary) a little.
LOSS_REL = 5e-2


@pytest.mark.parametrize("kind", ["8bit", "4bit"])
def test_a_quantized_base_trains_on_cuda(tmp_path: Path, tiny_model_dir: str, kind: str) -> None:
    engine = Engine(tmp_path, device="cuda")
    engine.create_run("plain", "u", tiny_model_dir, LORA, seed=1)
    engine.create_run("q", "u", tiny_model_dir, LORA, seed=1, quantization=kind)
    entry = base_entry(engine, "q")
    assert count_quantized(entry.model) == {kind: LINEARS}
    assert {p.device.type for p in entry.model.parameters()} == {"cuda"}
    plain_loss = engine.forward_backward("plain", BATCH)["loss"]
    losses, norms = [], []
    for _ in range(3):
        losses.append(engine.forward_backward("q", BATCH)["loss"])
        norms.append(engine.optim_step("q", {"learning_rate": 5e-2})["grad_norm"])
    assert losses[0] == pytest.approx(plain_loss, rel=LOSS_REL)
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert losses[-1] < losses[0], losses
    assert all(torch.isfinite(p).all() for p in engine.runs["q"].parameters())
    assert engine.run_info("q")["step"] == 3
