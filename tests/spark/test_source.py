"""The ``changestream`` streaming data source: startup modes, row limits, availableNow, replay,
restart after ``stop()``, invalidate and history lost.

Most tests run real streaming queries (``local[2]``, foreachBatch into a
Parquet file per batch id); the reader-contract tests call the reader the
way Spark's driver runner does, without a query, to keep the suite fast.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from bson import json_util
from pymongo import MongoClient
from pyspark.errors import StreamingQueryException
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
from pyspark.sql.types import DataType
from spark_support import PANDAS_WARNING, ParquetSink, current_token, wait_for

import changestream
from changestream.spark_adapter import event_ddl
from changestream.spark_adapter._config import SourceConfig
from changestream.spark_adapter._offsets import offset_token, token_passed
from changestream.spark_adapter._source import ChangeStreamReader, TokenRange
from changestream.testing import ReplicaSet

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]


def _stream(spark: Any, uri: str, coll: Any, **options: str) -> Any:
    reader = (
        spark.readStream.format("changestream")
        .option("uri", uri)
        .option("database", coll.database.name)
        .option("collection", coll.name)
    )
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def _start(df: Any, sink: Any, checkpoint: Path, *, available_now: bool = False) -> Any:
    writer = df.writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
    if available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime="200 milliseconds").start()


def _finish(query: Any, timeout: float = 60) -> None:
    """Wait for an availableNow query to end by itself (fail, never hang, if it does not)."""
    ended = query.awaitTermination(timeout)
    if not ended:
        query.stop()
        pytest.fail(f"the availableNow query did not end within {timeout}s")


def _json(token: Any) -> str:
    return changestream.token_to_json(token)


# -- queries ------------------------------------------------------------------------------------
def test_latest_skips_older_events_and_row_limit_splits_batches(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    coll.insert_many([{"_id": -i} for i in range(1, 4)])
    query = _start(_stream(spark, mongodb_uri, coll, max_rows_per_batch="4"), sink, tmp_path / "ck")
    try:
        wait_for(lambda: 0 in sink.batches(), what="the (empty) first batch")
        coll.insert_many([{"_id": i} for i in range(10)])
        wait_for(lambda: len(sink.ids()) >= 10, what="10 events")
    finally:
        query.stop()
    sizes = [t.num_rows for t in sink.batches().values() if t.num_rows]
    assert sizes == [4, 4, 2]
    assert sink.ids() == list(range(10))


def test_timestamp_mode_with_available_now_ends_by_itself(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    coll.insert_one({"_id": "before"})
    with changestream.watch(coll, max_await_time_ms=50) as stream:
        coll.insert_many([{"_id": i} for i in range(10)])
        first = stream.try_next()
    start = first["clusterTime"]
    coll.insert_one({"_id": "after-start"})
    df = _stream(
        spark,
        mongodb_uri,
        coll,
        startup_mode="timestamp",
        start_at_operation_time=json_util.dumps(start),
        max_rows_per_batch="4",
    )
    _finish(_start(df, sink, tmp_path / "ck", available_now=True))
    assert [t.num_rows for t in sink.batches().values() if t.num_rows] == [4, 4, 3]
    assert sink.ids() == [*range(10), "after-start"]


def test_token_mode_starts_after_the_token_and_epoch_seconds_parse(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    with changestream.watch(coll, max_await_time_ms=50) as stream:
        coll.insert_many([{"_id": i} for i in range(6)])
        tokens = [stream.next()["_id"] for _ in range(6)]
    df = _stream(spark, mongodb_uri, coll, startup_mode="token", start_after=_json(tokens[2]))
    _finish(_start(df, sink, tmp_path / "ck", available_now=True))
    assert sink.ids() == [3, 4, 5]
    seconds = SourceConfig.from_options(
        {"uri": "mongodb://x", "startup_mode": "timestamp", "start_at_operation_time": "1700000000"}
    ).start_at_operation_time
    assert seconds is not None and (seconds.time, seconds.inc) == (1700000000, 0)


def test_replay_of_a_failed_batch_yields_identical_rows(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    start = current_token(coll)
    coll.insert_many([{"_id": i, "n": i} for i in range(9)])
    seen: dict[int, list[Any]] = {}

    def fail_batch_one_once(df: Any, batch_id: int) -> None:
        rows = [(r.resume_token, r.document_key, r.full_document) for r in df.collect()]
        if batch_id == 1 and 1 not in seen:
            seen[1] = rows
            raise RuntimeError("sink failed on batch 1")
        sink(df, batch_id)

    options = {"startup_mode": "token", "start_after": _json(start), "max_rows_per_batch": "4"}
    first = _start(
        _stream(spark, mongodb_uri, coll, **options),
        fail_batch_one_once,
        tmp_path / "ck",
        available_now=True,
    )
    with pytest.raises(StreamingQueryException, match="sink failed on batch 1"):
        first.awaitTermination(60)
    coll.insert_many([{"_id": i, "n": i} for i in range(9, 12)])  # must not leak into batch 1
    _finish(
        _start(
            _stream(spark, mongodb_uri, coll, **options),
            fail_batch_one_once,
            tmp_path / "ck",
            available_now=True,
        )
    )
    replayed = sink.batches()[1].to_pylist()
    assert [(r["resume_token"], r["document_key"], r["full_document"]) for r in replayed] == seen[1]
    assert sink.ids() == list(range(12))


def test_stopped_query_restarts_from_its_checkpoint_exactly_once(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    start = current_token(coll)
    total = 400

    def produce() -> None:
        for i in range(0, total, 10):
            coll.insert_many([{"_id": j} for j in range(i, i + 10)])
            time.sleep(0.05)

    producer = threading.Thread(target=produce)
    producer.start()
    options = {"startup_mode": "token", "start_after": _json(start), "max_rows_per_batch": "30"}
    query = _start(_stream(spark, mongodb_uri, coll, **options), sink, tmp_path / "ck")
    wait_for(lambda: len(sink.batches()) >= 3, what="three batches")
    query.stop()  # mid-run: the producer is still writing
    assert len(sink.ids()) < total
    producer.join()
    _finish(
        _start(
            _stream(spark, mongodb_uri, coll, **options), sink, tmp_path / "ck", available_now=True
        )
    )
    ids = sink.ids()
    assert len(ids) == total and sorted(ids) == list(range(total))


def test_invalidate_fails_the_query_after_delivering_everything_before_it(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    start = current_token(coll)
    coll.insert_many([{"_id": i} for i in range(3)])
    coll.drop()
    df = _stream(spark, mongodb_uri, coll, startup_mode="token", start_after=_json(start))
    query = _start(df, sink, tmp_path / "ck")
    with pytest.raises(StreamingQueryException, match="invalidated") as caught:
        query.awaitTermination(60)
    assert "start_after=" in str(caught.value)
    rows = [r for t in sink.batches().values() for r in t.to_pylist()]
    assert [r["operation_type"] for r in rows] == ["insert"] * 3 + ["drop"]


def test_history_lost_fails_the_query_with_recovery_steps(
    spark: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    if os.environ.get("MONGODB_URI"):
        pytest.skip("needs the simulator's small oplog (MONGODB_URI is set)")
    with ReplicaSet("8.0", oplog_max_entries=20) as rs, MongoClient(rs.uri) as client:
        coll = client.db.events
        start = current_token(coll)
        coll.insert_many([{"_id": i} for i in range(50)])
        df = _stream(spark, rs.uri, coll, startup_mode="token", start_after=_json(start))
        query = _start(df, sink, tmp_path / "ck")
        with pytest.raises(StreamingQueryException, match="ChangeStreamHistoryLost") as caught:
            query.awaitTermination(60)
    assert "NEW checkpointLocation" in str(caught.value)


def test_typed_full_documents_published_alone(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    start = current_token(coll)
    coll.insert_many([{"_id": 1, "qty": 5, "tags": ["a"]}, {"_id": 2, "qty": 7}])
    coll.update_one({"_id": 1}, {"$inc": {"qty": 1}})
    coll.delete_one({"_id": 2})
    df = _stream(
        spark,
        mongodb_uri,
        coll,
        startup_mode="token",
        start_after=_json(start),
        full_document_schema="_id INT, qty BIGINT, tags ARRAY<STRING>",
        publish_full_document_only="true",
    )
    assert df.columns == ["_id", "qty", "tags"]
    _finish(_start(df, sink, tmp_path / "ck", available_now=True))
    rows = [r for t in sink.batches().values() for r in t.to_pylist()]
    assert rows == [
        {"_id": 1, "qty": 5, "tags": ["a"]},
        {"_id": 2, "qty": 7, "tags": None},
        {"_id": 1, "qty": 6, "tags": ["a"]},  # the update, looked up; the delete has no row
    ]


# -- the reader contract, called as Spark's driver runner calls it ---------------------------------
def _reader(uri: str, coll: Any, **options: str) -> ChangeStreamReader:
    config = SourceConfig.from_options(
        {"uri": uri, "database": coll.database.name, "collection": coll.name, **options}
    )
    schema = DataType.fromDDL(event_ddl(config.full_document_schema))
    return ChangeStreamReader(config, schema)


def _rows(reader: ChangeStreamReader, start: dict[str, Any], end: dict[str, Any]) -> list[Any]:
    return [
        row
        for partition in reader.partitions(start, end)
        for batch in reader.read(partition)
        for row in batch.to_pylist()
    ]


def test_reader_memoises_initial_offset_and_replays_ranges_identically(
    spark: Any, mongodb_uri: str, coll: Any
) -> None:
    reader = _reader(mongodb_uri, coll, arrow_batch_rows="2")
    initial = reader.initialOffset()
    coll.insert_many([{"_id": i} for i in range(5)])
    assert reader.initialOffset() == initial  # the second call must not move the start
    assert reader.partitions(initial, initial) == []
    end = reader.latestOffset(initial, ReadMaxRows(3))
    first = _rows(reader, initial, end)
    assert [json.loads(r["document_key"])["_id"] for r in first] == [0, 1, 2]
    coll.insert_many([{"_id": i} for i in range(5, 8)])
    assert _rows(reader, initial, end) == first  # a replay after more writes: same rows
    shipped = reader.partitions(initial, end)
    assert shipped and all(p.data is not None for p in shipped)  # the driver's events
    # A range the driver holds no events for (a new run replaying its checkpoint) is read
    # by the executor from the server, after the start token and up to the end token.
    fresh = _reader(mongodb_uri, coll, arrow_batch_rows="2")
    assert [
        row for batch in fresh.read(TokenRange(initial, end)) for row in batch.to_pylist()
    ] == first
    rest = reader.latestOffset(end, ReadAllAvailable())
    assert [json.loads(r["document_key"])["_id"] for r in _rows(reader, end, rest)] == list(
        range(3, 8)
    )
    assert reader.latestOffset(rest, ReadAllAvailable()) == rest


def test_reader_advances_to_the_post_batch_token_when_idle(
    spark: Any, mongodb_uri: str, coll: Any
) -> None:
    reader = _reader(mongodb_uri, coll, idle_advance_seconds="0")
    initial = reader.initialOffset()
    coll.database["elsewhere"].insert_one({"unrelated": True})
    end = reader.latestOffset(initial, ReadAllAvailable())
    assert end.get("idle") is True
    assert token_passed(offset_token(end), offset_token(initial))
    assert reader.partitions(initial, end) == []  # nothing to read in an idle range
    coll.insert_one({"_id": "next"})
    after = reader.latestOffset(end, ReadAllAvailable())
    assert [r["document_key"] for r in _rows(reader, end, after)] == ['{"_id": "next"}']
    reader.stop()  # closes the driver stream; a later call reopens it
    again = reader.latestOffset(after, ReadAllAvailable())
    assert again == after or again.get("idle")  # (a periodic no-op may move the token)


def test_reader_delivers_ddl_and_rename_events_as_rows(
    spark: Any, mongodb_uri: str, coll: Any
) -> None:
    reader = _reader(mongodb_uri, coll, show_expanded_events="true")
    initial = reader.initialOffset()
    coll.insert_one({"_id": 1})
    coll.create_index("a")
    coll.rename(f"{coll.name}_renamed")
    end = reader.latestOffset(initial, ReadAllAvailable())
    rows = _rows(reader, initial, end)
    assert [r["operation_type"] for r in rows] == ["create", "insert", "createIndexes", "rename"]
    assert json.loads(rows[2]["operation_description"])["indexes"][0]["key"] == {"a": 1}
    assert (rows[3]["to_database"], rows[3]["to_collection"]) == (
        coll.database.name,
        f"{coll.name}_renamed",
    )


def _keys(rows: list[Any]) -> list[Any]:
    return [json.loads(r["document_key"])["_id"] for r in rows]


def test_reader_splits_a_transaction_exactly_at_the_row_limit(
    spark: Any, mongodb_uri: str, coll: Any
) -> None:
    reader = _reader(mongodb_uri, coll)
    offset = reader.initialOffset()
    client = coll.database.client
    with client.start_session() as session, session.start_transaction():
        for i in range(5):
            coll.insert_one({"_id": i}, session=session)
    batches = []
    while (end := reader.latestOffset(offset, ReadMaxRows(2))) != offset:
        batches.append(_rows(reader, offset, end))
        offset = end
    assert [_keys(rows) for rows in batches] == [[0, 1], [2, 3], [4]]
    first = batches[0][0]
    assert first["txn_number"] == 1 and json.loads(first["lsid"])["id"]
    assert {r["cluster_time"]["i"] for rows in batches for r in rows} == {
        first["cluster_time"]["i"]
    }


def test_reader_scopes_and_pipeline_filter(spark: Any, mongodb_uri: str, coll: Any) -> None:
    database_wide = _reader(mongodb_uri, coll, collection="")
    cluster_wide = SourceConfig.from_options({"uri": mongodb_uri})
    assert cluster_wide.database is None and cluster_wide.collection is None
    cluster = ChangeStreamReader(cluster_wide, DataType.fromDDL(event_ddl()))
    inserts_only = _reader(mongodb_uri, coll, pipeline='[{"$match": {"operationType": "insert"}}]')
    starts = [r.initialOffset() for r in (database_wide, cluster, inserts_only)]
    coll.insert_one({"_id": 1})
    coll.update_one({"_id": 1}, {"$set": {"a": 1}})
    coll.database["other"].insert_one({"_id": 2})
    coll.insert_one({"_id": 3})
    seen = []
    for reader, start in zip((database_wide, cluster, inserts_only), starts, strict=True):
        end = reader.latestOffset(start, ReadAllAvailable())
        seen.append([(r["collection"], r["operation_type"]) for r in _rows(reader, start, end)])
    name = coll.name
    assert seen[0] == [(name, "insert"), (name, "update"), ("other", "insert"), (name, "insert")]
    assert [row for row in seen[1] if row[0] in (name, "other")] == seen[0]
    assert seen[2] == [(name, "insert"), (name, "insert")]


def test_reader_cuts_the_same_batch_when_asked_twice_and_loses_nothing(
    spark: Any, mongodb_uri: str, coll: Any
) -> None:
    reader = _reader(mongodb_uri, coll)
    initial = reader.initialOffset()
    coll.insert_many([{"_id": i} for i in range(5)])
    first = reader.latestOffset(initial, ReadMaxRows(3))
    # Asked again before planning (the driver's buffer must put the cut events back).
    assert reader.latestOffset(initial, ReadMaxRows(3)) == first
    assert _keys(_rows(reader, initial, first)) == [0, 1, 2]
    rest = reader.latestOffset(first, ReadAllAvailable())
    assert _keys(_rows(reader, first, rest)) == [3, 4]
    # A range planned earlier, asked for again after the buffer moved on: read from the server.
    assert _keys(_rows(reader, initial, first)) == [0, 1, 2]
    reader.stop()


_SETTLE = """
import gc, sys, types
from changestream.spark_adapter._source import settle_worker
sys.modules["__main__"].__spec__ = types.SimpleNamespace(name={main!r})
settle_worker()
settle_worker()  # once per process
print(gc.get_freeze_count(), len(gc.get_objects()))
"""


@pytest.mark.parametrize("main", ["pyspark.daemon", "pyspark.worker", "pytest"])
def test_a_spark_worker_keeps_its_imports_out_of_each_task_s_collection(main: str) -> None:
    # PySpark's daemon runs gc.collect() after every task of a reused worker: with pyarrow,
    # PyMongo and this package imported that walked ~90,000 objects (55-90 ms a task).
    # After the first read() of a worker they are frozen; any other process is left alone.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _SETTLE.format(main=main)],
        capture_output=True, text=True, check=True, env=os.environ,
    ).stdout.split()
    frozen, tracked = int(out[0]), int(out[1])
    if main == "pytest":
        assert frozen == 0 and tracked > 20_000
    else:
        assert frozen > 20_000 and tracked < 1_000
