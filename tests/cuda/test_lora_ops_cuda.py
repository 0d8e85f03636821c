"""The multi-LoRA kernels compiled by Triton on CUDA against their torch references: the CPU file's checks
(tests/gpu_runtime/test_lora_ops.py, which runs them in triton's interpreter) on the device, plus one pass at a
model's scale. Tolerances as a fraction of the expected tensor's scale: fp32 1e-5 (the kernels dot in full fp32,
not TF32, and the references run with TF32 off), bf16 2e-2 against the fp32 reference on the same bf16 values."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.compute.lora import ops
from tests.cuda.cuda_tools import compiled_triton, requires_cuda  # noqa: F401 - the fixture, used by name
from tests.gpu_runtime.test_expert_kernels import EXPERT_RANKS, expert_buffers, expert_case, stacked_expert_delta
from tests.gpu_runtime.test_lora_ops import (
    DROPOUT,
    DTYPES,
    LAYOUT_IDS,
    OUT,
    Case,
    assert_close,
    autograd_grads,
    make_case,
    rows_case,
)

pytestmark = [requires_cuda, pytest.mark.usefixtures("compiled_triton")]
CUDA = torch.device("cuda")


def on_cuda(case: Case) -> Case:
    table = ops.build_table(case.table.segments, CUDA, case.table.total_rows)
    return Case(table, case.x.to(CUDA), case.A.to(CUDA), case.B.to(CUDA),
                None if case.mask is None else case.mask.to(CUDA), case.grad.to(CUDA))


def test_choose_picks_triton_on_cuda() -> None:
    assert ops.choose(CUDA, torch.bfloat16) == "triton" and ops.choose(CUDA, torch.float32) == "triton"
    assert ops.choose("cpu", torch.bfloat16) == "grouped"  # the grouped torch kernel off CUDA


def test_the_table_is_one_buffer_on_the_device() -> None:
    table = ops.build_table([(0, 5, 1, 8, 0.5), (7, 9, 0, 16, 2.0)], CUDA, 10)
    views = (table.seg_starts, table.seg_ends, table.seg_slots, table.seg_ranks, table.seg_scalings, table.slot_ids, table.slot_ranks)
    assert all(v.device.type == "cuda" for v in views)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert table.seg_scalings.tolist() == [0.5, 2.0]


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_shrink_and_expand_on_cuda(layout: str, dtype: torch.dtype, with_dropout: bool) -> None:
    case = on_cuda(make_case(layout, with_dropout, dtype))
    f32 = case.to(torch.float32)
    h = ops.lora_shrink(case.x, case.A, case.table, case.mask)
    assert_close(h, ops.reference_shrink(f32.x, f32.A, f32.table, f32.mask), dtype, "h")
    base = torch.randn(case.table.total_rows, OUT, device=CUDA).to(dtype)
    out = base.clone()
    assert ops.lora_expand(h, case.B, case.table, out) is out
    assert_close(out, ops.reference_expand(h.float(), f32.B, f32.table, base.float()), dtype, "out")


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_segmented_lora_and_its_gradients_on_cuda(layout: str, dtype: torch.dtype, with_dropout: bool) -> None:
    case = on_cuda(make_case(layout, with_dropout, dtype))
    got = autograd_grads(ops.segmented_lora, case, dtype)
    expected = autograd_grads(ops.reference_segmented_lora, case, torch.float32)
    for name, g, e in zip(("delta", "grad_x", "grad_A", "grad_B"), got, expected):
        assert g.dtype == dtype and g.device.type == "cuda"
        assert_close(g, e, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_on_cuda(dtype: torch.dtype) -> None:
    table, x, A, B, base = rows_case(dtype)
    table = ops.build_rows_table(table.host_row_slots, table.host_slot_ranks, table.host_slot_scalings, CUDA)
    x, A, B, base = x.to(CUDA), A.to(CUDA), B.to(CUDA), base.to(CUDA)
    out = ops.rows_lora(x, A, B, table, base.clone())
    expected = ops.rows_lora(x.float(), A.float(), B.float(), table, base.float(), impl="torch")
    assert_close(out, expected, dtype, "out")
    assert torch.equal(out[1], base[1]) and torch.equal(out[5], base[5])


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_expert_lora_on_cuda(dtype: torch.dtype, with_dropout: bool) -> None:
    """The Triton kernels over the expert slot buffers (mixed ranks, an expert no token routes to, base-only rows)
    against the torch reference on today's stacked layout in fp32: the delta, grad_x and every run's A and B
    gradients in PEFT's shapes."""
    case = expert_case(dtype, with_dropout, CUDA)
    x = case.x.detach().requires_grad_()
    A, Bt = expert_buffers(case)
    into = (torch.zeros_like(A), torch.zeros_like(Bt))
    assert ops.choose(CUDA, dtype) == "triton"  # what grouped_expert_lora runs when told none
    delta = ops.grouped_expert_lora(x, A, Bt, case.tables, case.mask, grad_into=into)
    delta.backward(case.grad)
    got = [delta.detach(), x.grad] + [g for slot, (a, b) in enumerate(case.runs)
                                      for g in (into[0][slot, : a.shape[0]], into[1][slot, : b.shape[1]].t())]

    ref = expert_case(torch.float32, with_dropout, "cpu")
    ref.x = case.x.detach().cpu().float().requires_grad_()
    ref.mask = None if case.mask is None else case.mask.cpu().float()
    ref.grad = case.grad.cpu().float()
    runs = [(a.detach().cpu().float().requires_grad_(), b.detach().cpu().float().requires_grad_()) for a, b in case.runs]
    expected_delta = stacked_expert_delta(ref, runs, ref.x, "torch")
    expected_delta.backward(ref.grad)
    expected = [expected_delta.detach(), ref.x.grad] + [g for a, b in runs for g in (a.grad, b.grad)]
    assert len(got) == len(expected) == 2 + 2 * len(EXPERT_RANKS)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g is not None and e is not None
        assert_close(g.float().cpu(), e, dtype, f"tensor {i}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_pass_at_model_scale(dtype: torch.dtype) -> None:
    """8 runs of ranks 8..64 over 4,096 rows (one run twice, base-only rows between) at hidden 2,048: every grid and
    loop well past one block."""
    generator = torch.Generator().manual_seed(0)
    hidden, out_features, rows = 2048, 2048, 4096
    ranks = [8, 16, 32, 64, 8, 16, 32, 64]
    segments, cursor = [], 0
    for slot, rank in enumerate(ranks):
        length = 200 + 60 * slot  # 3,320 rows with the gaps; slot 3 again takes the last 776
        segments.append((cursor, cursor + length, slot, rank, 2.0 / rank))
        cursor += length + 5
    segments.append((cursor, rows, 3, 64, 2.0 / 64))  # slot 3 again
    A = torch.zeros(len(ranks), 64, hidden)
    B = torch.zeros(len(ranks), out_features, 64)
    for slot, rank in enumerate(ranks):
        A[slot, :rank] = torch.randn(rank, hidden, generator=generator) / hidden**0.5
        B[slot, :, :rank] = torch.randn(out_features, rank, generator=generator) / rank**0.5
    case = Case(ops.build_table(segments, CUDA, rows), torch.randn(rows, hidden, generator=generator).to(CUDA), A.to(CUDA),
                B.to(CUDA), None, torch.randn(rows, out_features, generator=generator).to(CUDA)).to(dtype)
    got = autograd_grads(ops.segmented_lora, case, dtype)
    expected = autograd_grads(ops.reference_segmented_lora, case, torch.float32)
    for name, g, e in zip(("delta", "grad_x", "grad_A", "grad_B"), got, expected):
        assert_close(g, e, dtype, name)
