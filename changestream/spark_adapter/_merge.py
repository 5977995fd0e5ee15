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
    update without ``full_document`` raises :class:`changestream.MissingDocumentError`
    (open the stream with ``full_document`` ``updateLookup`` or ``required``).
    Rows before a ``drop``, ``rename`` or ``dropDatabase`` of their collection
    are left out (see :func:`clear_token`). ``full_document`` must be the JSON column
    (no ``full_document_schema``).
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


def _checked(merged: DataFrame) -> DataFrame:
    missing = merged.where(F.col("op").isNull()).select("key", "operation_type", "resume_token")
    first = missing.first()
    if first is not None:
        raise changestream.MissingDocumentError(
            f"the {first['operation_type']} event of _id {first['key']} (token "
            f"{first['resume_token']}) has no full_document, so the document after it is "
            "unknown: read with full_document='updateLookup' (the current document) or "
            "'required' (post-images: enable changeStreamPreAndPostImages), and pass the same "
            "full_document= here"
        )
    return merged


def clear_token(df: DataFrame) -> str | None:
    """The token of the batch's last ``drop``/``rename``/``dropDatabase`` (``None``: none)."""
    row = df.where(F.col("operation_type").isin(*_CLEARS)).agg(F.max("resume_token")).first()
    return None if row is None else row[0]


def _merge_table(df: DataFrame, full_document: str | None) -> tuple[Any, bool]:
    """The sink's merge table (``_key``, ``_op``, ``document``) and whether the batch cleared."""
    from changestream.delta import DOCUMENT, KEY, OP

    namespaces = df.select("database", "collection").where(
        F.col("collection").isNotNull()).distinct().count()
    if namespaces > 1:
        raise ValueError("a Delta sink mirrors one collection; filter the batch by "
                         "database and collection first")
    merged = _checked(merge_ready(df, full_document=full_document))
    table = merged.select(
        F.col("key").alias(KEY), F.col("op").alias(OP), F.col("document").alias(DOCUMENT)
    ).toArrow()
    return table, clear_token(df) is not None


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
