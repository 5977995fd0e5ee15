"""Consistent copies in Spark: the batch read at one cluster time, and ``startup_mode=snapshot``.

The sink applies rows as upserts keyed by ``document_key`` (batch order, then row
order); after the copy and the stream it must equal the collection, with every
document copied once and every write after T applied once.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.types import DataType
from spark_support import PANDAS_WARNING, ParquetSink, wait_for

from changestream.spark_adapter import event_ddl
from changestream.spark_adapter._config import SourceConfig
from changestream.spark_adapter._snapshot import SnapshotRange
from changestream.spark_adapter._source import ChangeStreamReader

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]


def _read(spark: Any, uri: str, coll: Any, **options: str) -> Any:
    reader = (
        spark.read.format("changestream")
        .option("uri", uri)
        .option("database", coll.database.name)
        .option("collection", coll.name)
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _applied(rows: list[dict[str, Any]]) -> tuple[dict[Any, Any], dict[Any, int]]:
    """Upserts keyed by document key; how often each key was copied (insert rows at T)."""
    docs: dict[Any, Any] = {}
    copied: dict[Any, int] = {}
    for row in rows:
        key = json.loads(row["document_key"])["_id"]
        op = row["operation_type"]
        if op == "delete":
            docs.pop(key, None)
            continue
        if row["resume_token"] == "snapshot":
            copied[key] = copied.get(key, 0) + 1
        doc = row["full_document"]
        if doc is None:
            docs.pop(key, None)
        else:
            docs[key] = json.loads(doc)
    return docs, copied


def _collection(coll: Any) -> dict[Any, Any]:
    return {d["_id"]: d for d in coll.find()}


def test_batch_read_at_one_cluster_time_split_by_id(spark: Any, mongodb_uri: str, coll: Any) -> None:
    coll.insert_many([{"_id": i, "v": 0} for i in range(200)])
    before = coll.database.command({"find": coll.name, "limit": 1, "readConcern": {"level": "snapshot"}})
    t = before["cursor"]["atClusterTime"]
    coll.update_many({}, {"$set": {"v": 1}})
    coll.insert_one({"_id": 1000, "v": 1})
    df = _read(spark, mongodb_uri, coll, snapshot_partitions="3")
    assert df.rdd.getNumPartitions() == 3
    rows = [r.asDict(recursive=True) for r in df.collect()]
    assert len(rows) == 201
    assert {r["operation_type"] for r in rows} == {"insert"}
    assert len({r["cluster_time"]["t"] * 2**32 + r["cluster_time"]["i"] for r in rows}) == 1
    docs, copied = _applied(rows)
    assert docs == _collection(coll) and set(copied.values()) == {1}
    old = _read(spark, mongodb_uri, coll, at_cluster_time=json.dumps({"$timestamp": {"t": t.time, "i": t.inc}}), snapshot_partitions="2")
    old_rows = [r.asDict(recursive=True) for r in old.collect()]
    assert {r["cluster_time"]["t"] for r in old_rows} == {t.time}
    old_docs, _ = _applied(old_rows)
    assert old_docs == {i: {"_id": i, "v": 0} for i in range(200)}
    only = _read(spark, mongodb_uri, coll, publish_full_document_only="true",
                 full_document_schema="_id INT, v INT")
    assert sorted(r["_id"] for r in only.collect()) == [*range(200), 1000]


def test_startup_mode_snapshot_copies_in_parallel_then_streams_exactly_once(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    coll.database.create_collection(coll.name)
    coll.insert_many([{"_id": i, "v": 0} for i in range(300)])
    stop = threading.Event()
    counter = {"next": 300}

    def writers() -> None:  # inserts, updates, replaces, deletes throughout the copy
        i = 0
        while not stop.is_set():
            coll.update_one({"_id": i % 300}, {"$inc": {"v": 1}})
            coll.insert_one({"_id": counter["next"], "v": 0})
            counter["next"] += 1
            coll.replace_one({"_id": (i * 7) % 300}, {"v": -1, "replaced": True})
            coll.delete_one({"_id": (i * 13) % 300 + 1})
            i += 1
            time.sleep(0.01)

    thread = threading.Thread(target=writers)
    thread.start()
    options = {
        "startup_mode": "snapshot", "snapshot_partitions": "4", "snapshot_ranges_per_batch": "2",
        "full_document": "updateLookup",
    }
    reader = (
        spark.readStream.format("changestream").option("uri", mongodb_uri)
        .option("database", coll.database.name).option("collection", coll.name)
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    checkpoint = tmp_path / "ck"
    query = reader.load().writeStream.foreachBatch(sink).option(
        "checkpointLocation", str(checkpoint)).trigger(processingTime="200 milliseconds").start()
    try:
        wait_for(lambda: len(sink.batches()) >= 2, what="the first copy batch")
    finally:
        query.stop()  # mid-copy (or just after): the restart continues from the checkpoint
    stop.set()
    thread.join()
    restarted = reader.load().writeStream.foreachBatch(sink).option(
        "checkpointLocation", str(checkpoint)).trigger(availableNow=True).start()
    assert restarted.awaitTermination(120), "the availableNow run did not end"
    rows = [row for _, table in sorted(sink.batches().items()) for row in table.to_pylist()]
    docs, copied = _applied(rows)
    assert docs == _collection(coll)
    assert set(copied.values()) == {1}, "a document was copied twice"
    tokens = [r["resume_token"] for r in rows if r["resume_token"] != "snapshot"]
    assert len(tokens) == len(set(tokens)), "an event was delivered twice"
    (t,) = {(r["cluster_time"]["t"], r["cluster_time"]["i"]) for r in rows if r["resume_token"] == "snapshot"}
    assert all((r["cluster_time"]["t"], r["cluster_time"]["i"]) > t
               for r in rows if r["resume_token"] != "snapshot")


def test_reader_offsets_record_range_progress(spark: Any, mongodb_uri: str, coll: Any) -> None:
    coll.insert_many([{"_id": i} for i in range(100)])
    config = SourceConfig.from_options({
        "uri": mongodb_uri, "database": coll.database.name, "collection": coll.name,
        "startup_mode": "snapshot", "snapshot_partitions": "4", "snapshot_ranges_per_batch": "1",
    })
    schema = DataType.fromDDL(event_ddl())
    first = ChangeStreamReader(config, schema)
    start = first.initialOffset()
    assert first.initialOffset() == start  # memoised
    end = first.latestOffset(start, None)  # type: ignore[arg-type]
    assert end["next"] == 1
    # a new driver process (restart): the offsets alone say where the copy stands
    second = ChangeStreamReader(config, schema)
    later = second.latestOffset(end, None)  # type: ignore[arg-type]
    parts = second.partitions(end, later)
    assert len(parts) == 1 and isinstance(parts[0], SnapshotRange)
    ids = [json.loads(row["document_key"])["_id"]
           for batch in second.read(parts[0]) for row in batch.to_pylist()]
    assert ids == sorted(ids) and ids and ids[0] > 0
    replay = [json.loads(row["document_key"])["_id"]
              for batch in first.read(first.partitions(end, later)[0]) for row in batch.to_pylist()]
    assert replay == ids
    offset = later
    while "snapshot" in offset:
        nxt = second.latestOffset(offset, None)  # type: ignore[arg-type]
        if "snapshot" not in nxt:
            assert second.partitions(offset, nxt) == []
        offset = nxt
    assert "token" in offset


def test_a_copy_batch_replayed_after_the_window_fails_clearly(
    spark: Any, mongodb_uri: str, coll: Any
) -> None:
    from pymongo import MongoClient

    from changestream.errors import ChangeStreamError

    coll.insert_many([{"_id": i} for i in range(20)])
    config = SourceConfig.from_options({
        "uri": mongodb_uri, "database": coll.database.name, "collection": coll.name,
        "startup_mode": "snapshot", "snapshot_partitions": "2",
    })
    reader = ChangeStreamReader(config, DataType.fromDDL(event_ddl()))
    start = reader.initialOffset()
    end = reader.latestOffset(start, None)  # type: ignore[arg-type]
    (t,) = {(p.at.time, p.at.inc) for p in reader.partitions(start, end)}
    admin: MongoClient[dict[str, Any]] = MongoClient(mongodb_uri)
    try:
        admin.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 0})
        deadline = time.monotonic() + 30
        while True:
            coll.insert_one({})  # writes move the oldest readable time past T
            try:
                list(reader.read(reader.partitions(start, end)[0]))
            except ChangeStreamError as exc:
                assert "minSnapshotHistoryWindowInSeconds" in str(exc)
                break
            assert time.monotonic() < deadline, "the read never became too old"
            time.sleep(0.3)
    finally:
        admin.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 300})
        admin.close()
    assert t
