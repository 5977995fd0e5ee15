"""Merge-ready batches in Spark, and the Delta sink from both Spark paths.

:func:`merge_ready` is :func:`changestream.merge_ready` over a DataFrame of
change rows (either path's, :func:`event_ddl`'s envelope; ``full_document``
as JSON or typed by ``full_document_schema``): one row per (database,
collection, ``_id``), the last change in token order (``resume_token`` is the token's hex ``_data``, which
sorts in stream order; snapshot rows, ``"snapshot"``, come first). The key is
the ``_id`` from ``document_key`` as compact relaxed Extended JSON, the same
text :class:`changestream.delta.DeltaSink` writes from plain Python.

:func:`merge_into` is the data source's ``foreachBatch`` (version = Spark's
batch id: a replayed batch is skipped; the batch's last token rides along so
``mirror`` can take over); :func:`stage_into` is
``foreach_batch``'s ``func`` when the sink is also its token store, so the
batch and its token land in one commit. A sink with a schema
(``DeltaSink(schema=...)``) gets columns from both: a typed document's
fields are cast to it, a JSON document is parsed into it; a value that does
not fit fails the batch with :class:`changestream.delta.DocumentSchemaError`.
Both writers take the batch as Arrow and collapse it in Arrow compute kernels
on the driver (:func:`_merge_table`): no Python per row for the usual ``_id``s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bson import json_util
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StringType

import changestream

__all__ = ["merge_into", "merge_into_tables", "merge_ready", "stage_into"]

_SNAPSHOT = "snapshot"
_CLEARS = ("drop", "rename", "dropDatabase")


def _id_json(document_key: str | None) -> str | None:
    if document_key is None:
        return None
    key = json_util.loads(document_key, json_options=json_util.RELAXED_JSON_OPTIONS)
    if "_id" not in key:
        return None
    return json_util.dumps(key["_id"], json_options=json_util.RELAXED_JSON_OPTIONS,
                           separators=(",", ":"))


def _order() -> Any:
    """Snapshot rows first, then token order."""
    return F.when(F.col("resume_token") == _SNAPSHOT, F.lit(0)).otherwise(F.lit(1))


def merge_ready(df: DataFrame, *, full_document: str | None = None) -> DataFrame:
    """One row per document: ``database, collection, key, op, document, resume_token``.

    ``op`` is ``"upsert"`` (insert, replace, update, snapshot row: ``document``
    is ``full_document``) or ``"delete"``. With ``full_document="updateLookup"``
    an update whose document was gone at lookup time is a delete; any other
    update without ``full_document`` has ``op`` null (a lazy DataFrame cannot
    raise): :func:`merge_into` and :func:`stage_into` refuse such a batch with
    :class:`changestream.MissingDocumentError` (read with ``full_document``
    ``updateLookup`` or ``required``). Rows before a ``drop``, ``rename`` or
    ``dropDatabase`` of their database are left out. ``document`` has the
    type of ``full_document``: the JSON string, or the ``STRUCT`` of
    ``full_document_schema``.
    """
    kind = dict(df.dtypes).get("full_document", "")
    if kind != "string" and not kind.startswith("struct<"):
        raise ValueError(
            "merge_ready needs the change event columns (full_document among them): read "
            "without publish_full_document_only"
        )
    id_json = F.udf(_id_json, StringType())
    keyed = df.where(F.col("document_key").isNotNull()).withColumn(
        "key", id_json(F.col("document_key"))
    ).where(F.col("key").isNotNull())
    clears = df.where(F.col("operation_type").isin(*_CLEARS)).groupBy("database").agg(
        F.max("resume_token").alias("_cleared_at")
    )
    keyed = keyed.join(clears, "database", "left").where(
        F.col("_cleared_at").isNull() | (F.col("resume_token") > F.col("_cleared_at"))
        | (F.col("resume_token") == _SNAPSHOT)
    )
    window = Window.partitionBy("database", "collection", "key").orderBy(
        _order().desc(), F.col("resume_token").desc()
    )
    last = keyed.withColumn("_rank", F.row_number().over(window)).where(F.col("_rank") == 1)
    lookup_gone = full_document == "updateLookup"
    op = (
        F.when(F.col("operation_type") == "delete", F.lit("delete"))
        .when(F.col("full_document").isNotNull(), F.lit("upsert"))
        .when((F.col("operation_type") == "update") & F.lit(lookup_gone), F.lit("delete"))
    )
    return last.select(
        "database", "collection", "key", op.alias("op"),
        F.when(op == "upsert", F.col("full_document")).alias("document"), "resume_token",
        "operation_type",
    )


def _missing(operation: str, key: str, token: str) -> changestream.MissingDocumentError:
    return changestream.MissingDocumentError(
        f"the {operation} event of _id {key} (token {token}) has no full_document, so the "
        "document after it is unknown: read with full_document='updateLookup' (the current "
        "document) or 'required' (post-images: enable changeStreamPreAndPostImages), and pass "
        "the same full_document= here"
    )


_RELAXED = json_util.RELAXED_JSON_OPTIONS

_COLUMNS = ("resume_token", "operation_type", "database", "collection", "document_key",
            "full_document")


def _change_rows(batch: DataFrame | Any) -> Any:
    """The columns the writers need as Arrow: a DataFrame collected once to the driver."""
    names = batch.columns if isinstance(batch, DataFrame) else batch.column_names
    missing = [name for name in _COLUMNS if name not in names]
    if missing:
        raise ValueError(
            f"the Delta writers need the change event columns (missing {missing[0]!r}): read "
            "without publish_full_document_only"
        )
    if isinstance(batch, DataFrame):
        return batch.select(*_COLUMNS).toArrow()
    return batch.select(list(_COLUMNS))


_OID_KEY = r'^\{"_id": \{"\$oid": "([0-9a-f]{24})"\}\}$'
"""A ``document_key`` of just an ObjectId ``_id``: its ``_key`` is ``{"$oid":"<hex>"}``."""
_PLAIN_KEY = r'^\{"_id": (-?[0-9]+|"(?:[^"\\]|\\.)*")\}$'
"""A ``document_key`` of just an integer or string ``_id``: its ``_key`` is the same text
(an integer's digits; a string's ASCII-escaped literal, which no separator touches)."""


def _keys(document_keys: Any) -> Any:
    """The ``_key`` of each row's ``document_key`` (null: no ``_id``), vectorised.

    ``document_key`` is relaxed Extended JSON with ``json``'s default separators;
    ``_key`` is the ``_id`` alone, compact: the usual ``_id``s (an ObjectId, an
    integer, a string, alone in the key) are rewritten by regular expressions in
    Arrow; any other (a shard key beside it, a compound or date ``_id``) is
    re-encoded by ``json_util`` row by row, the same text the sink writes.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    oid = pc.fill_null(pc.match_substring_regex(document_keys, _OID_KEY), False)
    plain = pc.fill_null(pc.match_substring_regex(document_keys, _PLAIN_KEY), False)
    keys = pc.if_else(
        oid, pc.replace_substring_regex(document_keys, _OID_KEY, r'{"$oid":"\1"}'),
        pc.if_else(plain, pc.replace_substring_regex(document_keys, _PLAIN_KEY, r"\1"),
                   pa.scalar(None, pa.string())),
    )
    others = pc.and_(pc.is_valid(document_keys), pc.invert(pc.or_(oid, plain)))
    if not pc.any(others).as_py():
        return keys
    rest = pc.indices_nonzero(others).to_pylist()  # the unusual keys only
    texts = keys.to_pylist()
    for i, document_key in zip(rest, document_keys.take(rest).to_pylist(), strict=True):
        texts[i] = _id_json(document_key)
    return pa.array(texts, pa.string())


