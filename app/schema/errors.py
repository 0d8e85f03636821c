"""Turns errors into what clients see: our typed errors keep their message and gain
`extensions.code` (and `field`); anything else is masked as INTERNAL and logged."""

from __future__ import annotations

import logging

from graphql.error import GraphQLError
from strawberry.extensions import MaskErrors
from strawberry.utils.str_converters import to_camel_case

from app.db import database_error
from app.errors import BadInput, InternalError, InvalidDocument, SignalError
from gpu_runtime.contract.json_types import JSONObject

log = logging.getLogger("signal.graphql")

INTERNAL_MESSAGE = "Internal server error."


class SignalErrors(MaskErrors):
    def __init__(self) -> None:
        super().__init__(error_message=INTERNAL_MESSAGE)

    def _process_errors(self, errors: list[GraphQLError]) -> list[GraphQLError]:
        return [_present(error) for error in errors]


def extensions_of(error: SignalError) -> JSONObject:
    """`code`, `retryable`, `field` when it names one, and the error's details in GraphQL's case (retryAfterS)."""
    extensions: JSONObject = {"code": error.code, "retryable": error.retryable}
    if error.field:
        extensions["field"] = error.field
    return extensions | {to_camel_case(key): value for key, value in error.details.items()}


def _present(error: GraphQLError) -> GraphQLError:
    original = error.original_error
    if original is not None and not isinstance(original, SignalError):
        original = database_error(original) or original  # a locked or full database is not our bug
    if isinstance(original, SignalError) and not isinstance(original, InternalError):
        if original is not error.original_error:
            log.warning("database error in %s: %s", error.path, error.original_error)
        return _with_extensions(error, original.message, extensions_of(original))
    if original is None:
        # Parse and validation errors: the client's document is wrong, and the message says where.
        return _with_extensions(error, error.message, {"code": InvalidDocument.code, "retryable": False,
                                                       **(error.extensions or {})})
    if isinstance(original, GraphQLError) and original.original_error is None and not error.path:
        # Variable coercion errors (wrong type, unknown batch key) arrive wrapped this way, with no path;
        # one with a path is our output failing to serialise, which is ours to fix.
        return _with_extensions(error, error.message, {"code": BadInput.code, "retryable": False})
    log.error("internal error in %s", error.path, exc_info=original)
    return _with_extensions(error, INTERNAL_MESSAGE, {"code": InternalError.code, "retryable": False},
                            keep_original=False)


def _with_extensions(error: GraphQLError, message: str, extensions: JSONObject, keep_original: bool = True) -> GraphQLError:
    return GraphQLError(
        message=message, nodes=error.nodes, source=error.source, positions=error.positions, path=error.path,
        original_error=error.original_error if keep_original else None, extensions=extensions,
    )
