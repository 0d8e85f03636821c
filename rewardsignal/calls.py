"""A client method as data: the GraphQL operation, its variables, the answer's field and how to wrap it; and how a
method's arguments become those variables (unset settings left out, batch items in GraphQL's camelCase)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

# A batch item in one of GraphQL BatchItem's shapes (text; input and output; messages; tokens and weights; a Tinker
# datum {model_input, loss_fn_inputs}; pack_datum's {packed}), or a Datum that render_datums answered. A Mapping:
# callers pass dicts, Datums and TypedDicts alike, and the SDK only renames its keys.
BatchItem = Mapping[str, object]
# A loss's settings (contract: each value a finite number), e.g. {"clip_low_threshold": 0.8} for ppo or {"beta": 0.05}.
LossFnConfig = Mapping[str, float]


@dataclass
class Call:
    operation: str
    variables: dict[str, Any]  # GraphQL variables: JSON, checked against the schema by the server
    field: str
    wrap: Callable[[Any], Any] | None = None
    retry: bool = False  # safe to send again: it carries a requestId


def primitive(operation: str, variables: dict[str, Any], field: str) -> Call:
    """A training primitive, with the idempotency id that makes retrying it safe."""
    return Call(operation, {**variables, "requestId": str(uuid.uuid4())}, field, retry=True)


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def graphql_batch(batch: Sequence[BatchItem]) -> list[object]:
    """Items as GraphQL's BatchItem: Tinker's datum keys (model_input, loss_fn_inputs.target_tokens, …) in camelCase;
    Signal's own keys are single words already."""
    def item(value: dict[str, object]) -> dict[str, object]:
        out = {camel(k): v for k, v in value.items()}
        for nested in ("lossFnInputs", "packed"):
            inner = out.get(nested)
            if isinstance(inner, dict):
                out[nested] = {camel(k): v for k, v in inner.items()}
        return out

    return [item(value) if isinstance(value, dict) else value for value in batch]


Message = dict[str, str]  # {"role": …, "content": …}


def conversations(messages: Sequence[Message] | Sequence[Sequence[Message]] | None) -> list[list[Message]] | None:
    """`sample`'s chat prompts: one conversation (a list of messages) or several, as the server takes them."""
    if messages is None:
        return None
    if messages and isinstance(messages[0], Mapping):
        return [[dict(cast(Message, m)) for m in messages]]  # one conversation: its items are messages
    return [[dict(m) for m in conversation] for conversation in cast(Sequence[Sequence[Message]], messages)]


def enum_value(value: str | None) -> str | None:
    """The SDK's spelling of a loss or a reduction (`cross_entropy`, `sum`, as Tinker's) as GraphQL's enum value
    (`CROSS_ENTROPY`, `SUM`)."""
    return value.upper() if isinstance(value, str) else value


def drop_none(values: dict[str, Any]) -> dict[str, Any]:
    """GraphQL variables without the settings left unset, so that the server's defaults apply."""
    return {key: value for key, value in values.items() if value is not None}