def _merge_table(changes: Any, sink: Any) -> tuple[Any, bool]:
    """The sink's merge table (``_key``, ``_op``, the data columns) and whether the batch cleared.

    ``changes`` is the batch as Arrow (the change event columns). The batch
    goes to the driver anyway (delta-rs writes from there), so it is
    collapsed there as :func:`merge_ready` does in Spark, in Arrow compute
    kernels (no Python per row): sorted by token (snapshot rows first, in
    their order), cut after the last ``drop``/``rename``/``dropDatabase``,
    then each key's last row, in token order. The data columns: the JSON
    ``full_document`` as it is, or parsed into ``sink.schema``; a typed
    (``full_document_schema``) document's fields cast to ``sink.schema``.
    """
    import numpy
    import pyarrow as pa
    import pyarrow.compute as pc

    from changestream.delta import DOCUMENT, KEY, OP, document_columns, struct_columns

    _one_namespace(changes)
    tokens = changes.column("resume_token").combine_chunks()
    events = pc.fill_null(pc.not_equal(tokens, _SNAPSHOT), True)
    order = pc.sort_indices(  # stable: snapshot rows keep their order
        pa.table({"e": events, "t": pc.fill_null(tokens, "")}),
        sort_keys=[("e", "ascending"), ("t", "ascending")])
    operations = changes.column("operation_type").combine_chunks().take(order)
    clears = pc.fill_null(pc.is_in(operations, pa.array(_CLEARS)), False)
    cleared = bool(pc.any(clears).as_py())
    if cleared:  # only what comes after the last one
        after = pc.indices_nonzero(clears)[-1].as_py() + 1
        order, operations = order[after:], operations[after:]
    keys = _keys(changes.column("document_key").combine_chunks().take(order))
    positions = pa.table({"k": keys, "p": pa.array(numpy.arange(len(keys), dtype=numpy.int64))})
    positions = positions.filter(pc.is_valid(keys))
    last = positions.group_by("k", use_threads=False).aggregate([("p", "max")]).column(
        "p_max").combine_chunks()
    picked_at = pc.array_take(last, pc.sort_indices(last))  # each key's last row, in token order
    rows = order.take(picked_at)
    keys = keys.take(picked_at)
    operations = operations.take(picked_at)
    documents = changes.column("full_document").combine_chunks()
    present = documents.is_valid().take(rows)
    deleted = pc.or_(
        pc.equal(operations, "delete"),
        pc.and_(pc.invert(present), pc.and_(pc.equal(operations, "update"),
                                            pa.scalar(sink.full_document == "updateLookup"))),
    )
    unknown = pc.and_(pc.invert(deleted), pc.invert(present))
    if pc.any(unknown).as_py():
        i = pc.indices_nonzero(unknown)[0].as_py()
        raise _missing(operations[i].as_py(), keys[i].as_py(),
                       tokens.take(rows)[i].as_py())
    upserts = pc.invert(deleted)
    picked = documents.take(pc.if_else(upserts, rows, pa.scalar(None, pa.int64())))
    columns: dict[str, Any] = {
        KEY: keys, OP: pc.if_else(upserts, pa.scalar("upsert"), pa.scalar("delete")),
    }
    typed = pa.types.is_struct(picked.type)
    if sink.schema is None:
        if typed:
            raise ValueError(
                "the batch has typed documents (full_document_schema): give the sink a schema "
                "(DeltaSink(schema=...), e.g. the same DDL) to store them as columns"
            )
        columns[DOCUMENT] = picked.cast(pa.string())
    elif typed:
        columns.update(struct_columns(keys.to_pylist(), picked, sink.schema))
    else:  # JSON parsed into the schema's columns: json_util, row by row
        parsed = [None if doc is None else json_util.loads(doc, json_options=_RELAXED)
                  for doc in picked.to_pylist()]
        columns.update(document_columns(keys.to_pylist(), parsed, sink.schema))
    return pa.table(columns), cleared


