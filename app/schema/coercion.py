"""Variables that do not coerce name their field in the API's spelling (issue 19 §7).

graphql-core says where a variable's value is wrong only in its message ("Variable '$p' has invalid value at [1]:
…"). When it refuses the variables, this execution context coerces them again itself, collecting each error with its
path, and names the field by where the operation uses the variable: `$p` at [1], passed as `sample(prompts: $p)`, is
`prompts[1]`. Requests whose variables coerce pay nothing: the second pass runs only on the refusal's path.
"""

from __future__ import annotations

from typing import Any

from graphql.execution.get_variable_signature import get_variable_signature
from graphql.pyutils import print_path_list
from graphql.utilities.validate_input_value import validate_input_value
from strawberry.schema.schema import StrawberryGraphQLCoreExecutionContext

from app.errors import BadInput
from app.schema.selections import fragments_of, selected_fields
from graphql import (
    DocumentNode,
    GraphQLError,
    GraphQLSchema,
    ListValueNode,
    ObjectValueNode,
    OperationDefinitionNode,
    Undefined,
    ValueNode,
    VariableNode,
    is_non_null_type,
)

MAX_ERRORS = 50  # graphql-core's own cap on coercion errors per request


class FieldNamingExecutionContext(StrawberryGraphQLCoreExecutionContext):
    @classmethod
    def build(cls, schema: GraphQLSchema, document: DocumentNode, root_value: Any = None,
              context_value: Any = None, raw_variable_values: dict[str, Any] | None = None,
              operation_name: str | None = None, *args: Any, **kwargs: Any) -> Any:
        built = super().build(schema, document, root_value, context_value, raw_variable_values, operation_name,
                              *args, **kwargs)
        if not isinstance(built, list):
            return built
        operation = _operation(document, operation_name)
        if operation is None:
            return built
        named = coercion_errors(schema, document, operation, raw_variable_values or {},
                                bool(kwargs.get("hide_suggestions", False)))
        return named or built  # not a coercion error (no operation, a bad fragment signature): graphql-core's own


def coercion_errors(schema: GraphQLSchema, document: DocumentNode, operation: OperationDefinitionNode,
                    inputs: dict[str, Any], hide_suggestions: bool = False) -> list[GraphQLError]:
    """Each variable's coercion errors, as BadInput naming the field where the operation uses it."""
    errors: list[GraphQLError] = []
    for definition in operation.variable_definitions or ():
        signature = get_variable_signature(schema, definition)
        if isinstance(signature, GraphQLError):
            continue
        name = signature.name
        value = inputs.get(name, Undefined)
        if value is Undefined and (definition.default_value is not None or not is_non_null_type(signature.type)):
            continue
        where = _use_of(name, document, operation)

        def report(error: GraphQLError, path: list[str | int], name: str = name, where: str = where,
                   definition: Any = definition) -> None:
            message = f"Variable '${name}' has invalid value{print_path_list(path)}: {error.message}"
            refusal = BadInput(message, field=where + "".join(f"[{p}]" if isinstance(p, int) else f".{p}"
                                                                for p in path))
            errors.append(GraphQLError(refusal.message, definition, original_error=refusal))

        validate_input_value(value, signature.type, report, hide_suggestions)
        if len(errors) >= MAX_ERRORS:
            break
    return errors[:MAX_ERRORS]


def _operation(document: DocumentNode, name: str | None) -> OperationDefinitionNode | None:
    operations = [d for d in document.definitions if isinstance(d, OperationDefinitionNode)]
    if name is None:
        return operations[0] if len(operations) == 1 else None
    return next((o for o in operations if o.name is not None and o.name.value == name), None)


def _use_of(variable: str, document: DocumentNode, operation: OperationDefinitionNode) -> str:
    """Where the operation first passes `$variable`, as an argument path (`prompts`, `input.baseModel`); a variable
    passed nowhere (validation refuses those) is named as the request's `variables.NAME`."""
    fields = selected_fields(operation.selection_set, fragments_of(document), nested=True)
    for argument in (argument for field in fields for argument in field.arguments or ()):
        found = _in_value(variable, argument.value, argument.name.value)
        if found is not None:
            return found
    return f"variables.{variable}"


def _in_value(variable: str, value: ValueNode, path: str) -> str | None:
    if isinstance(value, VariableNode):
        return path if value.name.value == variable else None
    if isinstance(value, ObjectValueNode):
        for field in value.fields:
            found = _in_value(variable, field.value, f"{path}.{field.name.value}")
            if found is not None:
                return found
    if isinstance(value, ListValueNode):
        for index, item in enumerate(value.values):
            found = _in_value(variable, item, f"{path}[{index}]")
            if found is not None:
                return found
    return None
