"""A SampleRequest's prompt extras beyond Signal's own sample: `target_prompt_logprobs` (the logprobs of chosen ids at
each prompt position, scored by a `forward` on the sampler's own weights: column k of the request is one datum whose
targets are that column), `prompt_logprobs_last_n` (the prompt is scored whole; earlier entries are left out) and
`prompt_alt_tokens_k` (k draws at each prompt position, taken by the decode engine's prefill: the contract's bounds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.errors import BadInput
from app.tinker.fields import integer, optional_integer
from gpu_runtime.contract.batch_items import DatumItem
from gpu_runtime.contract.results import ForwardResult
from gpu_runtime.contract.sampling_settings import MAX_TOPK_LOGPROBS, check_prompt_alt_tokens

FIELD = "target_prompt_logprobs"
NOTHING = -1  # a cell that requests no logprob (the SDK's convention)


@dataclass(frozen=True)
class Targets:
    """The requested ids as (rows = len(prompt) - 1, width = K), each cell's id or NOTHING; `csr` keeps a sparse
    request's (crow, col) indices, so the answer has its layout."""

    rows: int
    width: int
    ids: list[list[int]]
    csr: tuple[list[int], list[int]] | None = None

    def datums(self, prompt: list[int]) -> list[DatumItem]:
        """One datum per column: position i predicts prompt[i + 1]; the column's id there (NOTHING scored as id 0)."""
        return [DatumItem(prompt[:-1], {"target_tokens": [max(row[k], 0) for row in self.ids]})
                for k in range(self.width)]

    def values(self, forward: ForwardResult) -> list[float]:
        """The answer's values: dense row-major (0.0 where nothing was asked), or the CSR cells in their order."""
        scores = [output["logprobs"] for output in forward.outputs]
        if self.csr is None:
            return [scores[k][i] if self.ids[i][k] != NOTHING else 0.0 for i in range(self.rows)
                    for k in range(self.width)]
        crow, cols = self.csr
        return [scores[cols[j]][i] for i in range(self.rows) for j in range(crow[i], crow[i + 1])]


def targets(data: Mapping[str, object], prompt_length: int) -> Targets | None:
    """The request's target_prompt_logprobs (a TensorData: int64, [len(prompt) - 1, K], dense or CSR), checked."""
    given = data.get(FIELD)
    if given is None:
        return None
    if not isinstance(given, dict) or given.get("dtype") != "int64" or not isinstance(given.get("data"), list):
        raise BadInput(f"{FIELD} must be an int64 tensor of token ids", field=FIELD)
    shape = given.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or shape[0] != prompt_length - 1 or \
            not all(isinstance(n, int) for n in shape) or not 1 <= shape[1] <= MAX_TOPK_LOGPROBS:
        raise BadInput(f"{FIELD} must be [len(prompt) - 1, K] = [{prompt_length - 1}, K] with K in "
                       f"1..{MAX_TOPK_LOGPROBS}, got shape {shape}", field=FIELD)
    rows, width = shape
    values = [integer(v, f"{FIELD}.data[{i}]", NOTHING) for i, v in enumerate(given["data"])]
    if given.get("sparse_crow_indices") is None:
        if len(values) != rows * width:
            raise BadInput(f"{FIELD}: shape {shape} does not hold {len(values)} values", field=FIELD)
        return Targets(rows, width, [values[i * width:(i + 1) * width] for i in range(rows)])
    crow, cols = given.get("sparse_crow_indices"), given.get("sparse_col_indices")
    if not isinstance(crow, list) or not isinstance(cols, list) or len(crow) != rows + 1 or len(cols) != len(values) \
            or crow[0] != 0 or crow[-1] != len(values) or any(not 0 <= a <= b for a, b in zip(crow, crow[1:])) \
            or any(not isinstance(c, int) or not 0 <= c < width for c in cols):
        raise BadInput(f"{FIELD}: the CSR indices do not fit shape {shape}", field=FIELD)
    ids = [[NOTHING] * width for _ in range(rows)]
    for i in range(rows):
        for j in range(crow[i], crow[i + 1]):
            ids[i][cols[j]] = values[j]
    return Targets(rows, width, ids, (list(crow), list(cols)))


def last_n(data: Mapping[str, object], prompt_length: int, prompt_logprobs: bool) -> int | None:
    """prompt_logprobs_last_n: 1..len(prompt) - 1, with prompt_logprobs (the SDK's own rule)."""
    n = optional_integer(data, "prompt_logprobs_last_n", None, low=1, high=max(1, prompt_length - 1))
    if n is not None and not prompt_logprobs:
        raise BadInput("prompt_logprobs_last_n applies to prompt logprobs: set prompt_logprobs",
                       field="prompt_logprobs_last_n")
    return n


def alt_tokens_k(data: Mapping[str, object], prompt_length: int) -> int:
    """prompt_alt_tokens_k (null or absent: 0, none), checked at submit against the contract's bounds: draws per
    position and draws per prompt (k x (len(prompt) - 1))."""
    value = data.get("prompt_alt_tokens_k")
    return 0 if value is None else check_prompt_alt_tokens(value, [prompt_length])


def keep_last(values: list[Any] | None, n: int | None) -> list[Any] | None:
    """A prompt's per-position values with all but the last n left out (None), as prompt_logprobs_last_n asks."""
    if values is None or n is None:
        return values
    return [None] * (len(values) - n) + values[len(values) - n:]
