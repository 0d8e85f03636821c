"""The multi-LoRA layer on CUDA: the Triton kernels (ops.choose picks them there) in bf16 on a bf16 base, from bf16
copies of the fp32 slot buffers; five mixed runs co-batched equal each alone within bf16's tolerance
(test_multilora.py), and a pass launches no per-run matmul."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from gpu_runtime.compute.lora import ops
from tests.cuda.cuda_tools import requires_cuda
from tests.gpu_runtime.test_multilora import FIVE, FIVE_SEGMENTS, layer_with, run_layer, test_five_mixed_runs_co_batched_equal_each_alone

pytestmark = requires_cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(16,), (7, 16)], ids=["rows", "rows-by-tokens"])
def test_five_mixed_runs_co_batched_equal_each_alone_on_cuda(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert ops.choose("cuda", dtype) == "triton"
    test_five_mixed_runs_co_batched_equal_each_alone(shape, dtype, device="cuda")


def test_a_co_batched_pass_launches_the_kernels_not_a_matmul_per_run() -> None:
    layer, weights = layer_with(FIVE, torch.bfloat16, device="cuda")
    x = torch.randn(13, 7, 16, device="cuda", dtype=torch.bfloat16)
    run_layer(layer, x, FIVE_SEGMENTS, weights)  # compiled once
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_layer(layer, x, FIVE_SEGMENTS, weights)
    calls = {event.key: event.count for event in prof.key_averages()}
    # The base layer's own matmuls only (forward, input gradient): none per run
    assert calls.get("aten::mm", 0) + calls.get("aten::addmm", 0) <= 3, calls
    for A, B in weights.values():
        assert A.grad is not None and A.grad.dtype == torch.float32 and B.grad is not None and B.grad.dtype == torch.float32
