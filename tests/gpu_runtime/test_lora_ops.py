"""The multi-LoRA kernels (gpu_runtime/compute/lora/ops.py) against their torch references, on the CPU under triton's
interpreter, and the references against the per-segment loop multilora.py runs today.

The interpreter: TRITON_INTERPRET=1 must be set before anything in a process imports triton (triton wraps its own
`tl.zeros`, `tl.sum` when imported, and this process's conftest imports the engine, whose torch/transformers/peft
import triton), so setting it in a test or at the top of this module is too late. The kernels run instead in one
spawned worker process for the module (`interpreter`), started with TRITON_INTERPRET=1 and SIGNAL_LORA_KERNELS=triton
in its environment; each test sends it a job (a function below named `job_*`, which builds its case from the same
seeds) and checks the tensors that come back against the torch reference here. Nothing leaks into other tests.

Tolerances, as a fraction of the expected tensor's largest magnitude (elementwise ones fail near zero): fp32 1e-5
(the interpreter sums in another order than torch; measured under 3e-7); bf16 2e-2, against the torch reference on
the same bf16 values computed in fp32: the kernels round h (and grad_h) to bf16 between their two matmuls, as a bf16
model does, and the interpreter rounds fp32 to bf16 toward zero (a GPU rounds to nearest), so the kernels measure up
to 1.4e-2 here where torch's own bf16 reference measures 4.5e-3: a few of bf16's 2^-8 steps at the tensor's scale.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.nn.functional as F

from gpu_runtime.compute.lora import ops
from gpu_runtime.compute.lora.ops import triton_kernels

T = TypeVar("T")

# 160 = 2 × 64 + 32 and 72 = 64 + 8: the kernels' loops over features run more than once and end on a ragged block
IN, OUT, MAX_RANK, SLOTS = 160, 72, 64, 5
EXPERTS = 3
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
DROPOUT = [pytest.param(False, id="no-dropout"), pytest.param(True, id="dropout")]

# (row_start, row_end, slot, rank, scaling) per segment, and the pass's rows
LAYOUTS = {
    # ranks 1..64 in one pass, ragged lengths (3, 17, 1, 70, 6: 70 spans two row blocks), base-only rows 20, 22-23, 100
    "mixed-ranks": ([(0, 3, 0, 1, 2.0), (3, 20, 1, 8, 0.5), (21, 22, 2, 16, 1.0), (24, 94, 3, 33, 0.25), (94, 100, 4, 64, 1.5)], 101),
    # one run twice in the pass (slot 1 around slot 0): its weight gradients sum over both segments
    "slot-twice": ([(0, 9, 1, 16, 1.0), (9, 26, 0, 33, 0.5), (26, 40, 1, 16, 1.0)], 40),
    # base-only rows before, between and after, the segments listed out of row order
    "base-rows-between": ([(11, 29, 0, 64, 1.0), (2, 5, 2, 8, 2.0), (37, 40, 3, 1, 0.5)], 45),
}
LAYOUT_IDS = list(LAYOUTS)


INTERPRETER_ENV = {"TRITON_INTERPRET": "1", "SIGNAL_LORA_KERNELS": "triton"}


@contextmanager
def interpreter_pool() -> Iterator[ProcessPoolExecutor]:
    """One spawned process that runs the kernels in triton's interpreter (the variables set before it starts)."""
    saved = {key: os.environ.get(key) for key in INTERPRETER_ENV}
    os.environ.update(INTERPRETER_ENV)
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        assert pool.submit(os.getenv, "TRITON_INTERPRET").result(timeout=120) == "1"  # started, with the variable
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    with pool:
        yield pool


@pytest.fixture(scope="module")
def interpreter() -> Iterator[ProcessPoolExecutor]:
    with interpreter_pool() as pool:
        yield pool


def interpreted(pool: ProcessPoolExecutor, job: Callable[..., T], *args: object) -> T:
    return pool.submit(job, *args).result(timeout=300)


