"""How staged changes become the Delta table's rows: the layout's columns, as JSON or typed.

A document is one relaxed Extended JSON column (``document``) or, with a schema, the
schema's typed columns; a value that does not fit raises :class:`DocumentSchemaError`
naming the field, the ``_id`` and the value (nothing of the batch is written). The
sink (:mod:`changestream.delta`), the history table and the Spark writers share these
conversions, so every writer of a table writes the same text and the same types.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import bson
import pyarrow as pa
import tenacity
from bson import json_util
from bson.decimal128 import Decimal128
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument

from ._delta_drift import Drift
from ._delta_json import relaxed_dumps, relaxed_text
from ._delta_layout import SEQ, ascending, layout_schema
from ._delta_schema import arrow_schema
from ._js_code import decode_held
from ._json_worker import JsonWorker
from ._merge import CANONICAL, RELAXED, MergeBatch, as_row, key_json
from ._raw_rows import RAW_CODEC, raw_row
from .errors import ChangeStreamError

__all__ = [
    "DOCUMENT",
    "KEY",
    "OP",
    "DeltaSinkError",
    "DocumentSchemaError",
    "base_rows",
    "cell",
    "check_table_columns",
    "commit_retries",
    "decode_raw",
    "document_columns",
    "json_options_for",
    "json_texts",
    "json_worker_for",
    "merge_table",
    "misfit",
    "source_table",
    "staged_change",
    "staged_form",
    "struct_columns",
    "table_schema",
]

KEY = "_key"
"""The merge key column: the document's ``_id`` as compact Extended JSON."""
OP = "_op"
"""``"upsert"`` or ``"delete"``: what a row does to its key (base rows: ``"upsert"``)."""
DOCUMENT = "document"
"""The default data column: the whole document as Extended JSON."""


class DeltaSinkError(ChangeStreamError):
    """The table cannot be used by this sink (another schema, no position of this app id)."""


class DocumentSchemaError(DeltaSinkError):
    """A document field does not fit its column of the user-given schema; nothing was written."""


def json_options_for(json_mode: str) -> json_util.JSONOptions:
    if json_mode == "relaxed":
        return RELAXED
    if json_mode == "canonical":
        return CANONICAL
    raise ValueError(f"json_mode must be 'relaxed' or 'canonical', not {json_mode!r}")


def table_schema(schema: pa.Schema | None) -> pa.Schema:
    """The Delta table's columns: ``_key``, ``_seq``, ``_op``, then the document (JSON) or ``schema``'s fields."""
    if schema is None:
        return layout_schema(pa.schema([(DOCUMENT, pa.string())]))
    schema = arrow_schema(schema)
    taken = {KEY, OP, SEQ} & set(schema.names)
    if taken:
        raise ValueError(f"schema must not have a column named {sorted(taken)[0]!r} (the sink's own)")
    return layout_schema(schema)


def check_table_columns(path: str, have: pa.Schema, want: pa.Schema,
                        drift: Drift | None) -> pa.Schema | None:
    """An existing table's columns against a sink's: ``None`` when they are the same, the new
    table schema when ``drift`` adopts columns an earlier run evolved; else one clear error."""
    names = have.names
    if names == want.names:
        return None
    if drift is not None and names[:3] == want.names[:3] and drift.adopt(
            pa.schema(list(have)[3:])):  # columns evolved by an earlier run
        return table_schema(drift.schema)
    if SEQ not in names and names == [n for n in want.names if n not in (SEQ, OP)]:
        raise DeltaSinkError(
            f"the Delta table at {path} has the layout of an earlier changestream (one "
            f"merged row per key, columns {names}); this sink appends a change log "
            f"(columns {want.names}): mirror into a new path"
        )
    raise DeltaSinkError(
        f"the Delta table at {path} has the columns {names}, this sink writes {want.names}: "
        "give another path, or the schema the table was made with"
    )


def cell(value: Any, type_: pa.DataType, json_options: json_util.JSONOptions) -> Any:
    """A BSON value as pyarrow takes it for a column of ``type_`` (strings: as the Spark adapter)."""
    if value is None:
        return None
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        if isinstance(value, str):
            return value
        if isinstance(value, ObjectId):
            return str(value)
        return json_util.dumps(value, json_options=json_options)
    if isinstance(value, Decimal128):
        return value.to_decimal()
    if isinstance(value, ObjectId) or (isinstance(value, bool) and not pa.types.is_boolean(type_)):
        raise TypeError(f"{type(value).__name__} does not fit {type_}")
    if isinstance(value, float) and pa.types.is_integer(type_):
        if not value.is_integer():
            raise TypeError(f"{value!r} does not fit {type_}")
        return int(value)
    if isinstance(value, Decimal) and pa.types.is_integer(type_):
        raise TypeError(f"a decimal does not fit {type_}")
    return value


