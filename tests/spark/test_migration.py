"""Coming from mongo-spark: its option names, ``infer_schema=true``, and one query routing
the rows of several collections to one output folder per namespace (``partitionBy``)."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from bson import json_util
from bson.timestamp import Timestamp
from spark_support import PANDAS_WARNING, ParquetSink

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]


def _operation_time(coll: Any) -> str:
    """Just after the last write so far, in the connector's Extended JSON form."""
    with coll.database.client.start_session() as session:
        coll.database.command("ping", session=session)
        now = session.operation_time
        assert now is not None
        return str(json_util.dumps(Timestamp(now.time, now.inc + 1)))


def _run(df: Any, sink: Any, checkpoint: Path) -> None:
    query = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    if not query.awaitTermination(120):
        query.stop()
        pytest.fail("the availableNow query did not end within 120 s")


def test_connector_option_names_and_an_inferred_schema(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    coll.insert_many([
        {"_id": 1, "item": "apple", "qty": 3, "price": 1.5, "meta": {"origin": "NO"},
         "at": datetime.datetime(2026, 1, 2, 3, 4, 5)},
        {"_id": 2, "item": "pear", "qty": 5_000_000_000, "price": 2},
    ])
    start = _operation_time(coll)
    coll.insert_one({"_id": 3, "item": "plum", "qty": 7, "price": 0.5, "meta": {"origin": "SE"}})
    coll.update_one({"_id": 1}, {"$set": {"qty": 4}})
    options = {
        "connection.uri": mongodb_uri,
        "database": coll.database.name,
        "collection": coll.name,
        "change.stream.publish.full.document.only": "true",
        "change.stream.startup.mode": "timestamp",
        "change.stream.startup.mode.timestamp.start.at.operation.time": start,
        "infer_schema": "true",
    }
    reader = spark.readStream.format("changestream")
    for key, value in options.items():
        reader = reader.option(key, value)
    df = reader.load()
    assert df.schema.simpleString() == (
        "struct<_id:int,item:string,qty:bigint,price:double,meta:struct<origin:string>,"
        "at:timestamp>"
    )
    _run(df, sink, tmp_path / "ck")
    rows = [row for table in sink.batches().values() for row in table.to_pylist()]
    # publish.full.document.only implies updateLookup: the update arrives as the whole document.
    assert [(r["_id"], r["item"], r["qty"], r["meta"]) for r in rows] == [
        (3, "plum", 7, {"origin": "SE"}),
        (1, "apple", 4, {"origin": "NO"}),
    ]


def test_a_database_source_routes_rows_per_namespace_with_partition_by(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path
) -> None:
    database = coll.database
    start = _operation_time(coll)
    for name, count in (("orders", 3), ("users", 2), ("audit", 4)):
        database[name].insert_many([{"n": i} for i in range(count)])
    output = tmp_path / "by-namespace"

    def route(df: Any, batch_id: int) -> None:
        # One folder per collection; "append" per batch (an idempotent sink would
        # replace the batch's own files instead).
        df.write.mode("append").partitionBy("database", "collection").parquet(str(output))

    df = (
        spark.readStream.format("changestream")
        .option("uri", mongodb_uri)
        .option("database", database.name)
        .option("namespaces", "orders,users")  # audit is filtered out on the server
        .option("startup_mode", "timestamp")
        .option("start_at_operation_time", start)
        .load()
    )
    _run(df, route, tmp_path / "ck")
    folders = sorted(p.relative_to(output).as_posix() for p in output.glob("*/*") if p.is_dir())
    assert folders == [
        f"database={database.name}/collection=orders",
        f"database={database.name}/collection=users",
    ]
    counts = {
        folder.name: pq.read_table(folder).num_rows
        for folder in (output / f"database={database.name}").iterdir()
    }
    assert counts == {"collection=orders": 3, "collection=users": 2}
