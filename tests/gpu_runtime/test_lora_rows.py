"""Per-row multi-LoRA routing (lora/layer.py's RowRouting, the BGMV form decode passes use): each row gets its own
adapter's delta, mixed ranks, rows of the base alone (-1) and keys a layer has no adapter under get none."""

from __future__ import annotations

import torch
from torch import nn

from gpu_runtime.compute.lora.layer import LoraWeights, MultiLoraLinear, Routing, Segment, routed, routed_rows


def _layer() -> MultiLoraLinear:
    torch.manual_seed(0)
    layer = MultiLoraLinear(nn.Linear(24, 16), "q_proj", Routing())
    for key, rank, scaling in (("a", 4, 2.0), ("b", 16, 0.5), ("c", 8, 1.0)):
        layer.adapters[key] = LoraWeights(nn.Parameter(torch.randn(rank, 24)), nn.Parameter(torch.randn(16, rank)),
                                          scaling, 0.0)
    return layer


def test_each_row_gets_its_own_adapters_delta_as_a_segment_pass_does() -> None:
    layer = _layer()
    keys = ("b", "nobody", "a", "c")  # adapter index j is keys[j]; "nobody" has no adapter here
    index = torch.tensor([2, -1, 0, 3, 1, 0, 2])
    x = torch.randn(7, 3, 24)
    with torch.no_grad(), routed_rows(layer.routing, index, keys, epoch=1):
        got = layer(x)
    expected = []
    for row, j in enumerate(index.tolist()):
        key = keys[j] if j >= 0 else "base"
        with torch.no_grad(), routed(layer.routing, [Segment(key, 0, 1)]):
            expected.append(layer(x[row:row + 1]))
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_the_stacks_are_made_again_for_a_new_epoch() -> None:
    layer = _layer()
    index, x = torch.tensor([0]), torch.randn(1, 24)
    with torch.no_grad(), routed_rows(layer.routing, index, ("a",), epoch=1):
        before = layer(x)
    with torch.no_grad():
        layer.adapters["a"].B.data.add_(1.0)  # as an optimizer step writes: no version bump on the parameter
    with torch.no_grad(), routed_rows(layer.routing, index, ("a",), epoch=1):
        assert torch.equal(layer(x), before)  # the same epoch: the stacks it made
    with torch.no_grad(), routed_rows(layer.routing, index, ("a",), epoch=2):
        assert not torch.equal(layer(x), before)