@dataclass
class Case:
    table: ops.LoraTable
    x: torch.Tensor  # [T, IN]
    A: torch.Tensor  # [SLOTS, MAX_RANK, IN], zero past each slot's rank
    B: torch.Tensor  # [SLOTS, OUT, MAX_RANK]
    mask: torch.Tensor | None  # [T, IN]: 1/(1-p) or 0 on rows of segments with dropout, 1 elsewhere
    grad: torch.Tensor  # [T, OUT]: the upstream gradient

    def to(self, dtype: torch.dtype) -> Case:
        return Case(self.table, self.x.to(dtype), self.A.to(dtype), self.B.to(dtype),
                    None if self.mask is None else self.mask.to(dtype), self.grad.to(dtype))


def slot_buffers(ranks: dict[int, int], slots: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    A, B = torch.zeros(slots, MAX_RANK, IN), torch.zeros(slots, OUT, MAX_RANK)
    for slot, rank in ranks.items():
        A[slot, :rank] = torch.randn(rank, IN, generator=generator) / IN**0.5
        B[slot, :, :rank] = torch.randn(OUT, rank, generator=generator) / rank**0.5
    return A, B


def dropout_mask(segments: list[tuple[int, int, int, int, float]], rows: int, generator: torch.Generator) -> torch.Tensor:
    """Every other segment with dropout p=0.25, the rest (and base-only rows) ones: a mixed pass."""
    mask = torch.ones(rows, IN)
    for i, (start, end, *_) in enumerate(segments):
        if i % 2 == 0:
            mask[start:end] = (torch.rand(end - start, IN, generator=generator) >= 0.25).float() / 0.75
    return mask


def make_case(layout: str, with_dropout: bool, dtype: torch.dtype = torch.float32) -> Case:
    segments, rows = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(sorted(LAYOUTS).index(layout))
    A, B = slot_buffers({slot: rank for _, _, slot, rank, _ in segments}, SLOTS, generator)
    x = torch.randn(rows, IN, generator=generator)
    grad = torch.randn(rows, OUT, generator=generator)
    mask = dropout_mask(segments, rows, generator) if with_dropout else None
    return Case(ops.build_table(segments, "cpu", rows), x, A, B, mask, grad).to(dtype)


def scaled_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    return (got.float() - expected.float()).abs().max().item() / max(scale, 1e-30)


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    assert got.shape == expected.shape, what
    error = scaled_error(got, expected)
    assert error <= TOLERANCE[dtype], f"{what}: off by {error:.3g} of its scale (allowed {TOLERANCE[dtype]})"


def naive_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, segments: tuple[ops.TableSegment, ...],
                mask: torch.Tensor | None) -> torch.Tensor:
    """multilora.py's per-segment loop, literally: F.linear(F.linear(x_seg, A[:r]), B[:, :r]) * scaling; 0 elsewhere."""
    xm = x if mask is None else x * mask
    pieces, cursor = [], 0
    for seg in sorted(segments, key=lambda s: s.row_start):
        pieces.append(torch.zeros(seg.row_start - cursor, B.shape[1], dtype=x.dtype))
        piece = xm[seg.row_start : seg.row_end]
        pieces.append(F.linear(F.linear(piece, A[seg.slot, : seg.rank]), B[seg.slot, :, : seg.rank]) * seg.scaling)
        cursor = seg.row_end
    pieces.append(torch.zeros(x.shape[0] - cursor, B.shape[1], dtype=x.dtype))
    return torch.cat(pieces)


