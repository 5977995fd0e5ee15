"""The ``$v: 2`` diff between a pre- and a post-image (``document_diff_calculator.cpp``).

mongod diffs the images of pipeline-style updates to log them: fields are
compared in order; binary-equal ones are skipped, same-named objects/arrays
recurse, other same-named fields are updates, a name mismatch deletes the
pre-image field (later post-image fields become inserts); arrays compare by
index, extra post elements are updates, a shorter post array is a resize.
When the diff would not be smaller than the post-image, mongod logs the whole
document instead, which makes the change event a ``replace``. Equality is
BSON binary equality, so 1, 1.0, Int64(1) and True all differ.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import bson
from bson.codec_options import CodecOptions
from bson.dbref import DBRef

DELTA_OPLOG_ENTRY_PADDING = 15
"""``kSizeOfDeltaOplogEntryMetadata``: room for ``{$v: 2, diff: ...}`` around the diff."""

_OPTIONS: CodecOptions[Any] = CodecOptions(uuid_representation=bson.STANDARD)
_OBJECT, _ARRAY = 0x03, 0x04
_EMPTY_DOC_DIFF = 5  # kSizeOfEmptyDocumentDiffBuilder
_EMPTY_ARRAY_DIFF = 9  # kSizeOfEmptyArrayDiffBuilder
_SECTION_WRAPPING = 8  # type byte, 1-char name, NUL, empty object
_RESIZE = 7  # "l" entry: type byte, name, NUL, int32

DiffKind = Literal["noop", "diff", "replace"]


def _element(value: Any) -> bytes:
    """BSON type byte, empty name and value bytes: equal iff the values are binary-equal."""
    return bson.encode({"": value}, codec_options=_OPTIONS)[4:-1]


def _value_size(element: bytes) -> int:
    """``BSONElement::valuesize()`` of an :func:`_element`."""
    return len(element) - 2


def _detached(value: Any) -> Any:
    """A copy of a container value, so later in-place edits of the post-image
    cannot change a diff already written to the oplog."""
    return copy.deepcopy(value) if isinstance(value, (Mapping, list)) else value


def _as_mapping(value: Any) -> Mapping[str, Any]:
    return value.as_doc() if isinstance(value, DBRef) else value


class _DocumentNode:
    """``DocumentSubDiffNode`` with its approximate BSON size, kept as mongod keeps it."""

    def __init__(self, padding: int = 0) -> None:
        self.size = padding + _EMPTY_DOC_DIFF
        self.deletes: list[str] = []
        self.updates: dict[str, Any] = {}
        self.inserts: dict[str, Any] = {}
        self.children: list[tuple[str, _DocumentNode | _ArrayNode]] = []

    def _add(self, name: str, value_size: int, first_in_section: bool) -> None:
        self.size += len(name.encode()) + 2 + value_size
        if first_in_section:
            self.size += _SECTION_WRAPPING

    def add_update(self, name: str, value: Any, value_size: int) -> None:
        self._add(name, value_size, not self.updates)
        self.updates[name] = _detached(value)

    def add_insert(self, name: str, value: Any, value_size: int) -> None:
        self._add(name, value_size, not self.inserts)
        self.inserts[name] = _detached(value)

    def add_delete(self, name: str) -> None:
        self._add(name, 1, not self.deletes)
        self.deletes.append(name)

    def add_child(self, name: str, child: _DocumentNode | _ArrayNode) -> None:
        self.size += len(name.encode()) + 2 + child.size + 1  # +1: the "s" prefix
        self.children.append((name, child))

    def serialize(self) -> dict[str, Any]:
        """Section order of ``DocumentSubDiffFrame``: d, u, i, then s<field>."""
        out: dict[str, Any] = {}
        if self.deletes:
            out["d"] = dict.fromkeys(self.deletes, False)
        if self.updates:
            out["u"] = self.updates
        if self.inserts:
            out["i"] = self.inserts
        for name, child in self.children:
            out["s" + name] = child.serialize()
        return out


class _ArrayNode:
    """``ArrayNode``: updates and sub-diffs by index, optional resize."""

    def __init__(self) -> None:
        self.size = _EMPTY_ARRAY_DIFF
        self.resize: int | None = None
        self.entries: dict[str, Any] = {}

    def add_update(self, index: int, value: Any, value_size: int) -> None:
        self.size += 1 + len(str(index)) + 2 + value_size
        self.entries[f"u{index}"] = _detached(value)

    def add_child(self, index: int, child: _DocumentNode | _ArrayNode) -> None:
        self.size += 1 + len(str(index)) + 2 + child.size
        self.entries[f"s{index}"] = child

    def set_resize(self, size: int) -> None:
        self.resize = size
        self.size += _RESIZE

    def serialize(self) -> dict[str, Any]:
        out: dict[str, Any] = {"a": True}
        if self.resize is not None:
            out["l"] = self.resize
        for key, entry in self.entries.items():
            out[key] = entry.serialize() if key[0] == "s" else entry
        return out


def _sub_diff(pre: Any, post: Any, post_element: bytes) -> _DocumentNode | _ArrayNode | None:
    """``calculateSubDiffHelper``'s diff of two objects or two arrays (None: too large)."""
    post_size = _value_size(post_element)
    if post_element[0] == _OBJECT:
        return _document_diff(_as_mapping(pre), _as_mapping(post), post_size)
    return _array_diff(pre, post, post_size)


