"""The fields a GraphQL operation selects, through inline fragments and fragment spreads: what the request-shape
rules (limits.py: primitives per request; coercion.py: where a variable is used) walk."""

from __future__ import annotations

from collections.abc import Iterator

from graphql import (
    DocumentNode,
    FieldNode,
    FragmentDefinitionNode,
    FragmentSpreadNode,
    InlineFragmentNode,
    SelectionSetNode,
)


def fragments_of(document: DocumentNode) -> dict[str, FragmentDefinitionNode]:
    return {d.name.value: d for d in document.definitions if isinstance(d, FragmentDefinitionNode)}


def selected_fields(selections: SelectionSetNode | None, fragments: dict[str, FragmentDefinitionNode],
                    nested: bool = False, seen: set[str] | None = None) -> Iterator[FieldNode]:
    """The fields in document order, each fragment spread walked once (cycles are another rule's); `nested`: each
    field's own sub-selections too, depth first, else the root fields only."""
    seen = set() if seen is None else seen
    for selection in selections.selections if selections is not None else ():
        if isinstance(selection, FieldNode):
            yield selection
            if nested:
                yield from selected_fields(selection.selection_set, fragments, nested, seen)
        elif isinstance(selection, InlineFragmentNode):
            yield from selected_fields(selection.selection_set, fragments, nested, seen)
        elif isinstance(selection, FragmentSpreadNode) and selection.name.value not in seen:
            seen.add(selection.name.value)
            fragment = fragments.get(selection.name.value)
            if fragment is not None:
                yield from selected_fields(fragment.selection_set, fragments, nested, seen)