def merge_table(
    batch: MergeBatch, schema: pa.Schema | None = None, json_mode: str = "relaxed"
) -> pa.Table:
    """``batch`` as the merge's source: ``_key``, ``_op`` and the data columns.

    Without ``schema`` the data column ``document`` holds each document as
    Extended JSON (``json_mode``: ``"relaxed"``, as the Spark adapter's JSON
    columns, or ``"canonical"``, which keeps every numeric type). With a
    ``pyarrow.Schema`` each of its fields takes the document's field of that
    name (missing: null; fields not in the schema are not stored); a value
    that does not fit raises :class:`DocumentSchemaError` naming the field,
    the ``_id`` and the value.
    """
    rows = batch.rows
    return source_table([row.key_json for row in rows], [row.op for row in rows],
                   [row.document for row in rows], schema, json_options_for(json_mode))


def source_table(
    keys: list[str],
    ops: list[str],
    documents: Sequence[Mapping[str, Any] | None],
    schema: pa.Schema | None,
    json_options: json_util.JSONOptions,
    drift: Drift | None = None,
    *,
    count: bool = True,
    texts: Callable[[Sequence[Any], json_util.JSONOptions], list[str | None]] | None = None,
) -> pa.Table:
    """The merge's source table. ``texts``: what makes the document column (a sink's
    :class:`~._json_worker.JsonWorker`; default :func:`json_texts`)."""
    columns: dict[str, pa.Array] = {
        KEY: pa.array(keys, pa.string()),
        OP: pa.array(ops, pa.string()),
    }
    if schema is None:
        columns[DOCUMENT] = pa.array((texts or json_texts)(documents, json_options), pa.string())
        return pa.table(columns)
    if drift is not None:  # rescue or evolve (_delta_drift)
        columns.update(drift.columns(keys, documents, json_options, count=count))
    else:
        columns.update(document_columns(keys, documents, schema, json_options))
    return pa.table(columns)


def json_worker_for(setting: Any) -> JsonWorker:
    """A sink's :class:`~._json_worker.JsonWorker` from its ``json_worker`` option: ``None``
    (on where the machine has more than one core), ``True``, ``False``, or one to share."""
    if isinstance(setting, JsonWorker):
        return setting
    if setting is not None and type(setting) is not bool:
        raise ValueError(f"json_worker must be True, False or None (on where the machine has "
                         f"more than one core), or a JsonWorker to share, not {setting!r}")
    return JsonWorker(json_texts, (os.cpu_count() or 1) > 1 if setting is None else setting)


def json_texts(
    documents: Sequence[Mapping[str, Any] | str | bytes | None],
    json_options: json_util.JSONOptions,
) -> list[str | None]:
    """The document column's texts (a text already made by :func:`staged_change` as it is;
    BSON bytes, as :func:`staged_form` keeps a raw event's document, decoded first)."""
    if json_options is RELAXED:
        return [doc if doc is None or type(doc) is str else
                relaxed_text(doc) if type(doc) is bytes else relaxed_dumps(doc)
                for doc in documents]
    return [doc if doc is None or type(doc) is str else
            json_util.dumps(bson.decode(doc, RAW_CODEC) if type(doc) is bytes else doc,
                            json_options=json_options) for doc in documents]


_SLIMMED = frozenset({"insert", "update", "replace", "delete"})


def staged_change(change: Mapping[str, Any], json_options: json_util.JSONOptions, *,
                  held: bool = False) -> Any:
    """What the sink keeps of a document change until its batch commits (the one JSON
    column): the fields the merge reads, the document already as the text the table stores.

    A stream's document change becomes a :data:`~changestream._merge.Row`, a tuple of texts
    the garbage collector does not walk. A batch of decoded events is ~17 containers per
    change that it walks again at each collection while they wait (a third of the sink's CPU
    at 10,000 changes a batch); a slim dict of the fields still ~5 (a tenth). Other events
    (snapshot records, DDL) stay as they are.
    """
    if type(change) is not dict or change.get("operationType") not in _SLIMMED \
            or "_id" not in change:
        return change
    document = change.get("fullDocument")
    text = None if document is None or type(document) is str else (
        relaxed_dumps(document, held=held) if json_options is RELAXED
        else json_util.dumps(document, json_options=json_options))
    row = as_row(change, json_options, text)
    if row is not None:
        return row
    slim = {"_id": change["_id"], "operationType": change["operationType"],
            "ns": change.get("ns"), "documentKey": change.get("documentKey")}
    if "fullDocument" in change:
        slim["fullDocument"] = text
    return slim


def decode_raw(raw: bytes | memoryview) -> dict[str, Any]:
    """A raw change's bytes as the dict a default client decodes."""
    return bson.decode(raw, RAW_CODEC)