def _document_diff(
    pre: Mapping[str, Any], post: Mapping[str, Any], post_size: int, padding: int = 0
) -> _DocumentNode | None:
    """``computeDocDiff``; None once the diff outgrows the post-image."""
    node = _DocumentNode(padding)
    pre_items, post_items = list(pre.items()), list(post.items())
    i = j = 0
    deletes: set[str] = set()
    while i < len(pre_items) and j < len(post_items):
        if post_size < node.size:
            return None
        name, pre_value = pre_items[i]
        post_name, post_value = post_items[j]
        if name != post_name:
            deletes.add(name)  # unless the field reappears later as an insert
            i += 1
            continue
        pre_element, post_element = _element(pre_value), _element(post_value)
        if pre_element != post_element:
            if pre_element[0] == post_element[0] and pre_element[0] in (_OBJECT, _ARRAY):
                child = _sub_diff(pre_value, post_value, post_element)
                if child is None:
                    node.add_update(name, post_value, _value_size(post_element))
                else:
                    node.add_child(name, child)
            else:
                node.add_update(name, post_value, _value_size(post_element))
        i += 1
        j += 1
    for name, _ in pre_items[i:]:
        node.add_delete(name)
    for name, post_value in post_items[j:]:
        node.add_insert(name, post_value, _value_size(_element(post_value)))
        deletes.discard(name)
    for name in sorted(deletes):  # std::set<StringData>: byte order == code point order
        node.add_delete(name)
    return node if post_size > node.size else None


def _array_diff(pre: Sequence[Any], post: Sequence[Any], post_size: int) -> _ArrayNode | None:
    """``computeArrayDiff``; None once the diff outgrows the post-image array."""
    node = _ArrayNode()
    common = min(len(pre), len(post))
    for index in range(common):
        if post_size < node.size:
            return None
        pre_element, post_element = _element(pre[index]), _element(post[index])
        if pre_element == post_element:
            continue
        if pre_element[0] == post_element[0] and pre_element[0] in (_OBJECT, _ARRAY):
            child = _sub_diff(pre[index], post[index], post_element)
            if child is not None:
                node.add_child(index, child)
                continue
        node.add_update(index, post[index], _value_size(post_element))
    for index in range(common, len(post)):
        node.add_update(index, post[index], _value_size(_element(post[index])))
    if len(pre) > common:
        node.set_resize(common)
    return node if post_size > node.size else None


def diff_or_replacement(
    pre: Mapping[str, Any],
    post: Mapping[str, Any],
    *,
    padding: int = DELTA_OPLOG_ENTRY_PADDING,
) -> tuple[DiffKind, dict[str, Any] | None]:
    """How mongod logs a pipeline-style update (``computeOplogDiff`` + the executor).

    ``("noop", None)``: binary-equal images, no oplog entry and no event;
    ``("diff", d)``: a ``$v: 2`` entry with ``diff: d``;
    ``("replace", None)``: the diff would not be smaller than ``post``, so the
    whole document is logged (a ``replace`` event). ``padding`` is the size
    budget for the entry's wrapper (mongod's callers pass 15).
    """
    post_bytes = bson.encode(post, codec_options=_OPTIONS)
    if bson.encode(pre, codec_options=_OPTIONS) == post_bytes:
        return "noop", None
    node = _document_diff(pre, post, len(post_bytes), padding)
    if node is None:
        return "replace", None
    diff = node.serialize()
    if len(bson.encode(diff, codec_options=_OPTIONS)) < len(post_bytes):
        return "diff", diff
    return "replace", None


def compute_diff(pre: Mapping[str, Any], post: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``$v: 2`` diff from ``pre`` to ``post``, or None.

    None when nothing changed or when mongod would log a full replacement;
    :func:`diff_or_replacement` tells the two apart.
    """
    return diff_or_replacement(pre, post)[1]
