"""The per-segment torch reference of the multi-LoRA ops (the "torch" kernel: what every journal record naming no
kernel was written with). What replay relies on: it is the per-segment formula bit for bit, and a segment's values and
its slot's gradients do not move by a bit whatever else shares the pass. The grouped kernel: test_lora_grouped.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.compute.lora.ops import build_table, reference_backward, reference_expand, reference_shrink

IN, OUT, R, SLOTS = 24, 20, 8, 5


def slot_buffers(ranks: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A [slots, R, in] and B [slots, out, R] with slot s's rank r_s filled and the rest zero (the layout's contract)."""
    generator = torch.Generator().manual_seed(0)
    A, B = torch.zeros(SLOTS, R, IN), torch.zeros(SLOTS, OUT, R)
    for slot, r in ranks.items():
        A[slot, :r] = torch.randn(r, IN, generator=generator)
        B[slot, :, :r] = torch.randn(OUT, r, generator=generator)
    return A, B


# (row_start, row_end, slot, rank, scaling): two groups of 3 rows (one of them split by another group), a run twice
# (slot 1), mixed ranks and scalings, and rows 17-19 in no segment
SEGMENTS = [(0, 3, 1, 4, 2.0), (3, 6, 2, 4, 0.5), (6, 10, 3, 8, 1.0), (10, 13, 1, 4, 2.0), (13, 17, 4, 8, 3.0)]
RANKS = {1: 4, 2: 4, 3: 8, 4: 8}


def per_segment(x: torch.Tensor, grad: torch.Tensor, A: torch.Tensor, B: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The formula, one segment at a time: delta, grad_x, grad_A, grad_B."""
    delta, grad_x = torch.zeros(x.shape[0], OUT), torch.zeros_like(x)
    grad_A, grad_B = torch.zeros_like(A), torch.zeros_like(B)
    for start, end, slot, r, scaling in SEGMENTS:
        rows = slice(start, end)
        h = F.linear(x[rows], A[slot, :r])
        delta[rows] = F.linear(h, B[slot, :, :r]) * scaling
        grad_h = grad[rows] @ B[slot, :, :r] * scaling
        grad_x[rows] = grad_h @ A[slot, :r]
        grad_A[slot, :r] += grad_h.t() @ x[rows]
        grad_B[slot, :, :r] += grad[rows].t() @ h * scaling
    return delta, grad_x, grad_A, grad_B


def test_the_torch_path_is_the_per_segment_formula_bit_for_bit() -> None:
    """One F.linear per segment: the bits every journal was written with (replay is bitwise)."""
    table = build_table(SEGMENTS, "cpu", total_rows=20)
    A, B = slot_buffers(RANKS)
    x, grad = torch.randn(20, IN), torch.randn(20, OUT)
    h = reference_shrink(x, A, table)
    delta = reference_expand(h, B, table)
    grad_x, grad_A, grad_B = reference_backward(grad, x, h, A, B, table, None)
    for ours, formula in zip((delta, grad_x, grad_A, grad_B), per_segment(x, grad, A, B)):
        assert torch.equal(ours, formula)
    assert delta[17:].abs().sum() == 0 and grad_x[17:].abs().sum() == 0  # rows in no segment: the base alone


@pytest.mark.parametrize("others", [[], [(3, 6, 2, 4, 0.5)], [(3, 6, 2, 4, 0.5), (6, 9, 3, 4, 1.5)]])
def test_a_segment_computes_the_same_bits_whatever_shares_its_pass(others: list[tuple[int, int, int, int, float]]) -> None:
    A, B = slot_buffers({1: 4, 2: 4, 3: 4})
    generator = torch.Generator().manual_seed(1)
    x, grad = torch.randn(9, IN, generator=generator), torch.randn(9, OUT, generator=generator)
    alone = build_table([(0, 3, 1, 4, 2.0)], "cpu", total_rows=9)
    shared = build_table([(0, 3, 1, 4, 2.0)] + others, "cpu", total_rows=9)
    results = []
    for table in (alone, shared):
        h = reference_shrink(x, A, table)
        delta = reference_expand(h, B, table)
        grad_x, grad_A, grad_B = reference_backward(grad, x, h, A, B, table, None)
        results.append((delta[:3], grad_x[:3], grad_A[1], grad_B[1]))
    for mine_alone, mine_shared in zip(*results):
        assert torch.equal(mine_alone, mine_shared)