def staged_form(change: Mapping[str, Any], json_options: json_util.JSONOptions,
                namespaces: dict[bytes, tuple[Any, Any]], *, whole: bool) -> Any:
    """What the sink keeps of one change until its batch commits: the change itself
    (``whole``: a schema's or the history's columns read all of it), or
    :func:`staged_change`'s slim form (raw document changes: their row read from their
    bytes, :func:`~changestream._raw_rows.raw_row`, the document kept as BSON until the batch
    is collapsed, :func:`json_texts`). Other raw documents are decoded here."""
    if type(change) is RawBSONDocument:
        row = None if whole else raw_row(change.raw, json_options, namespaces)
        if row is not None:
            return row
        if whole or json_options is not RELAXED:
            change = decode_raw(change.raw)
        else:  # JavaScript code held, for the relaxed encoder only
            return staged_change(decode_held(change.raw), json_options, held=True)
    return change if whole else staged_change(change, json_options)


def misfit(field: pa.Field, key: str, value: str, exc: BaseException) -> DocumentSchemaError:
    return DocumentSchemaError(
        f"field {field.name!r} of the document with _id {key} does not fit the column type "
        f"{field.type}: {value[:80]} ({exc}); nothing of this batch was written: widen the "
        "schema (a string column takes any value as JSON) and run again"
    )


def document_columns(
    keys: Sequence[str],
    documents: Sequence[Mapping[str, Any] | None],
    schema: pa.Schema,
    json_options: json_util.JSONOptions = RELAXED,
) -> dict[str, pa.Array]:
    """The columns of ``schema`` from documents (``None``: a deleted row, all null).

    Each field takes the document's field of that name (missing: null;
    fields not in the schema are not stored); a value that does not fit
    raises :class:`DocumentSchemaError` naming the field, the ``_id`` and the value.
    """
    columns: dict[str, pa.Array] = {}
    for field in schema:
        values = []
        for key, document in zip(keys, documents, strict=True):
            value = None if document is None else document.get(field.name)
            try:
                converted = cell(value, field.type, json_options)
                if converted is not None:
                    pa.array([converted], field.type)
            except (TypeError, ValueError, OverflowError, pa.ArrowException) as exc:
                raise misfit(field, key, json_util.dumps(value), exc) from exc
            values.append(converted)
        columns[field.name] = pa.array(values, field.type)
    return columns


def struct_columns(
    keys: Sequence[str], documents: pa.StructArray, schema: pa.Schema
) -> dict[str, pa.Array]:
    """The columns of ``schema`` from typed documents (Spark's ``full_document_schema``).

    A field the documents have is cast to its column's type (safe casts only:
    no overflow, no truncation); one they lack is null. A value that does not
    fit raises :class:`DocumentSchemaError`, as from plain Python.
    """
    import pyarrow.compute as pc

    names = [documents.type.field(i).name for i in range(documents.type.num_fields)]
    columns: dict[str, pa.Array] = {}
    for field in schema:
        if field.name not in names:
            columns[field.name] = pa.nulls(len(documents), field.type)
            continue
        values = pc.struct_field(documents, [names.index(field.name)])
        try:
            columns[field.name] = pc.cast(values, field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            for key, value in zip(keys, values, strict=True):  # the first row that does not fit
                try:
                    pc.cast(pa.array([value.as_py()], values.type), field.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as row_exc:
                    raise misfit(field, key, repr(value.as_py()), row_exc) from exc
            raise misfit(field, "?", "?", exc) from exc
    return columns


def base_rows(staged: Sequence[Mapping[str, Any]], schema: pa.Schema | None,
              json_options: json_util.JSONOptions, drift: Drift | None) -> pa.Table:
    """Snapshot records as a merge table: one upsert per key, sorted by key (a first load's
    files then have tight key ranges in their statistics)."""
    keys, documents = [], []
    for change in staged:
        try:
            key = change["documentKey"]["_id"]
        except (KeyError, TypeError):
            continue  # a record of no document (snapshotInterrupted)
        documents.append(change["fullDocument"])
        keys.append(key)
    texts = [key_json(key, json_options) for key in keys]
    rows = source_table(texts, ["upsert"] * len(texts), documents, schema, json_options, drift)
    return rows if ascending(rows.column(KEY)) else rows.sort_by(KEY)


COMMIT_ATTEMPTS = 8
"""Commits tried when other writers' commits conflict (with jittered backoff)."""


def commit_retries(path: str) -> tenacity.Retrying:
    """Bounded retries, jittered backoff, of a commit to the table at ``path`` that conflicted
    with other writers'; then one :class:`DeltaSinkError` saying so."""
    from deltalake.exceptions import CommitFailedError

    def give_up(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        raise DeltaSinkError(
            f"the Delta table at {path} kept changing under this writer: "
            f"{state.attempt_number} commits conflicted with other writers' ({exc})"
        ) from exc

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(CommitFailedError),
        stop=tenacity.stop_after_attempt(COMMIT_ATTEMPTS),
        wait=tenacity.wait_random_exponential(multiplier=0.05, max=2.0),
        retry_error_callback=give_up,
    )
