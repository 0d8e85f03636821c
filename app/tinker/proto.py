"""Tinker's protobuf messages, from the SDK's generated module loaded by file path, and their (de)coding.

`import tinker…` would run tinker/__init__, which imports torch wherever torch is installed (and the SDK's
client stack everywhere): the server must stay torch-free (`app` never imports torch). The generated
`tinker/proto/tinker_public_pb2.py` needs only `google.protobuf`, so it is executed here on its own, under a
private module name that puts nothing named `tinker` in sys.modules. Numeric byte fields are raw little-endian
arrays (the SDK writes numpy's `tobytes()`), read and written with the stdlib's `array`.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from app.errors import BadInput
from gpu_runtime.contract import SampledSequence
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.contract.training_settings import MAX_SOFT_TARGETS

T = TypeVar("T", int, float)  # what an array of numbers holds
MODULE_NAME = "signal_tinker_public_pb2"
# A CSR tensor names its shape: a few bytes could claim a billion empty rows. No model Signal serves has a longer context.
MAX_CSR_ROWS = 1 << 17  # not under `tinker`: its parent package would have to be imported
MASK_LOGPROB = -99999.0  # an empty top-k cell, as the SDK reads it (tinker/types/topk_logprobs.py)


@cache
def pb() -> ModuleType:
    """The SDK's generated module, executed from its file (find_spec locates the package without importing it)."""
    spec = importlib.util.find_spec("tinker")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the tinker package (tinker==0.38.0, a server dependency) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    file_spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if file_spec is None or file_spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[MODULE_NAME] = module
    file_spec.loader.exec_module(module)
    return module


def _read(values: array[T], data: bytes) -> list[T]:
    if len(data) % values.itemsize:
        raise BadInput(f"a byte field of {len(data)} bytes is no array of {values.itemsize}-byte values", field="data")
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def _numbers(typecode: str, data: bytes) -> list[float]:
    values: array[float] = array(typecode)  # ints for "i" and "q": a float to the type checker
    return _read(values, data)


def _bytes(typecode: str, values: Sequence[float]) -> bytes:
    packed = array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


# ---- ForwardBackwardRequest → Signal's datums -------------------------------------------------------------

Values = list[float] | list[list[float]]  # a loss input: per position (1-D), or per position and target (N, K)


@dataclass(frozen=True)
class Span:
    """A datum's provenance span: `length` positions from `offset` of a sampled sequence, or of the prompt."""

    kind: str  # sampled | prompt
    sequence_id: str
    offset: int
    length: int


@dataclass
class TinkerDatum:
    """A datum as decoded; app/tinker/stability.py may replace its `logprobs` from the spans before it is trained."""

    model_input: list[int]
    loss_fn_inputs: dict[str, Values]
    spans: list[Span]

    def to_dict(self) -> JSONObject:
        """The shape Signal's batch takes ({model_input: [ids], loss_fn_inputs: {name: [values]}}); spans stay here."""
        return {"model_input": self.model_input, "loss_fn_inputs": dict(self.loss_fn_inputs)}


@dataclass(frozen=True)
class ForwardBackwardMessage:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool
    data: list[TinkerDatum]


