"""The decode engine's batched sampler (gpu_runtime/compute/decode/sampler.py) on its own: one counter-based uniform
per row, inverse-CDF draws that follow the tempered, filtered softmax (a chi-square with fixed seeds, so it cannot
flake, and a wrong distribution that the same bound refuses), top-k and top-p, masked tokens never drawn, and a
seeded row's token independent of its neighbours and its place in the batch."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.compute.decode.sampler import RowParams, draw_uniforms, inverse_cdf, row_keys, sample, split_seed, unit
from tests.gpu_runtime.test_decode_prompt_draws import _bound, _chi_square

ROWS = 4096


def _params(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> RowParams:
    """Rows that differ by seed only: each one a fresh draw from the same distribution."""
    return RowParams(temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k),
                     top_p=torch.full((rows,), top_p), seed_lo=torch.arange(rows), seed_hi=torch.zeros(rows, dtype=torch.int64),
                     seq=torch.zeros(rows, dtype=torch.int64))


def _expected(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """log of softmax(logits / temperature) over the top_k most likely tokens (0: all)."""
    scaled = logits / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], -torch.inf)
    return torch.log_softmax(scaled, dim=-1)


def test_the_uniform_is_a_function_of_the_row_key_only() -> None:
    keys = row_keys(torch.tensor([0, 1, 0]), torch.tensor([0, 0, 2**32 - 1]), torch.tensor([0, 0, 3]), torch.tensor([5, 5, 9]))
    u = unit(keys)
    assert float(u.min()) > 0 and float(u.max()) <= 1
    assert torch.equal(unit(keys[1:2]), unit(keys)[1:2])
    many = unit(row_keys(torch.arange(ROWS), torch.zeros(ROWS, dtype=torch.int64), torch.zeros(ROWS, dtype=torch.int64),
                         torch.zeros(ROWS, dtype=torch.int64)))
    assert abs(float(many.mean()) - 0.5) < 0.02 and len(set(many.tolist())) == ROWS
    lanes = torch.tensor([7, 8])
    assert torch.equal(draw_uniforms(keys, lanes)[1:2], draw_uniforms(keys[1:2], lanes))
    assert split_seed(-1) == (2**32 - 1, 2**32 - 1)


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 0), (1.3, 40)])
def test_sampled_tokens_follow_the_tempered_filtered_softmax(temperature: float, top_k: int) -> None:
    logits = torch.randn(512, generator=torch.Generator().manual_seed(3)) * 2
    drawn = sample(logits.expand(ROWS, -1).contiguous(), _params(ROWS, temperature, top_k),
                   torch.full((ROWS,), 11), top_k_cap=top_k)
    expected = _expected(logits, temperature, top_k)
    statistic, dof = _chi_square([drawn.tokens.tolist()], expected[None])
    assert dof > 20 and statistic < _bound(dof), (statistic, dof)
    assert drawn.logprobs.tolist() == pytest.approx(torch.log_softmax(logits, -1)[drawn.tokens].tolist(), abs=1e-6)
    # The same bound refuses the draws against another temperature (the test has the power to see a wrong sampler).
    wrong, _ = _chi_square([drawn.tokens.tolist()], _expected(logits, temperature * 2, top_k)[None])
    assert wrong > 2 * _bound(dof), (wrong, dof)


@pytest.mark.parametrize(("top_k", "top_p", "allowed"), [(2, 1.0, {0, 1}), (0, 0.4, {0}), (0, 0.5, {0, 1}), (3, 0.7, {0, 1})])
def test_sampler_keeps_only_what_top_k_and_top_p_allow(top_k: int, top_p: float, allowed: set[int]) -> None:
    rows = 400
    logits = torch.log(torch.tensor([[0.45, 0.3, 0.15, 0.1]])).expand(rows, -1).contiguous()
    drawn = sample(logits, _params(rows, 1.0, top_k, top_p), torch.zeros(rows, dtype=torch.int64), top_k_cap=top_k,
                   top_p_rows=torch.arange(rows) if top_p < 1 else None)
    assert set(drawn.tokens.tolist()) == allowed


def test_the_largest_uniform_never_lands_on_a_masked_last_token() -> None:
    # u of the top bin is 1.0 in float32 and u x total rounds up to the total: the search must stop inside the row.
    u = unit(torch.tensor([2**32 - 1]))
    assert float(u) == 1.0
    cdf = torch.tensor([[0.25, 1.0000001, 1.0000001, 1.0000001]])  # tokens 2 and 3: probability 0
    assert inverse_cdf(cdf, u[:, None]).tolist() == [[1]]
    assert inverse_cdf(torch.tensor([[0.0, 0.0, 0.6, 0.6, 1.0]]), torch.tensor([[2**-25, 0.6, 0.61]])).tolist() == [[2, 4, 4]]


def test_a_seeded_row_draws_the_same_token_in_any_row_and_beside_any_rows() -> None:
    rows = 64
    logits = torch.randn(rows, 512, generator=torch.Generator().manual_seed(4)) * 2
    params = _params(rows, 0.9, top_k=100, top_p=0.95)
    params.seed_hi = torch.arange(rows) * 31
    position = torch.arange(rows) + 20
    whole = sample(logits, params, position, top_k_cap=100, top_p_rows=torch.arange(rows)).tokens
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(5))
    shuffled = RowParams(*(getattr(params, f)[order] for f in ("temperature", "top_k", "top_p", "seed_lo", "seed_hi", "seq")))
    moved = sample(logits[order], shuffled, position[order], top_k_cap=100, top_p_rows=torch.arange(rows)).tokens
    assert torch.equal(moved, whole[order])
    alone = [int(sample(logits[r:r + 1], RowParams(*(getattr(params, f)[r:r + 1] for f in (
        "temperature", "top_k", "top_p", "seed_lo", "seed_hi", "seq"))), position[r:r + 1], top_k_cap=100,
        top_p_rows=torch.arange(1)).tokens) for r in (0, 17, 63)]
    assert alone == whole[[0, 17, 63]].tolist()