def _one_namespace(changes: Any) -> None:
    """A Delta sink mirrors one collection: refuse a batch of two."""
    import pyarrow.compute as pc

    named = changes.select(["database", "collection"]).filter(
        pc.is_valid(changes.column("collection")))
    if named.num_rows and named.group_by(["database", "collection"]).aggregate([]).num_rows > 1:
        raise ValueError("a Delta sink mirrors one collection; filter the batch by "
                         "database and collection first")


def _last_token(changes: Any) -> dict[str, str] | None:
    """The resume token of the batch's last event (``None``: snapshot rows only)."""
    import pyarrow.compute as pc

    tokens = changes.column("resume_token")
    last = pc.max(pc.filter(tokens, pc.fill_null(pc.not_equal(tokens, _SNAPSHOT), False)))
    return None if last.as_py() is None else {"_data": last.as_py()}


def merge_into(sink: Any) -> Callable[[DataFrame, int], None]:
    """``foreachBatch`` function of the data source: merge each batch as version ``batch_id``.

    Spark replays a batch with the same events and the same id after a
    failure; the sink skips a version the table already holds. The batch is
    collected once as Arrow (``df.toArrow()``) and collapsed in Arrow kernels.
    Its last event's token goes into the same commit, so ``changestream
    mirror`` (or ``foreach_batch``) with the same app id can take the table
    over from where the query stopped.
    """

    def func(df: DataFrame, batch_id: int) -> None:
        changes = _change_rows(df)
        table, cleared = _merge_table(changes, sink)
        sink.write(table, int(batch_id), _last_token(changes), cleared=cleared)

    return func


