"""The GraphQL schema, with its limits and error presentation. `graphql/schema.graphql` is its SDL."""

from __future__ import annotations

import strawberry
from strawberry.extensions import MaxAliasesLimiter, MaxTokensLimiter, QueryDepthLimiter

from app.schema.coercion import FieldNamingExecutionContext
from app.schema.errors import SignalErrors
from app.schema.limits import PrimitivesLimiter
from app.schema.mutation import Mutation
from app.schema.query import Query
from app.schema.subscription import Subscription

MAX_DEPTH = 8
MAX_ALIASES = 20
MAX_TOKENS = 20_000  # a forward_backward with inline batch text is one long document

class SignalSchema(strawberry.Schema):
    def process_errors(self, errors, execution_context=None) -> None:  # type: ignore[no-untyped-def]  # strawberry's own signature, untyped there
        # SignalErrors already logged the internal ones; typed errors are the client's, not ours to log.
        return None


schema = SignalSchema(
    query=Query,
    mutation=Mutation,
    subscription=Subscription,
    extensions=[
        lambda: QueryDepthLimiter(max_depth=MAX_DEPTH),
        lambda: MaxAliasesLimiter(max_alias_count=MAX_ALIASES),
        lambda: MaxTokensLimiter(max_token_count=MAX_TOKENS),
        PrimitivesLimiter,
        SignalErrors,
    ],
    execution_context_class=FieldNamingExecutionContext,
)
