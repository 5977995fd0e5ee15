"""BSON nesting limits, checked without recursion (``bson_depth.h``).

mongod rejects a message holding a document nested deeper than
``maxBSONDepth`` (200) with Overflow (15) while validating it, and refuses to
store a document nested deeper than that minus 20 (180 levels). The walk here
is iterative, so a document nested far deeper than Python's recursion limit is
measured like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from bson.objectid import ObjectId

MAX_BSON_DEPTH = 200
"""``BSONDepth::kDefaultMaxAllowableDepth``: levels below the root a message may hold."""
MAX_USER_STORAGE_DEPTH = MAX_BSON_DEPTH - 20
"""``BSONDepth::getMaxDepthForUserStorage()``: levels a stored document may have (root = 1)."""

_MIN_NESTED_BYTES = 7
"""The smallest nested document: type byte, empty name, empty document (5 bytes)."""


def could_exceed(size: int, frames: int) -> bool:
    """Whether a BSON document of ``size`` bytes can hold ``frames`` nested levels at all."""
    return size >= 5 + _MIN_NESTED_BYTES * (frames - 1)


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        return iter(value.items())
    return ((str(i), item) for i, item in enumerate(value))


def overflow_path(doc: dict[str, Any], frames: int, *, skip_empty: bool = False) -> list[str] | None:
    """The field path to the first object or array that would open level ``frames + 1``.

    The root is level 1. None when ``doc`` stays within ``frames`` levels.
    ``skip_empty``: empty objects and arrays do not count (the storage check).
    """
    stack: list[Iterator[tuple[str, Any]]] = [_children(doc)]
    names: list[str] = []
    while stack:
        for name, value in stack[-1]:
            if isinstance(value, (dict, list)):
                if skip_empty and not value:
                    continue
                if len(stack) >= frames:
                    return [*names, name]
                names.append(name)
                stack.append(_children(value))
                break
        else:
            stack.pop()
            if names:
                names.pop()
    return None


def message_depth_error(doc: dict[str, Any]) -> str | None:
    """mongod's Overflow message for a message document nested too deep, or None."""
    path = overflow_path(doc, MAX_BSON_DEPTH + 1)
    if path is None:
        return None
    owner = "unknown _id"
    for name in doc:
        if name == path[0]:
            break
        if name == "_id":
            owner = f"_id: {_element_string(doc['_id'])}"
            break
    return (
        "BSONObj exceeds maximum nested object depth in element with field name "
        f"'{'.'.join(path)}' in object with {owner}"
    )


def storage_depth_error(doc: dict[str, Any]) -> str | None:
    """mongod's message when a document to store is nested too deep (``validateDepth``)."""
    if overflow_path(doc, MAX_USER_STORAGE_DEPTH, skip_empty=True) is None:
        return None
    return (
        f"cannot insert document because it exceeds {MAX_USER_STORAGE_DEPTH} levels of nesting"
    )


def _element_string(value: Any) -> str:
    """``BSONElement::toString`` for the usual ``_id`` types."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, ObjectId):
        return f"ObjectId('{value}')"
    return str(value)
