"""Merge-ready batches: a batch of changes collapsed to the last change of each document.

A table kept in step with a collection (a Delta table, a warehouse table)
applies each batch as one ``MERGE``: upsert the documents that exist after
the batch, delete the ones that do not. That needs one row per key, the
*last* change of that key, and "last" is token order: the changes of one
transaction share a ``clusterTime``, so only the resume tokens order them.
Snapshot records (:func:`changestream.snapshot_then_watch`) come before
every event. An update event carries the document only when the stream was
opened with ``full_document``; without it the batch is refused, because a
merge that skipped the update would silently keep an old version.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from bson import json_util
from bson.json_util import JSONOptions

from ._delta_json import relaxed_key
from ._snapshot import SNAPSHOT_MARK
from ._token import ResumeToken
from .errors import ChangeStreamError

__all__ = [
    "CLEARS", "MergeBatch", "MergeColumns", "MergeRow", "MissingDocumentError", "Row", "as_row",
    "change_effect", "change_order", "key_json", "merge_columns", "merge_ready",
]

RELAXED = json_util.RELAXED_JSON_OPTIONS
CANONICAL = json_util.CANONICAL_JSON_OPTIONS

_UPPER_HEX = re.compile("[0-9A-F]*")
"""Resume token texts as servers write them (the order of the texts is the bytes')."""
_UPSERTS = frozenset({"insert", "replace", "update"})
CLEARS = frozenset({"drop", "rename", "dropDatabase"})
"""After these every document of the watched collection is gone (renamed away, dropped)."""


class MissingDocumentError(ChangeStreamError):
    """An update event without its document: the stream was not opened to deliver it."""


@dataclasses.dataclass(frozen=True)
class MergeRow:
    """The last change of one document in a batch."""

    key: Any
    """The document's ``_id`` (from ``documentKey``)."""
    key_json: str
    """``key`` as Extended JSON: a column value that tells every ``_id`` apart."""
    op: Literal["upsert", "delete"]
    document: Mapping[str, Any] | None
    """The document after the change (``None`` for a delete)."""
    token: Mapping[str, Any]
    """The change's resume token (a snapshot record's position)."""


@dataclasses.dataclass(frozen=True)
class MergeBatch:
    """One batch, ready for a ``MERGE``: :attr:`rows` are in token order of their change."""

    rows: list[MergeRow]
    cleared: bool
    """A ``drop``, ``rename`` or ``dropDatabase`` came: delete every row not in :attr:`rows`."""
    last_token: Mapping[str, Any] | None
    """The token of the batch's last change (``None`` for an empty batch)."""

    def columns(self) -> MergeColumns:
        """The same batch as :class:`MergeColumns`."""
        rows = self.rows
        return MergeColumns([r.key_json for r in rows], [r.op for r in rows],
                            [r.document for r in rows], self.cleared, self.last_token)


Row = tuple[str, str, Any, Any, str, Any, bool]
"""A document change reduced to what :func:`merge_columns` reads, in one plain tuple
(:func:`as_row`): its token's ``_data``, ``operationType``, ``ns.db``, ``ns.coll``, the key's
text, the document as its holder keeps it (the Delta sink: its JSON text, or its BSON bytes
from a raw event; ``None``: null) and whether the event had a ``fullDocument`` field.

A tuple of texts (and bytes) is nothing the garbage collector walks (CPython stops tracking
it at the first collection), where a decoded change keeps ~5 containers it walks again at
every collection while the batch waits: the Delta sink stages its changes so.
"""

_ROW_OPERATIONS = frozenset({"insert", "update", "replace", "delete"})


def as_row(change: Mapping[str, Any], json_options: JSONOptions, document: Any) -> Row | None:
    """``change`` as a :data:`Row` (its key's text as :func:`key_json` makes it with
    ``json_options``; ``document`` stands for its ``fullDocument``), or ``None`` when it is
    not a document change with a change stream's token (snapshot records, DDL events and
    odd shapes stay mappings)."""
    if type(change) is not dict:
        return None
    operation = change.get("operationType")
    token, ns, document_key = change.get("_id"), change.get("ns"), change.get("documentKey")
    if operation not in _ROW_OPERATIONS or type(token) is not dict or len(token) != 1 \
            or type(ns) is not dict or type(document_key) is not dict \
            or "_id" not in document_key:
        return None
    data = token.get("_data")
    if type(data) is not str or data == SNAPSHOT_MARK:
        return None
    return (data, operation, ns.get("db"), ns.get("coll"),
            key_json(document_key["_id"], json_options),
            document, "fullDocument" in change)


def _token(change: Mapping[str, Any] | Row) -> Any:
    """A staged change's resume token."""
    return {"_data": change[0]} if isinstance(change, tuple) else change["_id"]


def key_json(key: Any, json_options: JSONOptions = RELAXED) -> str:
    """The key column's text for an ``_id``: Extended JSON, compact."""
    if json_options is RELAXED:
        return relaxed_key(key)
    return json_util.dumps(key, json_options=json_options, separators=(",", ":"))


def _order(token: Any, index: int) -> tuple[int, bytes, int]:
    """Snapshot records first (in arrival order), then events by token bytes."""
    if type(token) is dict:  # the common case, without a BSON round trip: ResumeToken.key's bytes
        data = token.get("_data")
        if data == SNAPSHOT_MARK:
            return (0, b"", index)
        if type(data) is str:
            try:
                return (1, bytes.fromhex(data), index)
            except ValueError:
                return (1, data.encode(), index)
    if isinstance(token, Mapping) and token.get("_data") == SNAPSHOT_MARK:
        return (0, b"", index)
    return (1, ResumeToken.of(token).key, index)


def merge_ready(
    changes: Iterable[Mapping[str, Any]],
    *,
    full_document: str | None = None,
    json_options: JSONOptions = RELAXED,
) -> MergeBatch:
    """Collapse ``changes`` (events or snapshot records, one collection) to one row per ``_id``.

    Each row is the document's last change in token order: ``upsert`` with
    the document after it (insert, replace, update, snapshot record) or
    ``delete``. A delete then a re-insert of one ``_id`` gives the upsert, an
    insert then a delete the delete. ``full_document`` is the option the
    stream was opened with: with ``"updateLookup"`` an update whose document
    was gone at lookup time (``fullDocument: null``) is a delete (its delete
    event follows); any other update without a document raises
    :class:`MissingDocumentError`, saying to open the stream with
    ``full_document="updateLookup"`` or ``"required"`` (post-images). Events
    without a ``documentKey`` (DDL) give no row; ``drop``, ``rename`` and
    ``dropDatabase`` set :attr:`MergeBatch.cleared`. An ``operationType: "error"``
    event (a failure the server reports in place of a change) raises ``ValueError``:
    it is never applied, nor skipped unseen.
    """
    last, cleared, last_token = _collapse(changes, json_options)
    rows = [_row(key, text, change, full_document) for text, (key, change) in last.items()]
    return MergeBatch(rows, cleared, last_token)


@dataclasses.dataclass(frozen=True)
class MergeColumns:
    """:func:`merge_ready`'s batch as columns (the Delta sink's fast path: no row objects)."""

    keys: list[str]
    ops: list[str]
    documents: list[Mapping[str, Any] | None]
    cleared: bool
    last_token: Mapping[str, Any] | None


def merge_columns(
    changes: Iterable[Mapping[str, Any] | Row],
    *,
    full_document: str | None = None,
    json_options: JSONOptions = RELAXED,
) -> MergeColumns:
    """:func:`merge_ready` as columns: the same rows, the same errors. ``changes`` may
    also hold :data:`Row` tuples (their document column: what the row holds)."""
    last, cleared, last_token = _collapse(changes, json_options)
    keys = list(last)
    ops: list[str] = []
    documents: list[Mapping[str, Any] | None] = []
    for text, (_key, change) in last.items():
        op, document = _op_document(text, change, full_document)
        ops.append(op)
        documents.append(document)
    return MergeColumns(keys, ops, documents, cleared, last_token)


def _collapse(
    changes: Iterable[Mapping[str, Any] | Row], json_options: JSONOptions
) -> tuple[dict[str, tuple[Any, Mapping[str, Any] | Row]], bool, Mapping[str, Any] | None]:
    """Each key's last change in token order (in the order of those changes)."""
    ordered = _in_token_order(changes if isinstance(changes, list) else list(changes))
    last: dict[str, tuple[Any, Mapping[str, Any] | Row]] = {}
    cleared = False
    namespace: tuple[Any, Any] | None = None
    for change in ordered:
        if type(change) is tuple:  # a Row: a document change, its key's text made
            here: tuple[Any, Any] = (change[2], change[3])
            if here != namespace:
                if namespace is not None:
                    raise _mixed(namespace, here)
                namespace = here
            text = change[4]
            last.pop(text, None)  # keeps the rows in the token order of their change
            last[text] = (None, change)
            continue
        operation = change.get("operationType")
        if operation == "error":
            raise ValueError(
                f"the batch holds an error event (operationType 'error', token "
                f"{ResumeToken.of(change['_id']).to_json()}): the server reported a failure "
                "in place of a change, so it is not applied as data; fix the cause it names, "
                "or start after its token to skip it"
            )
        ns = change.get("ns") or {}
        here = (ns.get("db"), ns.get("coll"))
        if namespace is None:
            namespace = here
        elif here != namespace and operation != "dropDatabase":
            raise _mixed(namespace, here)
        if operation in CLEARS:
            cleared = True
            last.clear()
            continue
        document_key = change.get("documentKey")
        if type(document_key) is not dict and not isinstance(document_key, Mapping):
            continue
        if "_id" not in document_key:
            continue
        key = document_key["_id"]
        text = key_json(key, json_options)
        last.pop(text, None)  # keeps the rows in the token order of their change
        last[text] = (key, change)
    return last, cleared, _token(ordered[-1]) if ordered else None


def _mixed(namespace: tuple[Any, Any], here: tuple[Any, Any]) -> ValueError:
    return ValueError(
        f"merge_ready collapses the changes of one collection; this batch holds "
        f"{_name(namespace)} and {_name(here)}: group the changes by 'ns' first"
    )


def _in_token_order(changes: list[Any]) -> list[Any]:
    """``changes`` sorted by :func:`_order` (stable).

    A stream hands its events in token order, so a batch of events is almost always
    sorted already: that is checked on the tokens' hex texts (one case of hex digits
    orders as the bytes do) without decoding any, and only a batch that is not (snapshot
    records, tokens of another shape, a batch put together out of order) is sorted.
    """
    try:
        texts = [change[0] if type(change) is tuple else change["_id"]["_data"]
                 for change in changes]
        if all(type(text) is str and not len(text) % 2 for text in texts) and \
                _UPPER_HEX.fullmatch("".join(texts)) and all(
                    a <= b for a, b in itertools.pairwise(texts)):
            return changes
    except (KeyError, TypeError):
        pass
    keyed = sorted(((_order(_token(change), index), change) for index, change in
                    enumerate(changes)), key=lambda pair: pair[0])
    return [change for _, change in keyed]


def _name(namespace: tuple[Any, Any]) -> str:
    return ".".join(str(part) for part in namespace if part is not None) or "?"


def _row(key: Any, text: str, change: Mapping[str, Any] | Row, full_document: str | None
         ) -> MergeRow:
    op, document = _op_document(text, change, full_document)
    return MergeRow(key, text, op, document, _token(change))


def _op_document(
    text: str, change: Mapping[str, Any] | Row, full_document: str | None
) -> tuple[Literal["upsert", "delete"], Any]:
    """What a key's last change leaves: ``("upsert", document)`` or ``("delete", None)``."""
    operation: Any
    if isinstance(change, tuple):
        operation, document, has_document = change[1], change[5], change[6]
    else:
        operation = change.get("operationType")
        document, has_document = change.get("fullDocument"), "fullDocument" in change
    if operation == "delete":
        return "delete", None
    if operation not in _UPSERTS:
        raise ValueError(f"cannot merge a {operation!r} event (key {text}): not a document change")
    if document is not None:
        return "upsert", document
    if operation == "update" and full_document == "updateLookup" and has_document:
        return "delete", None  # gone when it was looked up
    raise MissingDocumentError(
        f"the {operation} event of _id {text} (token "
        f"{ResumeToken.of(_token(change)).to_json()}) has no fullDocument, so the document "
        "after it is unknown: open the stream with "
        "full_document='updateLookup' (the current document) or full_document='required' "
        "(post-images: enable changeStreamPreAndPostImages on the collection), and pass the "
        "same full_document= to merge_ready"
    )


def change_order(change: Mapping[str, Any], index: int) -> tuple[int, bytes, int]:
    """Where ``change`` (the ``index``-th of its batch) sorts: token order, snapshot records first.

    What :func:`merge_ready` sorts by; the history table orders every change by it.
    """
    return _order(change["_id"], index)


def change_effect(
    text: str, change: Mapping[str, Any], full_document: str | None
) -> tuple[Literal["upsert", "delete"], Mapping[str, Any] | None]:
    """What one document change leaves (:func:`merge_ready`'s rule, its errors)."""
    return _op_document(text, change, full_document)
