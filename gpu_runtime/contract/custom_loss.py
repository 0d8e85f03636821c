"""A server-side custom loss (Tinker's `create_custom_loss`): a torch.fx-traced per-datum loss sent as plain data,
checked here against an allow-list (torch-free, so the server refuses a graph before it leaves and the runtime checks
it again) and rebuilt by gpu_runtime/compute/custom_losses.py from its own table of torch callables.

A graph is nodes in execution order (the SDK's `CustomLossGraph`): placeholders (logprobs, then the loss_fn_inputs it
reads), `call_function` on a listed function, `call_method` on a listed tensor method, and one `output` returning
(loss, {"custom/<name>:sum|mean": tensor}). Nothing else: no attribute access (`builtins.getattr`), no modules, no
captured tensors, no factories that size a tensor from a constant, no in-place methods and no `out=`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from gpu_runtime.contract.checks import is_number
from gpu_runtime.contract.json_types import JSONObject
from gpu_runtime.errors import BadInput

CUSTOM_LOSS_FN = "custom"
MAX_NODES = 256  # a cookbook loss traces to 10-40 nodes
MAX_INPUTS = 16  # logprobs included, as the SDK bounds them
MAX_CONSTANT_ITEMS = 64  # list, tuple and dict items in one node's arguments, nested included
MAX_DEPTH = 4  # nesting of lists, tuples and dicts in an argument
MAX_STRING = 32  # how much of a refused string an error quotes
MAX_INT = 1 << 31
MAX_INPUT_WIDTH = 64  # K of a rank-2 ([T, K]) input, as soft targets' K is bounded
# A node's tensor holds at most this many times the datum's input elements: a cat of 64 items, a broadcast or an
# advanced index past it is refused before it allocates (compute/custom_losses.py checks each node)
MAX_GROWTH = 64
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")

# Elementwise and reducing tensor operations (each also a Tensor method of the same name).
_TENSOR_OPS = (
    "abs", "add", "sub", "mul", "div", "true_divide", "neg", "pow", "exp", "exp2", "expm1", "log", "log1p", "log2",
    "sqrt", "rsqrt", "square", "sign", "sigmoid", "tanh", "relu", "clamp", "clip", "clamp_min", "clamp_max", "where",
    "minimum", "maximum", "min", "max", "amin", "amax", "sum", "mean", "prod", "logsumexp", "cumsum", "std", "var",
    "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "logical_not", "isfinite", "isnan",
    "nan_to_num", "detach", "masked_fill", "softmax", "log_softmax", "squeeze", "gather", "count_nonzero", "floor",
    "ceil", "round",
)
FUNCTIONS: frozenset[str] = frozenset(
    {f"torch.{op}" for op in _TENSOR_OPS}
    | {"torch.stack", "torch.cat", "torch.ones_like", "torch.zeros_like", "torch.full_like"}
    | {f"torch.nn.functional.{op}" for op in ("relu", "softplus", "logsigmoid", "log_softmax", "softmax", "silu")}
    | {f"operator.{op}" for op in ("add", "sub", "mul", "truediv", "floordiv", "neg", "pos", "pow", "abs", "mod",
                                   "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "invert", "getitem")}
)
INDEXING = frozenset({"operator.getitem", "__getitem__"})
METHODS: frozenset[str] = frozenset({*_TENSOR_OPS, "float", "double", "to", "type_as", "size", "numel", "dim",
                                     "__getitem__", "__neg__"})
# No unsqueeze, reshape, view or None index; inputs are scalars, [T] or [T, K]. A broadcast ([T, 1] by [T]), a stack
# or an advanced index can still grow a tensor: the runtime bounds each node's size by MAX_GROWTH.
# Keyword arguments a listed operation may take (never `out`, `device`, `requires_grad`, `memory_format`).
KWARGS: frozenset[str] = frozenset({"dim", "keepdim", "min", "max", "dtype", "alpha", "correction", "unbiased",
                                    "other", "input", "exponent", "rounding_mode", "nan", "posinf", "neginf", "beta",
                                    "threshold", "value", "index", "start_dim", "end_dim", "decimals", "mask"})
DTYPES: frozenset[str] = frozenset({"float32", "float64", "float16", "bfloat16", "int64", "int32", "bool"})
OPS = ("placeholder", "call_function", "call_method", "output")


@dataclass(frozen=True)
class CustomLossNode:
    op: str
    name: str
    target: str
    args: list[Any]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class CustomLoss:
    """A checked graph: its name, its inputs (logprobs first) with their ranks (0 a scalar, 1 [T], 2 [T, K]), and its
    nodes."""

    name: str
    inputs: list[tuple[str, int]]
    nodes: list[CustomLossNode]

    @property
    def input_names(self) -> list[str]:
        """The loss_fn_inputs keys it reads, in the order it takes them (after logprobs)."""
        return [name for name, _ in self.inputs[1:]]

    def to_dict(self) -> JSONObject:
        return {"name": self.name, "inputs": [{"name": n, "rank": r} for n, r in self.inputs],
                "graph": {"format": 1, "nodes": [{"op": n.op, "name": n.name, "target": n.target, "args": n.args,
                                                  "kwargs": n.kwargs} for n in self.nodes]}}


def _fail(message: str, field: str) -> BadInput:
    return BadInput(message, field=field)


def parse_custom_loss(data: Any, field: str = "custom_loss") -> CustomLoss:
    """A graph as the SDK sends it ({name, inputs, graph: {format, nodes}}), checked; BadInput names the node."""
    at = f"{field}." if field else ""  # the app's body holds name, inputs and graph at its top
    if not isinstance(data, dict):
        raise _fail(f"{field or 'the body'} must be an object with name, inputs and graph", field or "body")
    name = data.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _fail(f"{at}name must be a Python identifier of at most 64 characters", f"{at}name")
    inputs = _inputs(data.get("inputs"), f"{at}inputs")
    graph = data.get("graph")
    if not isinstance(graph, dict) or graph.get("format", 1) != 1 or not isinstance(graph.get("nodes"), list):
        raise _fail(f"{at}graph must be {{format: 1, nodes: [...]}}", f"{at}graph")
    raw = graph["nodes"]
    if not 2 <= len(raw) <= MAX_NODES:
        raise _fail(f"{at}graph has {len(raw)} nodes; a custom loss has 2..{MAX_NODES}", f"{at}graph.nodes")
    nodes: list[CustomLossNode] = []
    seen: set[str] = set()
    for i, node in enumerate(raw):
        nodes.append(_node(node, i, seen, inputs, f"{at}graph.nodes[{i}]", last=i == len(raw) - 1))
        seen.add(nodes[-1].name)
    placeholders = [n.target for n in nodes if n.op == "placeholder"]
    if placeholders != [n for n, _ in inputs]:
        raise _fail(f"{at}graph's placeholders {placeholders} must be its inputs {[n for n, _ in inputs]}, "
                    "in order", f"{at}graph.nodes")
    return CustomLoss(name, inputs, nodes)


def _inputs(value: Any, field: str) -> list[tuple[str, int]]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_INPUTS:
        raise _fail(f"{field} must list 1..{MAX_INPUTS} inputs, logprobs first", field)
    inputs: list[tuple[str, int]] = []
    for i, item in enumerate(value):
        name, rank = (item.get("name"), item.get("rank")) if isinstance(item, dict) else (None, None)
        if not isinstance(name, str) or not INPUT_NAME.fullmatch(name) or name in (n for n, _ in inputs):
            raise _fail(f"{field}[{i}].name must be a distinct lowercase identifier", f"{field}[{i}].name")
        if rank not in (0, 1, 2) or isinstance(rank, bool):
            raise _fail(f"{field}[{i}] ({name}) has rank {rank!r}; a custom loss input has rank 0 (a scalar), "
                        "1 ([T]) or 2 ([T, K])", f"{field}[{i}].rank")
        # logprobs are [T, K] only with (T, K) target_tokens, which are cross_entropy's alone here; weights are [T]
        if name in ("logprobs", "weights") and rank != 1:
            raise _fail(f"{field}[{i}] ({name}) has rank {rank}; Signal serves {name} of rank 1 ([T]) to a custom "
                        "loss (docs/LOSSES.md)", f"{field}[{i}].rank")
        inputs.append((name, rank))
    if inputs[0][0] != "logprobs":
        raise _fail(f"{field}[0] must be logprobs", f"{field}[0].name")
    if "target_tokens" in (n for n, _ in inputs[1:]):
        raise _fail(f"{field}: target_tokens are ids, not a loss input; the loss reads their logprobs", field)
    return inputs


def own_input(value: object, n: int, field: str) -> float | list[float] | list[list[float]]:
    """A custom loss's own loss_fn_input as a datum carries it: a number (rank 0; Tinker's wire sends a scalar as
    one value, its empty shape lost), N numbers (rank 1) or N rows of K numbers (rank 2), finite. The loss's declared
    rank picks among them (gpu_runtime/compute/custom_losses.py:check_inputs)."""
    if is_number(value):
        return float(value)  # type: ignore[arg-type]  # is_number narrowed it to a real number
    if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
        width = len(value[0])
        if len(value) != n or not 1 <= width <= MAX_INPUT_WIDTH or any(len(row) != width for row in value):
            raise _fail(f"{field} must be (N, K) with N = len(model_input) ({n}) and K in 1..{MAX_INPUT_WIDTH}, "
                        "every row of K numbers", field)
        if not all(is_number(v) for row in value for v in row):
            raise _fail(f"{field} must hold finite numbers", field)
        return [[float(v) for v in row] for row in value]
    if isinstance(value, list) and len(value) in (1, n) and all(is_number(v) for v in value):
        return [float(v) for v in value] if len(value) == n else float(value[0])
    got = f"{len(value)} values" if isinstance(value, list) else type(value).__name__
    raise _fail(f"{field} must be a number, {n} numbers (one per position) or (N, K) rows of finite numbers, "
                f"got {got}", field)


def _node(node: Any, i: int, seen: set[str], inputs: list[tuple[str, int]], field: str, last: bool) -> CustomLossNode:
    if not isinstance(node, dict):
        raise _fail(f"{field} must be an object {{op, name, target, args, kwargs}}", field)
    op, name, target = node.get("op"), node.get("name"), node.get("target")
    args, kwargs = node.get("args", []), node.get("kwargs", {})
    label = f"node {name!r} ({op} {target!r})"
    if not isinstance(name, str) or not NAME.fullmatch(name) or name in seen:
        raise _fail(f"{field}.name {name!r} must be a distinct identifier", f"{field}.name")
    if not isinstance(target, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise _fail(f"{label}: target must be a string, args a list and kwargs an object", field)
    if op not in OPS:
        why = {"get_attr": "captures a tensor or attribute", "call_module": "calls a module"}.get(str(op), "is unknown")
        raise _fail(f"{label} {why}; a custom loss may only call listed torch functions and tensor methods", field)
    if (op == "output") != last:
        raise _fail(f"{label}: the graph has exactly one output, its last node", field)
    if op == "call_function" and target not in FUNCTIONS:
        raise _fail(f"{label} calls {target!r}, which is not on Signal's list of allowed functions "
                    "(docs/LOSSES.md lists them)", field)
    if op == "call_method" and target not in METHODS:
        raise _fail(f"{label} calls method {target!r}, which is not on Signal's list of allowed tensor methods "
                    "(docs/LOSSES.md lists them)", field)
    if op == "call_method" and not (args and isinstance(args[0], dict) and set(args[0]) == {"ref"}):
        raise _fail(f"{label}: a method is called on a node", field)
    if op == "placeholder" and (args or kwargs):
        raise _fail(f"{label}: a placeholder takes no arguments", field)
    for key in kwargs:
        if key not in KWARGS:
            raise _fail(f"{label} passes keyword {key!r}, which a custom loss may not use", f"{field}.kwargs.{key}")
    if target in INDEXING and len(args) == 2 and _holds_none(args[1]):
        raise _fail(f"{label} indexes with None, which adds a dimension; a custom loss keeps its tensors' rank", field)
    if "rounding_mode" in kwargs and kwargs["rounding_mode"] not in (None, "floor", "trunc"):
        raise _fail(f"{label}: rounding_mode is floor or trunc", f"{field}.kwargs.rounding_mode")
    budget = [MAX_CONSTANT_ITEMS]
    for value in [*args, *kwargs.values()]:
        _arg(value, seen, label, field, budget, 0)
    if op == "output":
        _output(args, label, field)
    return CustomLossNode(op, name, target, list(args), dict(kwargs))


def _arg(value: Any, seen: set[str], label: str, field: str, budget: list[int], depth: int) -> None:
    """An encoded argument (the SDK's forms: scalars, lists and one-key objects), bounded in size and depth."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise _fail(f"{label}: integer constant {value} is out of range", field)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail(f"{label}: a non-finite constant is sent as {{\"float\": ...}}", field)
        return
    if isinstance(value, str):  # only rounding_mode's, checked above; elsewhere a string could name a device
        if value in ("floor", "trunc"):
            return
        raise _fail(f"{label} passes the string {value[:MAX_STRING]!r}, which a custom loss may not use", field)
    if depth >= MAX_DEPTH:
        raise _fail(f"{label}: arguments nest deeper than {MAX_DEPTH}", field)
    items: list[Any]
    if isinstance(value, list):
        items = value
    elif isinstance(value, dict) and len(value) == 1:
        (kind, inner), = value.items()
        if kind == "ref":
            if inner not in seen:
                raise _fail(f"{label} refers to {inner!r}, which is not an earlier node", field)
            return
        if kind == "float" and inner in ("inf", "-inf", "nan"):
            return
        if kind == "dtype" and inner in DTYPES:
            return
        if kind == "ellipsis" and inner is True:
            return
        if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
            items = inner
        elif kind == "tuple" and isinstance(inner, list):
            items = inner
        elif kind == "dict" and isinstance(inner, dict) and all(isinstance(k, str) and len(k) <= 80 for k in inner):
            items = list(inner.values())
        else:
            raise _fail(f"{label} passes a {kind!r} argument, which a custom loss may not use", field)
    else:
        raise _fail(f"{label} passes an argument Signal cannot read: {type(value).__name__}", field)
    budget[0] -= len(items)
    if budget[0] < 0:
        raise _fail(f"{label}: more than {MAX_CONSTANT_ITEMS} constant items in its arguments", field)
    for item in items:
        _arg(item, seen, label, field, budget, depth + 1)


def _holds_none(index: Any) -> bool:
    if index is None:
        return True
    inner = index.get("tuple") if isinstance(index, dict) else index
    return isinstance(inner, list) and any(item is None for item in inner)


def _output(args: list[Any], label: str, field: str) -> None:
    result = args[0] if len(args) == 1 else None
    pair = result.get("tuple") if isinstance(result, dict) else result
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict) and "ref" in pair[0]):
        raise _fail(f"{label} must return (loss, metrics) with the loss a tensor", field)
    metrics = pair[1].get("dict") if isinstance(pair[1], dict) else None
    if not isinstance(metrics, dict):
        raise _fail(f"{label} must return its metrics as a dict", field)
    for key, value in metrics.items():
        if not METRIC_KEY.fullmatch(key) or not (isinstance(value, dict) and "ref" in value):
            raise _fail(f"{label}: metric {key!r} must be named custom/<name>:sum or :mean and be a tensor", field)
