"""One batched sampler for every row of a decode step: per-row temperature, top-k, top-p and seed as device tensors.

Randomness is counter-based: row r's draw is a function of one uniform u, a hash of (seed, sequence index, position),
so a seeded sequence draws the same tokens alone, beside other sequences, at any batch size and in any row. The draw
is inverse-CDF: with p = softmax(logits / temperature) restricted to the tokens top-k and top-p keep, the token is the
first index whose cumulative probability passes u x (the row's total), which picks token t with probability p[t].
One uniform per row, never one per token: the hash runs on [rows] and the [rows, vocab] work is a softmax and a cumsum.

The hash runs on 32-bit lanes held in int64 tensors. A product of two 32-bit values can reach 2**64, past int64
(signed overflow is undefined behaviour in the C++ kernels), so every multiply is split: x * c mod 2**32 is
(x * c_lo + ((x * c_hi) mod 2**16) * 2**16) mod 2**32 with c = c_hi * 2**16 + c_lo, each partial product under 2**48.
The mixer is murmur3's 32-bit finaliser (fmix32), folding the key's parts one by one into a row key.

Reported logprobs are the unmodified model's log_softmax at the chosen token (temperature 1, no filter), the quantity
a teacher-forced forward gives, as gpu_runtime/sampling.py reports them; top-k logprobs are from the same
distribution. Temperature 0 is argmax.

A prompt's alternative tokens (`prompt_draws`, Tinker's prompt_alt_tokens) are k draws per prompt position from the
whole distribution at the call's temperature (no top-k or top-p), the same inverse-CDF lookup with k uniforms per
row, each from its own counter (seed, sequence index, position, draw index) under DRAW_SALT, so they stay apart from
the decode step's draw at the same position.

Cost per step, all on the device and with no host sync: a log_softmax and an argmax over [rows, vocab]; with any
sampled row, a division, a softmax and a cumsum over [rows, vocab], one searchsorted per row and the hash's few dozen
int64 kernels on [rows]; with top-k, one `topk` of the largest k in the batch (`top_k_cap`, a host int); with
top-p, a sort, softmax and cumsum over the rows that ask for it only (`top_p_rows`, host-known indices):
O(rows_p x vocab log vocab). The cumsum is float32: a token far below the float32 spacing of the running sum
(about 3e-8 of the row's mass) can be rounded away, a bias of that size per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2**32 / phi: spreads consecutive token ids before mixing
ROW_SALT = 0x85EBCA77
DRAW_SALT = 0x27D4EB2F  # a prompt draw's counter: apart from every decode step's noise


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without any intermediate reaching 2**63."""
    lo, hi = c & 0xFFFF, (c >> 16) & 0xFFFF
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on 32-bit lanes in int64: a bijection of [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    """A Python seed (any int) as two 32-bit lanes: its value mod 2**64."""
    seed &= (1 << 64) - 1
    return seed & MASK32, seed >> 32


def row_keys(seed_lo: torch.Tensor, seed_hi: torch.Tensor, seq: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (seed, sequence index, position): [rows] int64."""
    h = fmix32((position & MASK32) ^ ROW_SALT)
    h = fmix32(h ^ (seq & MASK32))
    h = fmix32(h ^ seed_hi)
    return fmix32(h ^ seed_lo)


def unit(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash as a float32 in (0, 1]: its top 24 bits, centred in their bin. Never 0; the top bin's centre,
    1 - 2**-25, rounds to 1.0 in float32 (one hash in 2**24), which inverse_cdf's bound below the total absorbs."""
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def draw_uniforms(keys: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """u[r, j] in (0, 1], float32, a function of keys[r] and lanes[j] only: [rows] x [k] -> [rows, k]."""
    return unit(fmix32(fmix32(keys[:, None] ^ lanes[None, :]) ^ mul32(keys, GOLDEN)[:, None]))


def inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each u [rows, k] in (0, 1], the first index of its row of `cdf` [rows, vocab] (cumulative, unnormalised
    probabilities) whose value passes u x the row's total: [rows, k] int64 ids, token t drawn with probability p[t].

    A token of probability 0 is never chosen: its cumulative value equals the one before it (adding 0 is exact), so
    if it passed the target the token before it did too and the search stopped there; token 0 of probability 0 has
    value 0, which passes no target (targets are >= 0). The target is held strictly below the total (u x total can
    round up to it, and u can be 1), which the last entry equals, so the index never runs past the row onto a masked
    last token; the clamp only bounds a row of NaNs. "Passes" (right=True), not "reaches": prompt_draws' draws stay
    as they were (ties with a float32 plateau of the cumsum are not rare at a 49k vocabulary)."""
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=int(cdf.shape[-1]) - 1)


def prompt_draws(logits: torch.Tensor, positions: torch.Tensor, k: int, temperature: float, seed: int,
                 seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k independent draws, with replacement, from softmax(logits / temperature) of each row of `logits` [rows, vocab]
    (the whole distribution; temperature 0: the argmax k times), row r's draw j a function of (seed, seq,
    positions[r], j) alone, so chunking and batch neighbours change nothing. Returns the ids [rows, k] int64 and
    their unmodified logprobs (temperature 1, as `sample` reports) [rows, k] float32."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    rows = int(logits.shape[0])
    if temperature <= 0:
        ids = logits.argmax(dim=-1, keepdim=True).expand(rows, k).contiguous()
    else:
        cdf = torch.softmax(logits / temperature, dim=-1).cumsum(dim=-1)
        lo, hi = split_seed(seed)
        keys = row_keys(torch.full_like(positions, lo), torch.full_like(positions, hi), torch.full_like(positions, seq),
                        positions)
        draws = fmix32(torch.arange(k, device=logits.device, dtype=torch.int64) ^ DRAW_SALT)
        ids = inverse_cdf(cdf, draw_uniforms(keys, draws))
    return ids, logprobs.gather(1, ids)


@dataclass
class RowParams:
    """Per-row sampling settings on the device, one entry per row of the batch (views of per-slot buffers)."""

    temperature: torch.Tensor  # float32; 0: argmax
    top_k: torch.Tensor  # int64; 0: off
    top_p: torch.Tensor  # float32; 1: off
    seed_lo: torch.Tensor  # int64, low 32 bits of the seed
    seed_hi: torch.Tensor  # int64, high 32 bits
    seq: torch.Tensor  # int64, the sequence index (sample number) inside its request


@dataclass
class Sampled:
    tokens: torch.Tensor  # [rows] int64
    logprobs: torch.Tensor  # [rows] float32, the unmodified model's
    top_values: torch.Tensor | None  # [rows, k] float32, the k most likely logprobs, most likely first
    top_ids: torch.Tensor | None  # [rows, k] int64


def sample(logits: torch.Tensor, params: RowParams, position: torch.Tensor, *, any_sampled: bool = True,
           top_k_cap: int = 0, top_p_rows: torch.Tensor | None = None, logprobs_k: int = 0) -> Sampled:
    """The next token of every row of `logits` [rows, vocab] at `position` [rows] (the index the token will have in
    its sequence). Host ints choose kernels only, never values: `any_sampled` (some row has temperature > 0; False
    skips the draw), `top_k_cap` (the largest top_k of any row, 0: none), `top_p_rows` (indices of rows with
    top_p < 1, None: none), `logprobs_k` (top logprobs to return per row)."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    if any_sampled:
        hot = params.temperature > 0
        scaled = logits / torch.where(hot, params.temperature, 1.0)[:, None]
        vocab = int(logits.shape[-1])
        if top_k_cap > 0:
            cap = min(top_k_cap, vocab)
            largest = torch.topk(scaled, cap, dim=-1).values
            kth = largest.gather(1, (params.top_k.clamp(1, cap) - 1)[:, None])
            scaled = scaled.masked_fill((params.top_k[:, None] > 0) & (scaled < kth), -torch.inf)
        if top_p_rows is not None:
            scaled = _top_p(scaled, params.top_p, top_p_rows)
        # Masked tokens are -inf, so probability 0: never drawn (inverse_cdf); the key is fully mixed, so its top bits
        # are the row's uniform as they stand.
        u = unit(row_keys(params.seed_lo, params.seed_hi, params.seq, position))
        drawn = inverse_cdf(torch.softmax(scaled, dim=-1).cumsum(dim=-1), u[:, None]).squeeze(1)
        tokens = torch.where(hot, drawn, tokens)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if logprobs_k > 0:
        values, ids = torch.topk(logprobs, min(logprobs_k, int(logits.shape[-1])), dim=-1)
        return Sampled(tokens, chosen, values, ids)
    return Sampled(tokens, chosen, None, None)


def _top_p(scaled: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keep, in each of `rows`, the most likely tokens whose probabilities before them sum to at most top_p (the first
    always stays), as sampling.py does; a sort over those rows only. Ties with the last kept token stay too."""
    part = scaled.index_select(0, rows)
    ordered = torch.sort(part, dim=-1, descending=True).values
    probs = torch.softmax(ordered, dim=-1)
    keep = (probs.cumsum(dim=-1) - probs) <= top_p.index_select(0, rows)[:, None]
    last = (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    threshold = ordered.gather(1, last)
    return scaled.index_copy(0, rows, part.masked_fill(part < threshold, -torch.inf))
