"""How many primitives one GraphQL request may carry: mutations run in series, so twenty aliased ones held one POST
for a minute (issue 19). Past SIGNAL_MAX_PRIMITIVES_PER_REQUEST the document fails validation, before any runs, as
BAD_INPUT naming the first field past the bound by its response key (its alias, else its name)."""

from __future__ import annotations

from collections.abc import Iterator

from strawberry.extensions import SchemaExtension

from app.errors import BadInput
from app.schema.selections import fragments_of, selected_fields
from app.settings import Settings
from gpu_runtime.contract import CALLS
from graphql import (
    FieldNode,
    GraphQLError,
    OperationDefinitionNode,
    OperationType,
    ValidationContext,
    ValidationRule,
)


def _camel(method: str) -> str:
    head, *rest = method.split("_")
    return head + "".join(word.title() for word in rest)


# Mutations that reach the runtime: each can hold it for seconds (the contract's `Kind.primitive`, by its GraphQL
# name; tests/faults/test_bounds.py checks each is a field).
PRIMITIVES = frozenset(_camel(method) for method, call in CALLS.items() if call.kind.primitive)
DEFAULT_MOST: int = Settings.model_fields["max_primitives_per_request"].default  # for schemas run without a Context


class PrimitivesLimiter(SchemaExtension):
    """Adds the rule with the server's bound (the request's context carries the settings)."""

    def on_operation(self) -> Iterator[None]:
        context = self.execution_context.context
        settings = getattr(getattr(context, "services", None), "settings", None)
        most = settings.max_primitives_per_request if isinstance(settings, Settings) else DEFAULT_MOST
        self.execution_context.validation_rules = (*self.execution_context.validation_rules, primitives_rule(most))
        yield


def primitives_rule(most: int) -> type[ValidationRule]:
    class MaxPrimitives(ValidationRule):
        def __init__(self, context: ValidationContext) -> None:
            super().__init__(context)
            fragments = fragments_of(context.document)
            for operation in context.document.definitions:
                if not isinstance(operation, OperationDefinitionNode) or operation.operation != OperationType.MUTATION:
                    continue
                # One per response key: fields sharing a key merge into one execution.
                keyed: dict[str, FieldNode] = {}
                for node in selected_fields(operation.selection_set, fragments):
                    keyed.setdefault((node.alias or node.name).value, node)
                found = [node for node in keyed.values() if node.name.value in PRIMITIVES]
                if len(found) > most:
                    extra = found[most]
                    key = (extra.alias or extra.name).value
                    error = BadInput(f"this request carries {len(found)} primitive calls; one request may carry at "
                                     f"most {most} (send the others in requests of their own)", field=key)
                    context.report_error(GraphQLError(error.message, nodes=[extra], original_error=error))

    return MaxPrimitives


