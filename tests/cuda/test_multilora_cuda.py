"""The multi-LoRA layer's grouped path on CUDA against its per-segment loop: in bf16 (torch's _grouped_mm has a
kernel of its own there) and in fp32, the adapters' dtype on a bf16 base, where the padded bmm serves instead."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from gpu_runtime.compute.lora.layer import MultiLoraLinear, Routing, Segment
from tests.cuda.cuda_tools import requires_cuda
from tests.gpu_runtime.test_multilora import lora, run_layer

pytestmark = requires_cuda


def test_grouped_path_equals_the_loop_on_cuda_in_bf16() -> None:
    # bf16 keeps 8 bits of mantissa: grouped and looped sums may round apart by a few of its ulps (2e-2 of scale).
    device, dtype = torch.device("cuda"), torch.bfloat16
    adapters = {f"run-{i}": lora([16, 32, 8][i], 64, 48, scaling=2.0, dropout=[0.0, 0.1, 0.0][i], seed=i) for i in range(3)}
    for weights in adapters.values():
        weights.A = nn.Parameter(weights.A.detach().to(device, dtype))
        weights.B = nn.Parameter(weights.B.detach().to(device, dtype))
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(64, 48).to(device, dtype), "model.layers.0.self_attn.q_proj", Routing())
    layer.adapters.update(adapters)
    x = torch.randn(7, 5, 64, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    segments = [Segment("run-0", 0, 2), Segment("run-1", 2, 3, 7, 1, 5, 0), Segment("run-2", 3, 7)]
    looped, loop_grads = run_layer(layer, x, segments, grouped=False)
    grouped, grouped_grads = run_layer(layer, x, segments, grouped=True)
    scale = looped.float().abs().max().item()
    torch.testing.assert_close(grouped.float(), looped.float(), rtol=0, atol=2e-2 * scale)
    for key in adapters:
        for ours, theirs in zip(grouped_grads[key], loop_grads[key]):
            torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=2e-2 * theirs.float().abs().max().item())


def test_grouped_path_in_fp32_on_cuda_is_one_padded_bmm_and_equals_the_loop() -> None:
    # fp32 adapters on CUDA: _grouped_mm would loop a matmul per run inside; the padded bmm is one batched matmul.
    device = torch.device("cuda")
    adapters = {f"run-{i}": lora([16, 32, 8][i], 64, 48, scaling=2.0, dropout=[0.0, 0.1, 0.0][i], seed=i) for i in range(3)}
    for weights in adapters.values():
        weights.A = nn.Parameter(weights.A.detach().to(device))
        weights.B = nn.Parameter(weights.B.detach().to(device))
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(64, 48).to(device), "model.layers.0.self_attn.q_proj", Routing())
    layer.adapters.update(adapters)
    x = torch.randn(7, 5, 64, generator=torch.Generator().manual_seed(5)).to(device)
    segments = [Segment("run-0", 0, 2), Segment("run-1", 2, 3, 7, 1, 5, 0), Segment("run-2", 3, 7)]
    looped, loop_grads = run_layer(layer, x, segments, grouped=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        grouped, grouped_grads = run_layer(layer, x, segments, grouped=True)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::bmm" in ops and "aten::_grouped_mm" not in ops
    scale = looped.abs().max().item()
    torch.testing.assert_close(grouped, looped, rtol=0, atol=1e-5 * scale)
    for key in adapters:
        for ours, theirs in zip(grouped_grads[key], loop_grads[key]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5 * theirs.abs().max().item())
