"""The base's slot buffers (gpu_runtime/compute/lora/slots.py): a run's A and B are views of its slot, kept through
growth (more slots, a larger rank), freed on detach, and trained by AdamW exactly as plain tensors are."""

from __future__ import annotations

import torch
from torch import nn

from gpu_runtime.compute.lora.layer import MultiLoraLinear, Routing, Segment, routed
from gpu_runtime.compute.lora.slots import GROWTH_MIN, in_layout_of
from gpu_runtime.compute.optimizer import new_adamw

PATHS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")


def base_layers() -> tuple[Routing, dict[str, MultiLoraLinear]]:
    torch.manual_seed(0)
    routing = Routing()
    return routing, {PATHS[0]: MultiLoraLinear(nn.Linear(16, 12), PATHS[0], routing),
                     PATHS[1]: MultiLoraLinear(nn.Linear(12, 16), PATHS[1], routing)}


def adapter(layers: dict[str, MultiLoraLinear], r: int, seed: int) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    generator = torch.Generator().manual_seed(seed)
    return {path: (nn.Parameter(torch.randn(r, layer.in_features, generator=generator)),
                   nn.Parameter(torch.randn(layer.out_features, r, generator=generator)))
            for path, layer in layers.items()}


def shares(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def train_pass(routing: Routing, layers: dict[str, MultiLoraLinear], keys: list[str]) -> None:
    x = torch.randn(len(keys), 3, 16, generator=torch.Generator().manual_seed(1))
    with routed(routing, [Segment(key, i, i + 1) for i, key in enumerate(keys)]):
        out = layers[PATHS[1]](torch.relu(layers[PATHS[0]](x)))
    out.pow(2).sum().backward()


def test_slots_grow_in_count_and_rank_and_keep_every_run_in_place() -> None:
    routing, layers = base_layers()
    slots = routing.slots
    runs = {f"run-{i}": adapter(layers, r, seed=i) for i, r in enumerate([4, 8, 2, 4, 6])}
    values = {key: {p: (A.detach().clone(), B.detach().clone()) for p, (A, B) in w.items()} for key, w in runs.items()}
    for key, weights in list(runs.items())[:4]:
        slots.attach(key, layers, weights, weights[PATHS[0]][0].shape[0], 1.0, 0.0, trainable=True)
    train_pass(routing, layers, ["run-0", "run-2"])  # gradients linked before the buffers grow
    grads = {key: {p: (A.grad.clone(), B.grad.clone()) for p, (A, B) in runs[key].items() if A.grad is not None and B.grad is not None}
             for key in ("run-0", "run-2")}
    assert slots.capacity == GROWTH_MIN and slots.rank == 8
    strides = {key: [(A.stride(), B.stride()) for A, B in w.values()] for key, w in runs.items()}
    big = adapter(layers, 16, seed=9)  # a fifth run past the capacity, of a rank past R
    slots.attach("big", layers, big, 16, 1.0, 0.0, trainable=True)
    assert slots.capacity == GROWTH_MIN + GROWTH_MIN and slots.rank == 16
    for key, weights in list(runs.items())[:4]:
        assert [(A.stride(), B.stride()) for A, B in weights.values()] == strides[key]  # moments keep matching
        for path, (A, B) in weights.items():
            lora = layers[path].lora
            assert lora is not None and lora.A.shape[:2] == (8, 16)
            assert shares(A, lora.A) and shares(B, lora.Bt)
            assert torch.equal(A, values[key][path][0]) and torch.equal(B, values[key][path][1])
            if key in grads:
                assert A.grad is not None and B.grad is not None and lora.grad_A is not None
                assert shares(A.grad, lora.grad_A) and torch.equal(A.grad, grads[key][path][0])
                assert torch.equal(B.grad, grads[key][path][1])
            slot = slots.slot_of(key)
            assert slot is not None and not lora.A[slot, A.shape[0]:].any() and not lora.Bt[slot, A.shape[0]:].any()


def test_detach_frees_the_slot_zeroed_and_the_run_keeps_its_values() -> None:
    routing, layers = base_layers()
    slots = routing.slots
    first, second = adapter(layers, 8, seed=1), adapter(layers, 2, seed=2)
    slots.attach("first", layers, first, 8, 1.0, 0.0, trainable=True)
    train_pass(routing, layers, ["first"])
    slot = slots.slot_of("first")
    A, B = first[PATHS[0]]
    kept = A.detach().clone(), B.detach().clone(), A.grad.clone() if A.grad is not None else None
    slots.detach("first")
    lora = layers[PATHS[0]].lora
    assert lora is not None and slots.slot_of("first") is None
    assert A.grad is not None and kept[2] is not None and not shares(A, lora.A)
    assert torch.equal(A, kept[0]) and torch.equal(B, kept[1]) and torch.equal(A.grad, kept[2])
    assert not lora.A[slot].any() and not lora.Bt[slot].any()
    slots.attach("second", layers, second, 2, 1.0, 0.0, trainable=True)  # a smaller rank in the freed slot
    assert slots.slot_of("second") == slot and not lora.A[slot, 2:].any()


def test_adamw_on_slot_views_equals_adamw_on_plain_tensors_bit_for_bit() -> None:
    # The fused kernel walks raw memory: B (a transposed view) trains right only because its gradient and moments
    # share its layout. A gradient put there in another layout (a restore's contiguous tensor) is moved into the
    # slot's gradient rows, in the parameter's layout, before anything adds to it.
    routing, layers = base_layers()
    weights = adapter(layers, 4, seed=3)
    plain = {p: (nn.Parameter(A.detach().clone()), nn.Parameter(B.detach().clone())) for p, (A, B) in weights.items()}
    routing.slots.attach("run", layers, weights, 4, 1.0, 0.0, trainable=True)
    slot = routing.slots.slot_of("run")
    assert slot is not None
    ours = [t for pair in weights.values() for t in pair]
    theirs = [t for pair in plain.values() for t in pair]
    optimizers = new_adamw(ours), new_adamw(theirs)
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        for mine, other in zip(ours, theirs):
            grad = torch.randn(mine.shape, generator=generator)
            mine.grad, other.grad = grad.clone(), grad.clone()  # contiguous: B's parameter is not
        for path in PATHS:
            routing.slots.layers[path].link_grads([slot])
        for mine, other in zip(ours, theirs):
            assert mine.grad is not None and other.grad is not None and mine.grad.stride() == mine.stride()
            assert torch.equal(mine.grad, other.grad)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for mine, other in zip(ours, theirs):
        assert torch.equal(mine.detach(), other.detach())
    assert any(not t.is_contiguous() for t in ours)  # the case the layout matters for was there
    moment = optimizers[0].state[ours[1]]["exp_avg"]
    assert in_layout_of(ours[1], moment.contiguous()).stride() == ours[1].stride()  # what a restore puts back


def test_a_cleared_gradient_starts_from_zero_not_from_the_rows_left_behind() -> None:
    routing, layers = base_layers()
    weights = adapter(layers, 4, seed=3)
    routing.slots.attach("run", layers, weights, 4, 1.0, 0.0, trainable=True)
    train_pass(routing, layers, ["run"])
    first = {p: A.grad.clone() for p, (A, _) in weights.items() if A.grad is not None}
    for A, B in weights.values():
        A.grad = B.grad = None  # what the optimizer's zero_grad does after a step
    train_pass(routing, layers, ["run"])
    for path, (A, _) in weights.items():
        assert A.grad is not None and torch.equal(A.grad, first[path])
