"""GraphQL against the engine contract: a field added to one and not the other fails here, and every default
the API and the SDK's operation documents state is the contract's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from strawberry.utils.str_converters import to_camel_case

from app.schema import schema
from gpu_runtime import contract
from graphql import GraphQLInputObjectType, GraphQLObjectType, OperationDefinitionNode, parse, value_from_ast_untyped

OPERATIONS = Path(__file__).resolve().parents[2] / "graphql" / "operations"
SDL = schema._schema  # graphql-core's schema, which strawberry builds

# Request fields the GraphQL mutation does not take as an argument of the same name, and why.
NOT_ARGUMENTS: dict[str, str] = {
    "user_id": "the caller's key decides it",
    "run_id": "runId",  # present, camel-cased: checked below
    "return_outputs": "the resolver sets it when the client selects forwardBackward's `outputs`",
}
# Arguments of every primitive that the runtime never sees: the server orders calls by them (docs/ORDERING.md).
ORDERING_ARGUMENTS = ("seq", "session")
MUTATIONS: list[tuple[str, type[contract.Call]]] = [
    ("forwardBackward", contract.ForwardBackward),
    ("forward", contract.Forward),
    ("optimStep", contract.OptimStep),
    ("sample", contract.Sample),
    ("saveState", contract.SaveState),
    ("saveWeightsForSampler", contract.SaveWeightsForSampler),
    ("loadState", contract.LoadState),
]
# Arguments GraphQL takes that the runtime's request does not, and why.
GRAPHQL_ONLY: dict[str, str] = {
    "hfToken": "fetched by the server and passed to that one upload",
    "stopTokens": "GraphQL lists are typed: stop token ids arrive apart from stop strings, and join `stop`",
    "store": "whether the server writes sample rows; the runtime keeps none",
}
# Result fields GraphQL does not show, and why.
NOT_SHOWN: dict[str, str] = {
    "compute_seconds": "billed (a run's cost), not part of one call's answer",
    "replayed": "a retry's answer is the first answer; the API does not tell them apart",
    "size_bytes": "a checkpoint's size is sizeBytes on the Checkpoint row",
    "checkpoint_path": "a checkpoint row's path",
    "hub": "a checkpoint row's hubUrl",
}
RESULTS: list[tuple[str, type[contract.Result]]] = [
    ("ForwardBackwardResult", contract.ForwardBackwardResult),
    ("ForwardResult", contract.ForwardResult),
    ("OptimStepResult", contract.OptimStepResult),
    ("SampleResult", contract.SampleResult),
    ("LoadStateResult", contract.LoadStateResult),
]


@pytest.mark.parametrize(("mutation", "call"), MUTATIONS, ids=[m for m, _ in MUTATIONS])
def test_each_primitive_takes_the_contracts_arguments_with_its_defaults(mutation: str, call: type[contract.Call]) -> None:
    arguments = SDL.mutation_type.fields[mutation].args
    for field in dataclasses.fields(call):
        if field.name in NOT_ARGUMENTS and field.name != "run_id":
            continue
        name = to_camel_case(field.name)
        assert name in arguments, f"{mutation} lacks {name} (contract {call.__name__}.{field.name})"
        if field.default is not dataclasses.MISSING and field.name not in ("loss_fn_config", "adam"):
            default = arguments[name].default_value
            default = getattr(default, "value", default)  # an enum's default (SaveMode.ADAPTER)
            assert default == field.default, f"{mutation}.{name} defaults to {default!r}, the contract to {field.default!r}"
    assert set(ORDERING_ARGUMENTS) <= set(arguments), f"{mutation} lacks the SDK's ordering arguments"
    known = {to_camel_case(f.name) for f in dataclasses.fields(call)} | set(GRAPHQL_ONLY) | set(ORDERING_ARGUMENTS)
    assert set(arguments) - known == set(), f"{mutation} takes arguments the contract does not know"


@pytest.mark.parametrize(("type_name", "result"), RESULTS, ids=[t for t, _ in RESULTS])
def test_each_result_type_shows_the_contracts_fields(type_name: str, result: type[contract.Result]) -> None:
    shown = SDL.get_type(type_name)
    assert isinstance(shown, GraphQLObjectType)
    fields = {f.name for f in dataclasses.fields(result)}
    for name in fields - set(NOT_SHOWN):
        assert to_camel_case(name) in shown.fields, f"{type_name} lacks {to_camel_case(name)} (contract {result.__name__})"
    assert {f for f in shown.fields} <= {to_camel_case(n) for n in fields}, f"{type_name} shows what the contract lacks"


def test_a_batch_item_takes_exactly_the_contracts_keys() -> None:
    item = SDL.get_type("BatchItem")
    assert isinstance(item, GraphQLInputObjectType)
    assert set(item.fields) == {to_camel_case(key) for key in contract.ITEM_KEYS}  # modelInput: model_input


def _variable_defaults() -> list[tuple[str, str, str, Any]]:
    """(document, operation field, argument, default) for each variable with a default passed to an argument."""
    found = []
    for path in sorted(OPERATIONS.glob("*.graphql")):
        for definition in parse(path.read_text()).definitions:
            if not isinstance(definition, OperationDefinitionNode) or definition.operation.value != "mutation":
                continue
            defaults = {v.variable.name.value: value_from_ast_untyped(v.default_value)
                        for v in definition.variable_definitions if v.default_value is not None}
            for selection in definition.selection_set.selections:
                for argument in getattr(selection, "arguments", []):
                    variable = getattr(argument.value, "name", None)
                    if variable is not None and variable.value in defaults:
                        found.append((path.name, selection.name.value, argument.name.value, defaults[variable.value]))
    return found


@pytest.mark.parametrize(("document", "field", "argument", "default"), _variable_defaults())
def test_operation_documents_default_to_what_the_schema_does(document: str, field: str, argument: str, default: Any) -> None:
    schema_default = SDL.mutation_type.fields[field].args[argument].default_value
    schema_default = getattr(schema_default, "value", schema_default)
    if isinstance(default, str) and hasattr(schema_default, "upper"):
        default = default.lower() if default.isupper() else default  # an enum literal (ADAPTER) against its value
    assert default == schema_default, f"{document}: ${argument} defaults to {default!r}, the API to {schema_default!r}"
