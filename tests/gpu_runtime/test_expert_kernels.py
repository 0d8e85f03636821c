"""The grouped (expert, run) kernels over expert slot buffers (ops.grouped_expert_lora: mixture-of-experts layers)
against today's per-pass stacked layout: the torch kernels within 1e-6 of each tensor's scale in fp32, the Triton
kernels in triton's interpreter (tests/gpu_runtime/test_lora_ops.py's worker process and tolerances)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.compute.lora import ops
from tests.gpu_runtime.test_lora_ops import (
    DROPOUT,
    DTYPES,
    EXPERTS,
    IN,
    MAX_RANK,
    OUT,
    assert_close,
    dropout_mask,
    interpreted,
    interpreter_pool,
    scaled_error,
)


@pytest.fixture(scope="module")
def interpreter() -> Iterator[ProcessPoolExecutor]:
    with interpreter_pool() as pool:
        yield pool

# (row_start, row_end, slot, expert, rank, scaling): rows sorted by expert, then run; slot 1 on two experts, mixed
# ranks (8, 33, 64), base-only rows 17-18, and expert 3 of EXPERTS + 1 routed no token
EXPERT_SEGMENTS = [(0, 5, 1, 0, 8, 0.5), (5, 17, 0, 0, 33, 1.0), (19, 22, 1, 1, 8, 0.5), (22, 30, 2, 2, 64, 2.0)]
EXPERT_ROWS = 31
EXPERT_RANKS = (33, 8, 64)  # per slot


@dataclass
class ExpertCase:
    tables: ops.ExpertTables
    x: torch.Tensor  # [EXPERT_ROWS, IN]
    runs: list[tuple[torch.Tensor, torch.Tensor]]  # each slot's PEFT-shaped A [E·r, IN] and B [OUT, r·E]
    mask: torch.Tensor | None
    grad: torch.Tensor


def expert_case(dtype: torch.dtype, with_dropout: bool, device: torch.device | str = "cpu") -> ExpertCase:
    generator = torch.Generator().manual_seed(4)
    E = EXPERTS + 1
    runs = [(torch.randn(E * r, IN, generator=generator) / IN**0.5, torch.randn(OUT, r * E, generator=generator) / r**0.5)
            for r in EXPERT_RANKS]
    x = torch.randn(EXPERT_ROWS, IN, generator=generator)
    flat = [(s, e, slot, rank, scaling) for s, e, slot, _, rank, scaling in EXPERT_SEGMENTS]
    mask = dropout_mask(flat, EXPERT_ROWS, generator) if with_dropout else None
    grad = torch.randn(EXPERT_ROWS, OUT, generator=generator)
    tables = ops.build_expert_tables(EXPERT_SEGMENTS, E, MAX_RANK, device, EXPERT_ROWS)
    return ExpertCase(tables, x.to(device, dtype), [(A.to(device, dtype), B.to(device, dtype)) for A, B in runs],
                      None if mask is None else mask.to(device, dtype), grad.to(device, dtype))


def expert_buffers(case: ExpertCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot buffers A [slots, E·R, IN] and Bᵀ [slots, R·E, OUT], each run's PEFT matrices in its slot."""
    E, x = EXPERTS + 1, case.x
    A = x.new_zeros(len(case.runs), E * MAX_RANK, IN)
    Bt = x.new_zeros(len(case.runs), MAX_RANK * E, OUT)
    for slot, (a, b) in enumerate(case.runs):
        A[slot, : a.shape[0]] = a
        Bt[slot, : b.shape[1]] = b.t()
    return A, Bt


def stacked_expert_delta(case: ExpertCase, runs: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                         impl: ops.Impl) -> torch.Tensor:
    """What a pass computed before the slot buffers: every run's experts stacked (padded to R) into
    [slots × experts, …] per pass, one segment per (expert, run) at slot × experts + expert."""
    E = EXPERTS + 1
    factors = [(A.view(E, A.shape[0] // E, IN), B.view(OUT, B.shape[1] // E, E).permute(2, 0, 1)) for A, B in runs]
    A4 = torch.stack([F.pad(a, (0, 0, 0, MAX_RANK - a.shape[1])) for a, _ in factors])
    B4 = torch.stack([F.pad(b, (0, MAX_RANK - b.shape[2])) for _, b in factors])
    table = ops.build_table([(s, e, slot * E + expert, rank, scaling) for s, e, slot, expert, rank, scaling in EXPERT_SEGMENTS],
                            x.device, EXPERT_ROWS)
    return ops.segmented_lora(x, A4.flatten(0, 1), B4.flatten(0, 1), table, case.mask, impl)


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_expert_lora(interpreter: ProcessPoolExecutor, dtype: torch.dtype, with_dropout: bool) -> None:
    """The slot buffers read in place equal today's stacked layout: within 1e-6 of each tensor's scale on the torch
    kernels in fp32, and the
    Triton kernels (interpreted) within the usual tolerance; every run's gradients in its PEFT shapes."""
    expected = job_grouped(torch.float32, with_dropout, "stacked")
    for impl in ("triton", "torch", "grouped"):
        got = job_grouped(dtype, with_dropout, impl) if impl != "triton" else interpreted(interpreter, job_grouped, dtype,
                                                                                         with_dropout, impl)
        assert len(got) == len(expected) == 2 + 2 * len(EXPERT_RANKS)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g is not None and e is not None and g.shape == e.shape, f"{impl} {i}"
            if impl != "triton" and dtype == torch.float32:
                assert scaled_error(g, e) <= 1e-6, f"{impl} tensor {i}"  # B's strided windows: another BLAS path
            else:
                assert_close(g.float(), e, dtype, f"{impl} tensor {i}")
    assert expected[0] is not None and torch.equal(expected[0][17:19], torch.zeros(2, OUT))  # base-only rows



def job_grouped(dtype: torch.dtype, with_dropout: bool, impl: str) -> list[torch.Tensor | None]:
    """The delta, grad_x and each run's (grad A, grad B) in PEFT's shapes: through the slot buffers
    (grouped_expert_lora, `grad_into`), or "stacked": today's per-pass stack, autograd to the runs' own matrices."""
    case = expert_case(dtype, with_dropout)
    x = case.x.detach().requires_grad_()
    if impl == "stacked":
        runs = [(A.detach().requires_grad_(), B.detach().requires_grad_()) for A, B in case.runs]
        delta = stacked_expert_delta(case, runs, x, "torch")
        delta.backward(case.grad)
        return [delta.detach(), x.grad] + [g for A, B in runs for g in (A.grad, B.grad)]
    A, Bt = expert_buffers(case)
    into = (torch.zeros_like(A), torch.zeros_like(Bt))
    delta = ops.grouped_expert_lora(x, A, Bt, case.tables, case.mask, impl, grad_into=into)  # type: ignore[arg-type]
    delta.backward(case.grad)
    grads = [g for slot, (a, b) in enumerate(case.runs) for g in (into[0][slot, : a.shape[0]], into[1][slot, : b.shape[1]].t())]
    return [delta.detach(), x.grad, *grads]