def autograd_grads(fn: Callable[..., torch.Tensor], case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """delta and the gradients of x, A and B through autograd of `fn(x, A, B, table, mask)`, in `dtype`."""
    x, A, B = (t.detach().to(dtype).requires_grad_() for t in (case.x, case.A, case.B))
    mask = None if case.mask is None else case.mask.to(dtype)
    delta = fn(x, A, B, case.table, mask)
    delta.backward(case.grad.to(dtype))
    assert x.grad is not None and A.grad is not None and B.grad is not None
    return delta.detach(), x.grad, A.grad, B.grad


# ---------------------------------------------------------------------------------------------------------------------
# The references against the loop multilora.py runs


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_reference_matches_the_per_segment_loop(layout: str, with_dropout: bool) -> None:
    case = make_case(layout, with_dropout)
    got = autograd_grads(ops.reference_segmented_lora, case, torch.float32)
    expected = autograd_grads(lambda x, A, B, table, mask: naive_delta(x, A, B, table.segments, mask), case, torch.float32)
    for name, g, e in zip(("delta", "grad_x", "grad_A", "grad_B"), got, expected):
        assert_close(g, e, torch.float32, name)
    covered = torch.zeros(case.table.total_rows, dtype=torch.bool)
    for seg in case.table.segments:
        covered[seg.row_start : seg.row_end] = True
    assert torch.equal(got[0][~covered], torch.zeros_like(got[0][~covered]))  # base-only rows: no delta
    assert torch.equal(got[1][~covered], torch.zeros_like(got[1][~covered]))


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_torch_backward_matches_autograd_of_the_reference(layout: str, with_dropout: bool) -> None:
    case = make_case(layout, with_dropout)
    got = autograd_grads(lambda x, A, B, table, mask: ops.segmented_lora(x, A, B, table, mask, impl="torch"), case, torch.float32)
    expected = autograd_grads(ops.reference_segmented_lora, case, torch.float32)
    for name, g, e in zip(("delta", "grad_x", "grad_A", "grad_B"), got, expected):
        assert_close(g, e, torch.float32, name)


# ---------------------------------------------------------------------------------------------------------------------
# Segmented kernels under the interpreter


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_shrink_kernel(interpreter: ProcessPoolExecutor, layout: str, dtype: torch.dtype, with_dropout: bool) -> None:
    case = make_case(layout, with_dropout, dtype)
    h = interpreted(interpreter, job_shrink, layout, dtype, with_dropout)
    f32 = case.to(torch.float32)
    expected = ops.reference_shrink(f32.x, f32.A, f32.table, f32.mask)
    assert h.dtype == dtype and h.shape == (case.table.total_rows, case.table.max_rank)
    assert_close(h, expected, dtype, "h")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_expand_kernel_adds_in_place(interpreter: ProcessPoolExecutor, layout: str, dtype: torch.dtype) -> None:
    case = make_case(layout, False, dtype)
    h, base = expand_inputs(case, dtype)
    out = interpreted(interpreter, job_expand, layout, dtype)
    expected = ops.reference_expand(h.float(), case.B.float(), case.table, base.float())
    assert_close(out, expected, dtype, "out")


@pytest.mark.parametrize("with_dropout", DROPOUT)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_segmented_lora_and_its_gradients(interpreter: ProcessPoolExecutor, layout: str, dtype: torch.dtype,
                                          with_dropout: bool) -> None:
    case = make_case(layout, with_dropout, dtype)
    got = interpreted(interpreter, job_segmented, layout, dtype, with_dropout)
    expected = autograd_grads(ops.reference_segmented_lora, case, torch.float32)
    for name, g, e in zip(("delta", "grad_x", "grad_A", "grad_B"), got, expected):
        assert g.dtype == dtype
        assert_close(g, e, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_grad_into_adds_the_weight_gradients_into_fp32_buffers(interpreter: ProcessPoolExecutor, impl: str,
                                                               dtype: torch.dtype) -> None:
    # The layer's path (compute/lora/slots.py): bf16 (or fp32) compute, the weight gradients added into the fp32
    # masters' persistent gradient buffers, only the pass's slots touched, autograd handed nothing for A and B.
    layout = "slot-twice"
    case = make_case(layout, True, dtype)
    if impl == "torch":
        delta, grad_x, into_A, into_B, autograd_none = job_grad_into(layout, dtype, "torch")
    else:
        delta, grad_x, into_A, into_B, autograd_none = interpreted(interpreter, job_grad_into, layout, dtype, "triton")
    expected = autograd_grads(ops.reference_segmented_lora, case, torch.float32)
    assert autograd_none and into_A.dtype == into_B.dtype == torch.float32
    start_A, start_B = grad_into_start()
    for name, g, e in (("delta", delta, expected[0]), ("grad_x", grad_x, expected[1]),
                       ("grad_A", into_A - start_A, expected[2]), ("grad_B", into_B - start_B, expected[3])):
        assert_close(g, e, dtype, name)
    untouched = [slot for slot in range(SLOTS) if slot not in {s.slot for s in case.table.segments}]
    assert torch.equal(into_A[untouched], start_A[untouched]) and torch.equal(into_B[untouched], start_B[untouched])


def test_an_empty_table_gives_zero(interpreter: ProcessPoolExecutor) -> None:
    delta, grad_x = interpreted(interpreter, job_empty)
    assert torch.equal(delta, torch.zeros(4, OUT)) and torch.equal(grad_x, torch.zeros(4, IN))


# ---------------------------------------------------------------------------------------------------------------------
# Per-row (BGMV) kernels: decoding

ROW_SLOTS = [1, -1, 0, 3, 1, -1, 4, 2]  # two rows of slot 1, base-only rows between
SLOT_RANKS = [1, 8, 16, 33, 64]
SLOT_SCALINGS = [2.0, 0.5, 1.0, 0.25, 1.5]


def rows_case(dtype: torch.dtype) -> tuple[ops.RowsTable, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    A, B = slot_buffers(dict(enumerate(SLOT_RANKS)), SLOTS, generator)
    x = torch.randn(len(ROW_SLOTS), IN, generator=generator)
    base = torch.randn(len(ROW_SLOTS), OUT, generator=generator)
    table = ops.build_rows_table(ROW_SLOTS, SLOT_RANKS, SLOT_SCALINGS, "cpu")
    return table, x.to(dtype), A.to(dtype), B.to(dtype), base.to(dtype)


# Scattered rows of a slot (an index), contiguous runs of rows (views), and one adapter for every row (one slice).
@pytest.mark.parametrize("row_slots", [ROW_SLOTS, [2, 2, 2, -1, 0, 0, 1, -1], [3] * 8])
def test_rows_reference_matches_a_per_row_loop(row_slots: list[int]) -> None:
    _, x, A, B, base = rows_case(torch.float32)
    table = ops.build_rows_table(row_slots, SLOT_RANKS, SLOT_SCALINGS, "cpu")
    got = ops.rows_lora(x, A, B, table, base.clone(), impl="torch")
    expected = base.clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            r = SLOT_RANKS[slot]
            expected[row] += F.linear(F.linear(x[row], A[slot, :r]), B[slot, :, :r]) * SLOT_SCALINGS[slot]
    assert_close(got, expected, torch.float32, "out")
    assert_close(ops.lora_expand_rows(ops.reference_shrink_rows(x, A, table), B, table, base.clone(), impl="torch"),
                 expected, torch.float32, "shrink then expand")
    for row in (row for row, slot in enumerate(row_slots) if slot < 0):
        assert torch.equal(got[row], base[row])  # base-only rows untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_kernels(interpreter: ProcessPoolExecutor, dtype: torch.dtype) -> None:
    table, x, A, B, base = rows_case(dtype)
    h, out = interpreted(interpreter, job_rows, dtype)
    expected_h = ops.reference_shrink_rows(x.float(), A.float(), table)
    assert_close(h, expected_h, dtype, "h")
    assert_close(out, ops.reference_expand_rows(expected_h, B.float(), table, base.float()), dtype, "out")
    assert torch.equal(out[1], base[1]) and torch.equal(out[5], base[5])


# ---------------------------------------------------------------------------------------------------------------------
# Compiled, not interpreted: each kernel through triton's compiler and ptxas for an H100 (sm_90), no GPU needed. The
# interpreter accepts what the compiler refuses (it once let `typing.Any` annotations through), so both are checked.

SEGMENT_TABLE = {"starts_ptr": "*i32", "ends_ptr": "*i32", "slots_ptr": "*i32", "ranks_ptr": "*i32", "scalings_ptr": "*fp32"}
COMPILED = {  # kernel: (pointer types with {t} for the data dtype, constexprs as the launchers pass them)
    "shrink": ({"x_ptr": "*{t}", "w_ptr": "*{t}", "mask_ptr": "*{t}", "h_ptr": "*{t}", **SEGMENT_TABLE},
               {"HAS_MASK": True, "SCALE": True, "BLOCK_T": 64, "BLOCK_R": 64, "BLOCK_K": 32}),
    "expand": ({"h_ptr": "*{t}", "w_ptr": "*{t}", "out_ptr": "*{t}", **SEGMENT_TABLE},
               {"SCALE": True, "BLOCK_T": 64, "BLOCK_N": 64, "BLOCK_R": 32}),
    "outer": ({"p_ptr": "*{t}", "q_ptr": "*{t}", "mask_ptr": "*{t}", "g_ptr": "*{t}", **SEGMENT_TABLE, "slot_ids_ptr": "*i32",
               "slot_ranks_ptr": "*i32"}, {"RANK_ON_M": True, "HAS_MASK": True, "SCALE": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_T": 32}),
    "shrink_rows": ({"x_ptr": "*{t}", "w_ptr": "*{t}", "h_ptr": "*{t}", "row_slots_ptr": "*i32", "slot_ranks_ptr": "*i32"},
                    {"BLOCK_R": 64, "BLOCK_K": 128}),
    "expand_rows": ({"h_ptr": "*{t}", "w_ptr": "*{t}", "out_ptr": "*{t}", "row_slots_ptr": "*i32", "slot_ranks_ptr": "*i32",
                     "slot_scalings_ptr": "*fp32"}, {"BLOCK_N": 128, "BLOCK_R": 32}),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("kernel", list(COMPILED))
def test_the_kernels_compile_for_an_h100(kernel: str, dtype: str) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernels here would be interpreted")
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(triton_kernels._kernels(), kernel)
    pointers, constexprs = COMPILED[kernel]
    if "DOT_F32" in fn.arg_names:
        constexprs = {**constexprs, "DOT_F32": dtype == "fp32"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32").format(t=dtype) for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32), options=ops.LAUNCH)
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 100 * 1024  # fits consumer cards' shared memory too


# ---------------------------------------------------------------------------------------------------------------------
# Tables, the chooser, and the module without triton


def test_build_table_lays_out_segments_and_distinct_slots() -> None:
    segments, rows = LAYOUTS["slot-twice"]
    table = ops.build_table(segments, "cpu", rows)
    assert table.seg_starts.tolist() == [0, 9, 26] and table.seg_ends.tolist() == [9, 26, 40]
    assert table.seg_slots.tolist() == [1, 0, 1] and table.seg_ranks.tolist() == [16, 33, 16]
    assert table.seg_scalings.dtype == torch.float32 and table.seg_scalings.tolist() == [1.0, 0.5, 1.0]
    assert table.slot_ids.tolist() == [1, 0] and table.slot_ranks.tolist() == [16, 33]
    assert (table.max_rank, table.num_segments, table.total_rows, table.max_segment_rows) == (33, 3, 40, 17)
    assert table.seg_starts.untyped_storage().data_ptr() == table.seg_scalings.untyped_storage().data_ptr()  # one buffer


@pytest.mark.parametrize("segments", [
    pytest.param([(0, 5, 0, 8, 1.0), (4, 9, 1, 8, 1.0)], id="overlapping"),
    pytest.param([(0, 5, 0, 8, 1.0), (5, 9, 0, 16, 1.0)], id="one-slot-two-ranks"),
    pytest.param([(0, 50, 0, 8, 1.0)], id="past-the-rows"),
    pytest.param([(3, 3, 0, 8, 1.0)], id="empty-segment"),
    pytest.param([(0, 3, 0, 0, 1.0)], id="rank-zero"),
])
def test_build_table_refuses(segments: list[tuple[int, int, int, int, float]]) -> None:
    with pytest.raises(ValueError):
        ops.build_table(segments, "cpu", 40)


def test_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SIGNAL_LORA_KERNELS", raising=False)
    assert ops.choose("cpu", torch.float32) == "grouped"  # a bmm per group of equal segments (ops/grouped.py)
    assert ops.choose("cpu", torch.bfloat16) == "grouped"
    monkeypatch.setenv("SIGNAL_LORA_KERNELS", "triton")
    assert ops.choose("cpu", torch.float32) == "triton"
    monkeypatch.setenv("SIGNAL_LORA_KERNELS", "torch")
    assert ops.choose("cuda", torch.bfloat16) == "torch"
    monkeypatch.setenv("SIGNAL_LORA_KERNELS", "grouped")
    assert ops.choose("cuda", torch.bfloat16) == "grouped"
    monkeypatch.setenv("SIGNAL_LORA_KERNELS", "cuda-please")
    with pytest.raises(ValueError):
        ops.choose("cpu", torch.float32)


def test_the_module_and_its_torch_path_need_no_triton() -> None:
    script = """
import sys
sys.modules["triton"] = None  # any import of triton now fails
import torch
from gpu_runtime.compute.lora import ops
ops.triton_installed.cache_clear()
assert not ops.triton_installed() and ops.choose("cuda", torch.bfloat16) == "grouped"
table = ops.build_table([(0, 2, 0, 4, 1.0)], "cpu", 3)
x, A, B = torch.randn(3, 8, requires_grad=True), torch.randn(1, 4, 8), torch.randn(1, 6, 4)
ops.segmented_lora(x, A, B, table).sum().backward()
assert x.grad is not None and "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
"""
    env = {k: v for k, v in os.environ.items() if k not in ("SIGNAL_LORA_KERNELS", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------------------------------
# Jobs the interpreter process runs: each builds its inputs from the seeds above and returns plain tensors


def expand_inputs(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    h = ops.reference_shrink(case.x, case.A, case.table)
    return h, torch.randn(case.table.total_rows, OUT, generator=torch.Generator().manual_seed(9)).to(dtype)


def job_shrink(layout: str, dtype: torch.dtype, with_dropout: bool) -> torch.Tensor:
    case = make_case(layout, with_dropout, dtype)
    return ops.lora_shrink(case.x, case.A, case.table, case.mask)


def job_expand(layout: str, dtype: torch.dtype) -> torch.Tensor:
    case = make_case(layout, False, dtype)
    h, out = expand_inputs(case, dtype)
    returned = ops.lora_expand(h, case.B, case.table, out)
    assert returned is out
    return out


def job_segmented(layout: str, dtype: torch.dtype, with_dropout: bool) -> tuple[torch.Tensor, ...]:
    return autograd_grads(ops.segmented_lora, make_case(layout, with_dropout, dtype), dtype)


def grad_into_start() -> tuple[torch.Tensor, torch.Tensor]:
    """What the persistent gradient buffers held before the pass (an earlier call's gradients)."""
    generator = torch.Generator().manual_seed(17)
    return torch.randn(SLOTS, MAX_RANK, IN, generator=generator), torch.randn(SLOTS, OUT, MAX_RANK, generator=generator)


def job_grad_into(layout: str, dtype: torch.dtype, impl: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    case = make_case(layout, True, dtype)
    x, A, B = (t.detach().requires_grad_() for t in (case.x, case.A, case.B))
    into = grad_into_start()
    delta = ops.segmented_lora(x, A, B, case.table, case.mask, impl="torch" if impl == "torch" else "triton", grad_into=into)
    delta.backward(case.grad)
    assert x.grad is not None
    return delta.detach(), x.grad, into[0], into[1], A.grad is None and B.grad is None


def job_empty() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, IN, requires_grad=True)
    A, B = torch.zeros(SLOTS, MAX_RANK, IN, requires_grad=True), torch.zeros(SLOTS, OUT, MAX_RANK, requires_grad=True)
    delta = ops.segmented_lora(x, A, B, ops.build_table([], "cpu", 4))
    delta.sum().backward()
    assert x.grad is not None
    return delta.detach(), x.grad


def job_rows(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    table, x, A, B, base = rows_case(dtype)
    h = ops.lora_shrink_rows(x, A, table)
    out = base.clone()
    assert ops.lora_expand_rows(ops.reference_shrink_rows(x.float(), A.float(), table).to(dtype), B, table, out) is out
    return h, out
