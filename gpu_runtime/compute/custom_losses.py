"""A custom loss (gpu_runtime/contract/custom_loss.py) run per datum inside the pass: the checked graph interpreted
node by node, each operation taken from this module's own table of torch callables by the name the graph gives:
never eval, never pickle, never getattr on a name the graph holds."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gpu_runtime.compute.batches import Collated, Datum
from gpu_runtime.contract.custom_loss import FUNCTIONS, INDEXING, MAX_GROWTH, METHODS, CustomLoss, CustomLossNode
from gpu_runtime.errors import BadInput

_T = torch.Tensor
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "torch.abs": torch.abs, "torch.add": torch.add, "torch.sub": torch.sub, "torch.mul": torch.mul,
    "torch.div": torch.div, "torch.true_divide": torch.true_divide, "torch.neg": torch.neg, "torch.pow": torch.pow,
    "torch.exp": torch.exp, "torch.exp2": torch.exp2, "torch.expm1": torch.expm1, "torch.log": torch.log,
    "torch.log1p": torch.log1p, "torch.log2": torch.log2, "torch.sqrt": torch.sqrt, "torch.rsqrt": torch.rsqrt,
    "torch.square": torch.square, "torch.sign": torch.sign, "torch.sigmoid": torch.sigmoid, "torch.tanh": torch.tanh,
    "torch.relu": torch.relu, "torch.clamp": torch.clamp, "torch.clip": torch.clip, "torch.clamp_min": torch.clamp_min,
    "torch.clamp_max": torch.clamp_max, "torch.where": torch.where, "torch.minimum": torch.minimum,
    "torch.maximum": torch.maximum, "torch.min": torch.min, "torch.max": torch.max, "torch.amin": torch.amin,
    "torch.amax": torch.amax, "torch.sum": torch.sum, "torch.mean": torch.mean, "torch.prod": torch.prod,
    "torch.logsumexp": torch.logsumexp, "torch.cumsum": torch.cumsum, "torch.std": torch.std, "torch.var": torch.var,
    "torch.lt": torch.lt, "torch.le": torch.le, "torch.gt": torch.gt, "torch.ge": torch.ge, "torch.eq": torch.eq,
    "torch.ne": torch.ne, "torch.logical_and": torch.logical_and, "torch.logical_or": torch.logical_or,
    "torch.logical_not": torch.logical_not, "torch.isfinite": torch.isfinite, "torch.isnan": torch.isnan,
    "torch.nan_to_num": torch.nan_to_num, "torch.detach": torch.detach, "torch.masked_fill": torch.masked_fill,
    "torch.softmax": torch.softmax, "torch.log_softmax": torch.log_softmax, "torch.squeeze": torch.squeeze,
    "torch.gather": torch.gather, "torch.count_nonzero": torch.count_nonzero,
    "torch.floor": torch.floor, "torch.ceil": torch.ceil, "torch.round": torch.round,
    "torch.stack": torch.stack, "torch.cat": torch.cat, "torch.ones_like": torch.ones_like,
    "torch.zeros_like": torch.zeros_like, "torch.full_like": torch.full_like,
    "torch.nn.functional.relu": F.relu, "torch.nn.functional.softplus": F.softplus,
    "torch.nn.functional.logsigmoid": F.logsigmoid, "torch.nn.functional.log_softmax": F.log_softmax,
    "torch.nn.functional.softmax": F.softmax, "torch.nn.functional.silu": F.silu,
    "operator.add": operator.add, "operator.sub": operator.sub, "operator.mul": operator.mul,
    "operator.truediv": operator.truediv, "operator.floordiv": operator.floordiv, "operator.neg": operator.neg,
    "operator.pos": operator.pos, "operator.pow": operator.pow, "operator.abs": operator.abs,
    "operator.mod": operator.mod, "operator.lt": operator.lt, "operator.le": operator.le, "operator.gt": operator.gt,
    "operator.ge": operator.ge, "operator.eq": operator.eq, "operator.ne": operator.ne, "operator.and_": operator.and_,
    "operator.or_": operator.or_, "operator.invert": operator.invert, "operator.getitem": operator.getitem,
}
_METHODS: dict[str, Callable[..., Any]] = {
    "abs": _T.abs, "add": _T.add, "sub": _T.sub, "mul": _T.mul, "div": _T.div, "true_divide": _T.true_divide,
    "neg": _T.neg, "pow": _T.pow, "exp": _T.exp, "exp2": _T.exp2, "expm1": _T.expm1, "log": _T.log,
    "log1p": _T.log1p, "log2": _T.log2, "sqrt": _T.sqrt, "rsqrt": _T.rsqrt, "square": _T.square, "sign": _T.sign,
    "sigmoid": _T.sigmoid, "tanh": _T.tanh, "relu": _T.relu, "clamp": _T.clamp, "clip": _T.clip,
    "clamp_min": _T.clamp_min, "clamp_max": _T.clamp_max, "where": _T.where, "minimum": _T.minimum,
    "maximum": _T.maximum, "min": _T.min, "max": _T.max, "amin": _T.amin, "amax": _T.amax, "sum": _T.sum,
    "mean": _T.mean, "prod": _T.prod, "logsumexp": _T.logsumexp, "cumsum": _T.cumsum, "std": _T.std, "var": _T.var,
    "lt": _T.lt, "le": _T.le, "gt": _T.gt, "ge": _T.ge, "eq": _T.eq, "ne": _T.ne, "logical_and": _T.logical_and,
    "logical_or": _T.logical_or, "logical_not": _T.logical_not, "isfinite": _T.isfinite, "isnan": _T.isnan,
    "nan_to_num": _T.nan_to_num, "detach": _T.detach, "masked_fill": _T.masked_fill, "softmax": _T.softmax,
    "log_softmax": _T.log_softmax, "squeeze": _T.squeeze, "gather": _T.gather,
    "count_nonzero": _T.count_nonzero, "floor": _T.floor, "ceil": _T.ceil, "round": _T.round, "float": _T.float,
    "double": _T.double, "to": _T.to, "type_as": _T.type_as, "size": _T.size, "numel": _T.numel, "dim": _T.dim,
    "__getitem__": _T.__getitem__, "__neg__": _T.__neg__,
}
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}
_FLOATS = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
assert set(_FUNCTIONS) == FUNCTIONS and set(_METHODS) == METHODS, "the contract's allow-list is this table's keys"


def custom_loss(logprobs: torch.Tensor, batch: Collated, loss: CustomLoss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The elementwise loss [B, T] (each datum's scalar at its first position, so its sum is the sum of the datums'
    losses) and each metric summed over the datums (the engine divides `:mean` ones by the call's datum count, as the
    SDK's client-side `run_loss_handle` does)."""
    losses: list[torch.Tensor] = []
    sums: dict[str, torch.Tensor] = {}
    for row, n in enumerate(batch.lengths):
        inputs = [logprobs[row, :n]] + [_input(batch, name, rank, row, n, logprobs) for name, rank in loss.inputs[1:]]
        value, metrics = run_graph(loss, inputs)
        losses.append(value)
        for key, metric in metrics.items():
            sums[key] = metric if key not in sums else sums[key] + metric
    column = torch.stack(losses).to(logprobs.dtype)[:, None]
    elementwise = torch.cat([column, torch.zeros_like(logprobs[:, 1:])], dim=1)
    return elementwise, {k: v.detach().float() for k, v in sums.items()}