def decode_forward_backward(body: bytes) -> ForwardBackwardMessage:
    """The request as plain values. Raises BadInput for a body that is no ForwardBackwardRequest or holds what Signal
    cannot train on (images, audio, sparse 2-D)."""
    from google.protobuf.message import DecodeError

    message = pb().ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except DecodeError as exc:
        raise BadInput(f"the body is no ForwardBackwardRequest protobuf: {exc}", field="body") from None
    datums = [_datum(datum, i) for i, datum in enumerate(message.data)]
    config: dict[str, float | str] = {key: float(value) for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config.setdefault(key, value.number if value.WhichOneof("value") == "number" else value.text)
    return ForwardBackwardMessage(model_id=str(message.model_id), seq_id=int(message.seq_id),
                                  loss_fn=str(message.loss_fn or "cross_entropy"), loss_fn_config=config or None,
                                  forward_only=bool(message.forward_only), data=datums)


def _datum(datum: Any, index: int) -> TinkerDatum:
    tokens: list[int] = []
    for chunk in datum.model_input:  # several encoded_text chunks are normal (rl_loop appends): concatenated
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadInput(f"data[{index}]: {kind} chunks are not supported (text only)", field=f"data[{index}]")
        tokens += _read(array("i"), chunk.encoded_text.tokens)
    inputs = {name: _tensor(tensor, f"data[{index}].loss_fn_inputs.{name}")
              for name, tensor in datum.loss_fn_inputs.items()}
    # provenance: app/tinker/stability.py resolves it; the batch never carries it
    return TinkerDatum(tokens, inputs, [_span(span) for span in datum.loss_fn_input_spans])


def _span(span: Any) -> Span:
    kind = span.WhichOneof("span")
    arm = getattr(span, kind) if kind else None
    if arm is None:
        return Span("prompt", "", 0, 0)
    return Span("sampled" if kind == "sampled_tokens" else "prompt", str(arm.sequence_id), int(arm.offset),
                int(arm.length))


def _tensor(tensor: Any, field: str) -> Values:
    """A dense or CSR tensor as a list (1-D) or a list of rows (2-D: soft targets' (N, K)); CSR's missing cells are
    0, the SDK's only pad value."""
    dtype = pb().DType.Name(tensor.dtype)
    typecode = {"DTYPE_FLOAT32": "f", "DTYPE_INT64": "q", "DTYPE_INT32": "i"}.get(dtype)
    if typecode is None:
        raise BadInput(f"{field}: dtype {dtype} is not supported", field=field)
    shape = list(tensor.shape)
    if len(shape) > 2:
        raise BadInput(f"{field}: a tensor of shape {shape}; 1-D or 2-D (N, K) are taken", field=field)
    if tensor.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise BadInput(f"{field}: a sparse tensor must be 2-D with its shape", field=field)
        return _dense_rows(tensor.sparse_csr, typecode, shape, field)
    flat = _numbers(typecode, tensor.dense)
    if len(shape) < 2:
        return flat
    rows, width = shape
    if rows * width != len(flat):
        raise BadInput(f"{field}: shape {shape} does not hold {len(flat)} values", field=field)
    return [flat[i * width:(i + 1) * width] for i in range(rows)]


def _dense_rows(csr: Any, typecode: str, shape: list[int], field: str) -> list[list[float]]:
    values, crow, cols = _numbers(typecode, csr.values), _read(array("q"), csr.crow_indices), _read(array("q"), csr.col_indices)
    rows, width = shape
    if width > MAX_SOFT_TARGETS:
        raise BadInput(f"{field}: {width} targets per position; at most {MAX_SOFT_TARGETS}", field=field)
    if rows > MAX_CSR_ROWS or len(crow) != rows + 1 or len(cols) != len(values) or crow[-1] != len(values):
        raise BadInput(f"{field}: the CSR indices do not fit shape {shape}", field=field)
    dense: list[list[float]] = [[0] * width for _ in range(rows)]
    for i in range(rows):
        if not 0 <= crow[i] <= crow[i + 1] <= len(values):
            raise BadInput(f"{field}: row {i}'s CSR offsets are out of order", field=field)
        for k in range(crow[i], crow[i + 1]):
            if not 0 <= cols[k] < width:
                raise BadInput(f"{field}: column {cols[k]} outside shape {shape}", field=field)
            dense[i][cols[k]] = values[k]
    return dense


# ---- results → ForwardBackwardOutput / SampleResponse -------------------------------------------------------

def encode_forward_backward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord of per-datum float32 fields (logprobs, elementwise_loss), in datum order; metrics named
    name:reduction. Non-finite metrics are left out (JSON could not carry them either)."""
    message = pb().ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    message.metrics.update({key: float(value) for key, value in metrics.items() if math.isfinite(value)})
    if outputs:
        record = message.loss_fn_outputs.add(num_datums=len(outputs))
        for name in outputs[0]:
            offsets, data = [0], b""
            for output in outputs:
                chunk = _bytes("f", [float(v) for v in output[name]])
                data += chunk
                offsets.append(len(data))
            record.fields[name].CopyFrom(pb().BatchedTensor(data=data, offsets=_bytes("q", offsets),
                                                            dtype=pb().DTYPE_FLOAT32))
    return bytes(message.SerializeToString())


@dataclass(frozen=True)
class SampleExtras:
    """What a SampleResponse carries beyond the sequences when asked: top-k widths (0: not asked), the prompt's top-k
    rows (None at a position with none), target_prompt_logprobs' values with their shape and CSR indices, and the
    prompt's alternative tokens (alt_k [token, logprob] pairs per position after the first)."""

    sample_k: int = 0
    prompt_k: int = 0
    topk_prompt: list[list[list[float]] | None] | None = None
    target_values: list[float] | None = None
    target_shape: tuple[int, int] = (0, 0)
    target_csr: tuple[list[int], list[int]] | None = None
    alt_k: int = 0
    alt_tokens: list[list[list[float]]] | None = None


def encode_sample_response(sequences: list[SampledSequence], prompt_logprobs: list[float | None] | None,
                           prompt_cache_hit_tokens: int = 0, extras: SampleExtras = SampleExtras()) -> bytes:
    """The sequences in submit order (sample_sequence_ids), each with its tokens, per-token logprobs, stop reason and
    top-k when asked; prompt logprobs with NaN where undefined (position 0); the prompt's tokens found in the decode
    cache; the prompt's top-k and target logprobs when asked."""
    message = pb().SampleResponse()
    for sequence in sequences:
        reason = pb().STOP_REASON_LENGTH if sequence.stop_reason == "length" else pb().STOP_REASON_STOP
        added = message.sequences.add(stop_reason=reason, tokens=_bytes("i", sequence.tokens),
                                      logprobs=_bytes("f", [float(v) for v in sequence.logprobs]))
        if extras.sample_k:
            added.topk_sampled_logprobs.CopyFrom(_topk(list(sequence.topk_logprobs or []), extras.sample_k))
    message.prompt_cache_hit_tokens = prompt_cache_hit_tokens
    if prompt_logprobs is not None:
        message.prompt_logprobs = _bytes("f", [math.nan if v is None else float(v) for v in prompt_logprobs])
    if extras.prompt_k and extras.topk_prompt is not None:
        message.topk_prompt_logprobs.CopyFrom(_topk(extras.topk_prompt, extras.prompt_k))
    if extras.target_values is not None:
        tensor = message.target_prompt_logprobs
        tensor.dtype, values = pb().DTYPE_FLOAT32, _bytes("f", extras.target_values)
        tensor.shape.extend(extras.target_shape)
        if extras.target_csr is None:
            tensor.dense = values
        else:
            crow, cols = extras.target_csr
            tensor.sparse_csr.CopyFrom(pb().SparseCsr(values=values, crow_indices=_bytes("q", crow),
                                                      col_indices=_bytes("q", cols)))
    if extras.alt_k and extras.alt_tokens is not None:  # PromptAltTokens: dense [len(prompt) - 1, k], int64 and float32
        shape = [len(extras.alt_tokens), extras.alt_k]
        message.prompt_alt_tokens.CopyFrom(pb().PromptAltTokens(
            tokens=pb().Tensor(dense=_bytes("q", [int(t) for row in extras.alt_tokens for t, _ in row]),
                               dtype=pb().DTYPE_INT64, shape=shape),
            logprobs=pb().Tensor(dense=_bytes("f", [float(v) for row in extras.alt_tokens for _, v in row]),
                                 dtype=pb().DTYPE_FLOAT32, shape=shape)))
    return bytes(message.SerializeToString())


def _topk(rows: list[list[list[float]] | None], k: int) -> Any:
    """TopkLogprobs: [length, k] int32 ids and float32 logprobs, most likely first; an empty cell (a position with
    none, or fewer than k) holds the SDK's sentinel (id 0, MASK_LOGPROB)."""
    ids: list[int] = []
    logprobs: list[float] = []
    for row in rows:
        cells = (row or [])[:k]
        ids += [int(t) for t, _ in cells] + [0] * (k - len(cells))
        logprobs += [float(v) for _, v in cells] + [MASK_LOGPROB] * (k - len(cells))
    return pb().TopkLogprobs(token_ids=_bytes("i", ids), logprobs=_bytes("f", logprobs), k=k, length=len(rows))
