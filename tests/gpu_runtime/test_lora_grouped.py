"""The grouped torch kernel (ops/grouped.py: a bmm per group of segments of equal rows and rank). What training relies
on: it equals the per-segment reference within fp32 rounding (values and gradients; mixed ranks 1-64, a run twice in
a pass, dropout), and a segment's values and its slot's gradients are the same bits whatever else shares its pass,
at any thread count, so a co-batched call's journal replays alone bitwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpu_runtime.compute.lora import ops

IN, OUT, R, SLOTS = 48, 40, 64, 8

# (row_start, row_end, slot, rank, scaling): ranks 1 to 64, groups of one and of several (one split by another group),
# a run twice (slot 1: in one group, and slot 6: in two groups), rows 61-63 in no segment
SEGMENTS = [(0, 3, 1, 4, 2.0), (3, 6, 2, 4, 0.5), (6, 10, 3, 64, 1.0), (10, 13, 1, 4, 2.0), (13, 17, 4, 64, 3.0),
            (17, 18, 5, 1, 1.5), (18, 28, 6, 16, 0.25), (28, 31, 6, 16, 0.25), (31, 61, 7, 32, 2.0)]


def slot_buffers(segments: list[tuple[int, int, int, int, float]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    A, B = torch.zeros(SLOTS, R, IN), torch.zeros(SLOTS, OUT, R)
    for _, _, slot, r, _ in segments:
        A[slot, :r] = torch.randn(r, IN, generator=generator) / IN**0.5
        B[slot, :, :r] = torch.randn(OUT, r, generator=generator) / r**0.5
    return A, B


def inputs(rows: int, seed: int = 1, dropout: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    x, grad = torch.randn(rows, IN, generator=generator), torch.randn(rows, OUT, generator=generator)
    mask = (torch.rand(rows, IN, generator=generator) >= 0.25).float() / 0.75 if dropout else None
    return x, grad, mask


def run(impl: ops.Impl, segments: list[tuple[int, int, int, int, float]], x: torch.Tensor, grad: torch.Tensor,
        mask: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """delta, grad_x, and the weight gradients added into persistent buffers (the layer's path)."""
    table = ops.build_table(segments, "cpu", x.shape[0])
    x = x.clone().requires_grad_(True)
    into = (torch.zeros_like(A), torch.zeros_like(B))
    delta = ops.segmented_lora(x, A.clone().requires_grad_(True), B.clone().requires_grad_(True), table, mask, impl,
                               grad_into=into)
    delta.backward(grad)
    assert x.grad is not None
    return delta.detach(), x.grad, *into


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}-threads")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_the_grouped_kernel_equals_the_per_segment_reference_to_fp32_rounding(dropout: bool) -> None:
    A, B = slot_buffers(SEGMENTS)
    x, grad, mask = inputs(64, dropout=dropout)
    grouped = run("grouped", SEGMENTS, x, grad, mask, A, B)
    reference = run("torch", SEGMENTS, x, grad, mask, A, B)
    for name, ours, theirs in zip(("delta", "grad_x", "grad_A", "grad_B"), grouped, reference):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=name)
    assert grouped[0][61:].abs().sum() == 0 and grouped[1][61:].abs().sum() == 0  # rows in no segment: the base alone
    groups = ops.grouped.groups(ops.build_table(SEGMENTS, "cpu", 64))
    assert [(g.rows, g.rank, len(g.segments)) for g in groups] == [
        (3, 4, 3), (4, 64, 2), (1, 1, 1), (10, 16, 1), (3, 16, 1), (30, 32, 1)]


ALONE = [i for i, s in enumerate(SEGMENTS) if sum(t[2] == s[2] for t in SEGMENTS) == 1]  # a slot's one segment


@pytest.mark.parametrize("segment", ALONE)
def test_a_segment_alone_is_bitwise_itself_co_batched(segment: int, threads: int) -> None:
    """Replay runs a journaled call alone, at the front of its own pass and perhaps on another thread count: its rows
    and its slot's gradients must not move by a bit."""
    A, B = slot_buffers(SEGMENTS)
    x, grad, mask = inputs(64, dropout=True)
    together = run("grouped", SEGMENTS, x, grad, mask, A, B)
    start, end, slot, rank, scaling = SEGMENTS[segment]
    rows = slice(start, end)
    alone = run("grouped", [(0, end - start, slot, rank, scaling)], x[rows], grad[rows],
                None if mask is None else mask[rows], A, B)
    assert torch.equal(alone[0], together[0][rows]) and torch.equal(alone[1], together[1][rows])
    assert torch.equal(alone[2][slot], together[2][slot]) and torch.equal(alone[3][slot], together[3][slot])


def test_a_run_twice_replays_call_by_call(threads: int) -> None:
    """A run twice in a pass (two calls): replay runs them one after the other, each alone, adding in call order."""
    A, B = slot_buffers(SEGMENTS)
    x, grad, mask = inputs(64)
    together = run("grouped", SEGMENTS, x, grad, mask, A, B)
    for slot in (1, 6):
        into = (torch.zeros_like(A), torch.zeros_like(B))
        for start, end, s, rank, scaling in SEGMENTS:
            if s != slot:
                continue
            rows = slice(start, end)
            _, grad_x, gA, gB = run("grouped", [(0, end - start, slot, rank, scaling)], x[rows], grad[rows], None, A, B)
            into[0].add_(gA)
            into[1].add_(gB)
            assert torch.equal(grad_x, together[1][rows])
        assert torch.equal(into[0][slot], together[2][slot]) and torch.equal(into[1][slot], together[3][slot])


def test_a_journal_names_the_kernel_and_one_naming_none_replays_the_reference() -> None:
    assert ops.pass_kernel("cpu") == "grouped"
    assert ops.pass_kernel("cpu", ops.LEGACY) == "torch"
    assert ops.pass_kernel("cpu", "torch") == "torch" and ops.pass_kernel("cpu", "grouped") == "grouped"
    with pytest.raises(ValueError, match="'bmm-2030'"):
        ops.pass_kernel("cpu", "bmm-2030")