def _input(batch: Collated, name: str, rank: int, row: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """A datum's input at its declared rank: [] a scalar, [n] per position, [n, K] (check_inputs matched them)."""
    if batch.shaped and name in batch.shaped[row]:
        return batch.shaped[row][name].to(like.dtype)
    source = batch.weights if name == "weights" else batch.extras[name]
    value = source[row, :n].to(like.dtype)
    return value.reshape(()) if rank == 0 else value  # a one-position datum's scalar came as one value


def check_inputs(loss: CustomLoss, datums: list[Datum], where: str = "batch") -> None:
    """Every datum has each input the loss reads (weights included: a datum without them weighs 1 nowhere), at the
    rank the loss declares, as the SDK's check_loss_inputs requires before it sends them."""
    for i, datum in enumerate(datums):
        for name, rank in loss.inputs[1:]:
            at = f"{where}[{i}].loss_fn_inputs.{name}"
            if name == "weights" or name in datum.inputs:
                if name == "weights" and datum.weights is None:
                    raise BadInput(f"{where}[{i}] has no loss_fn_inputs.weights, which custom loss {loss.name!r} takes",
                                   field=at)
                got = 0 if rank == 0 and datum.length == 1 else 1  # one value for one position: either rank
            elif name in datum.shaped:
                got = 0 if isinstance(datum.shaped[name], float) else 2
            else:
                raise BadInput(f"{where}[{i}] has no loss_fn_inputs.{name}, which custom loss {loss.name!r} takes",
                               field=at)
            if got != rank:
                raise BadInput(f"{at} has rank {got}, but custom loss {loss.name!r} declares {name} with rank {rank}",
                               field=at)


def run_graph(loss: CustomLoss, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One datum's (loss, metrics); an operation that fails, or a loss that is not a scalar tensor, is BadInput
    naming the node."""
    env: dict[str, object] = {}  # each node's value by its name
    placeholders = iter(inputs)
    limit = MAX_GROWTH * sum(t.numel() for t in inputs)
    for node in loss.nodes:
        if node.op == "placeholder":
            env[node.name] = next(placeholders)
            continue
        args = [_value(a, env) for a in node.args]
        kwargs = {k: _value(v, env) for k, v in node.kwargs.items()}
        if node.op == "output":
            value, metrics = args[0]
            if not isinstance(value, torch.Tensor) or value.ndim != 0:
                raise BadInput(f"custom loss {loss.name!r} must return a scalar tensor loss, got "
                               f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}",
                               field="loss_fn_config.loss_id")
            for key, metric in metrics.items():
                if not isinstance(metric, torch.Tensor) or metric.numel() != 1:
                    raise BadInput(f"custom loss {loss.name!r}: metric {key!r} must be a scalar tensor",
                                   field="loss_fn_config.loss_id")
            return value, {k: m.reshape(()) for k, m in metrics.items()}
        env[node.name] = _call(loss, node, args, kwargs, limit)
    raise AssertionError("a checked graph ends with its output")


def _call(loss: CustomLoss, node: CustomLossNode, args: list[Any], kwargs: dict[str, object], limit: int) -> Any:
    fn = _FUNCTIONS[node.target] if node.op == "call_function" else _METHODS[node.target]
    # Python's own arithmetic on two Python numbers could be 2 ** 2**31: an operator takes a tensor operand
    if node.target.startswith("operator.") and node.target != "operator.getitem" and \
            not any(isinstance(a, torch.Tensor) for a in args):
        raise BadInput(f"custom loss {loss.name!r}: node {node.name!r} ({node.target}) has no tensor operand",
                       field="loss_fn_config.loss_id")
    try:
        planned = _planned(node, fn, args, kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
        planned = 0  # the operation itself names what is wrong
    _bound(loss, node, limit, planned)
    try:
        result = fn(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError, NotImplementedError) as exc:
        raise BadInput(f"custom loss {loss.name!r}: node {node.name!r} ({node.target}) failed: {exc}",
                       field="loss_fn_config.loss_id") from None
    made = result if isinstance(result, tuple) else (result,)  # torch.max(x, dim) answers (values, indices)
    _bound(loss, node, limit, max((t.numel() for t in made if isinstance(t, torch.Tensor)), default=0))
    return result


def _planned(node: CustomLossNode, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, object]) -> int:
    """The elements a node would make where it can outgrow its operands, known before it allocates: an integer index
    (run on meta tensors) or several tensors broadcast together (a stack or cat grows by its items, checked after)."""
    tensors = [t for t in _leaves([args, kwargs]) if isinstance(t, torch.Tensor)]
    if node.target in INDEXING and len(args) == 2:
        index = [t for t in _leaves(args[1]) if isinstance(t, torch.Tensor)]
        if index and not any(t.dtype == torch.bool for t in index):  # a mask selects fewer, never more
            out = fn(*_meta(args), **_meta(kwargs))
            return int(out.numel()) if isinstance(out, torch.Tensor) else 0
        return 0
    if len(tensors) < 2 or node.target in ("torch.stack", "torch.cat"):
        return 0
    try:
        return math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except RuntimeError:
        return 0  # not broadcastable: the operation names its own error


def _bound(loss: CustomLoss, node: CustomLossNode, limit: int, elements: int) -> None:
    if elements > limit:
        raise BadInput(f"custom loss {loss.name!r}: node {node.name!r} ({node.target}) makes a tensor of {elements} "
                       f"elements; a node holds at most {MAX_GROWTH}x its datum's input elements ({limit})",
                       field="loss_fn_config.loss_id")


def _leaves(value: object) -> list[object]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return [value]


def _meta(value: Any) -> Any:
    """The arguments with every tensor on the meta device: shapes without storage."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, list):
        return [_meta(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    return value


def _value(arg: object, env: dict[str, object]) -> Any:
    """An encoded argument as a Python value; references resolve to earlier nodes' values."""
    if isinstance(arg, list):
        return [_value(a, env) for a in arg]
    if not isinstance(arg, dict):
        return arg
    (kind, inner), = arg.items()
    if kind == "ref":
        return env[inner]
    if kind == "tuple":
        return tuple(_value(a, env) for a in inner)
    if kind == "dict":
        return {k: _value(v, env) for k, v in inner.items()}
    if kind == "slice":
        return slice(*(_value(a, env) for a in inner))
    if kind == "float":
        return _FLOATS[inner]
    if kind == "dtype":
        return _DTYPES[inner]
    return Ellipsis  # {"ellipsis": true}, the one other form the contract lets through
