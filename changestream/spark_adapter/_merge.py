"""Merge-ready batches in Spark, and the Delta sink from both Spark paths.

:func:`merge_ready` is :func:`changestream.merge_ready` over a DataFrame of
change rows (either path's, :func:`event_ddl`'s envelope with the JSON
``full_document``): one row per (database, collection, ``_id``), the last
change in token order (``resume_token`` is the token's hex ``_data``, which
sorts in stream order; snapshot rows, ``"snapshot"``, come first). The key is
the ``_id`` from ``document_key`` as compact relaxed Extended JSON, the same
text :class:`changestream.delta.DeltaSink` writes from plain Python.

:func:`merge_into` is the data source's ``foreachBatch`` (version = Spark's
batch id: a replayed batch is skipped); :func:`stage_into` is
``foreach_batch``'s ``func`` when the sink is also its token store, so the
batch and its token land in one commit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bson import json_util
from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StringType

import changestream

__all__ = ["merge_into", "merge_ready", "stage_into"]

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
    ``dropDatabase`` of their database are left out. ``full_document`` must be
    the JSON column (no ``full_document_schema``).
    """
    if dict(df.dtypes).get("full_document") != "string":
        raise ValueError(
            "merge_ready needs the JSON full_document column: read without "
            "full_document_schema and publish_full_document_only"
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


def _merge_table(df: DataFrame, full_document: str | None) -> tuple[Any, bool]:
    """The sink's merge table (``_key``, ``_op``, ``document``) and whether the batch cleared.

    The batch goes to the driver anyway (delta-rs writes from there), so it is
    collected once, as Arrow, and collapsed there as :func:`merge_ready` does
    in Spark: one Spark job per batch instead of several.
    """
    import pyarrow as pa

    from changestream.delta import DOCUMENT, KEY, OP

    rows = df.select("resume_token", "operation_type", "database", "collection",
                     "document_key", "full_document").toArrow().to_pylist()
    rows.sort(key=lambda r: (r["resume_token"] != _SNAPSHOT, r["resume_token"] or ""))
    last: dict[str, dict[str, Any]] = {}
    cleared = False
    namespace = None
    for row in rows:
        here = (row["database"], row["collection"])
        if row["collection"] is not None:
            if namespace is None:
                namespace = here
            elif here != namespace:
                raise ValueError("a Delta sink mirrors one collection; filter the batch by "
                                 "database and collection first")
        if row["operation_type"] in _CLEARS:
            cleared = True
            last.clear()
            continue
        key = _id_json(row["document_key"])
        if key is not None:
            last.pop(key, None)
            last[key] = row
    keys, ops, documents = [], [], []
    for key, row in last.items():
        operation, document = row["operation_type"], row["full_document"]
        if operation == "delete" or (
            document is None and operation == "update" and full_document == "updateLookup"
        ):
            op, document = "delete", None
        elif document is not None:
            op = "upsert"
        else:
            raise _missing(operation, key, row["resume_token"])
        keys.append(key)
        ops.append(op)
        documents.append(document)
    table = pa.table({KEY: pa.array(keys, pa.string()), OP: pa.array(ops, pa.string()),
                      DOCUMENT: pa.array(documents, pa.string())})
    return table, cleared


def merge_into(sink: Any) -> Callable[[DataFrame, int], None]:
    """``foreachBatch`` function of the data source: merge each batch as version ``batch_id``.

    Spark replays a batch with the same events and the same id after a
    failure; the sink skips a version the table already holds.
    """

    def func(df: DataFrame, batch_id: int) -> None:
        table, cleared = _merge_table(df, sink.full_document)
        sink.write(table, int(batch_id), cleared=cleared)

    return func


def stage_into(sink: Any) -> Callable[[DataFrame, int], None]:
    """``func`` of :func:`foreach_batch` with ``store=sink``: the batch is committed with its token.

    ``foreach_batch`` calls ``func`` and then saves the batch's token and id
    in the store; with the sink as the store both go into one Delta commit,
    so a batch that was re-cut after a crash (more or fewer events) is
    applied whole, once.
    """

    def func(df: DataFrame, batch_id: int) -> None:
        table, cleared = _merge_table(df, sink.full_document)
        sink.stage(table, cleared=cleared)

    return func