def stage_into(sink: Any) -> Callable[[DataFrame, int], None]:
    """``func`` of :func:`foreach_batch` with ``store=sink``: the batch is committed with its token.

    ``foreach_batch`` calls ``func`` and then saves the batch's token and id
    in the store; with the sink as the store both go into one Delta commit,
    so a batch that was re-cut after a crash (more or fewer events) is
    applied whole, once. ``foreach_batch`` hands it the batch's Arrow table
    (its ``arrow_batch``): the rows go to the sink without a DataFrame.
    """
    return _StageInto(sink)


class _StageInto:
    """:func:`stage_into`'s function: a DataFrame, or (from ``foreach_batch``) Arrow."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        self.arrow_batch(_change_rows(df), batch_id)

    def arrow_batch(self, batch: Any, batch_id: int) -> None:
        """Stage the batch given as the Arrow table of its change rows."""
        table, cleared = _merge_table(_change_rows(batch), self.sink)
        self.sink.stage(table, cleared=cleared)


def merge_into_tables(
    path: str, *, app_id: str = "changestream", include: Callable[[str], bool] | None = None,
    **sink_options: Any,
) -> MergeIntoTables:
    """``foreachBatch`` function of the data source on a whole database: one table per collection.

    Each batch is split by its ``collection`` column and each part merged, as
    :func:`merge_into` does, into ``DeltaSink(path/<collection>, app_id=app_id,
    **sink_options)`` (:func:`changestream.delta.table_path`, the layout of
    ``changestream mirror`` without ``--coll``) as version ``batch_id``: a batch
    Spark runs again is skipped by every table that holds it. ``include(name)``
    picks the collections (default: all). Rows without a collection
    (``dropDatabase``) are left out. Also takes the batch as Arrow. Each table's commit
    holds the token of the collection's last event in the batch, so ``changestream
    mirror`` with the same app id can take the tables over.
    """
    return MergeIntoTables(path, app_id, include, sink_options)


class MergeIntoTables:
    """:func:`merge_into_tables`'s function; :attr:`sinks` holds each collection's sink."""

    def __init__(self, path: str, app_id: str, include: Callable[[str], bool] | None,
                 sink_options: dict[str, Any]) -> None:
        self.path = path
        self.app_id = app_id
        self.include = include
        self.sink_options = sink_options
        self.sinks: dict[str, Any] = {}

    def sink(self, collection: str) -> Any:
        """The Delta sink of ``collection``'s table (made on first use)."""
        from changestream.delta import DeltaSink, table_path

        if collection not in self.sinks:
            self.sinks[collection] = DeltaSink(table_path(self.path, collection),
                                               app_id=self.app_id, **self.sink_options)
        return self.sinks[collection]

    def __call__(self, df: DataFrame | Any, batch_id: int) -> None:
        import pyarrow.compute as pc

        changes = _change_rows(df)
        names = [name for name in pc.unique(changes.column("collection")).to_pylist()
                 if name is not None and (self.include is None or self.include(name))]
        for name in sorted(names):
            part = changes.filter(pc.equal(changes.column("collection"), name))
            sink = self.sink(name)
            table, cleared = _merge_table(part, sink)
            sink.write(table, int(batch_id), _last_token(part), cleared=cleared)
