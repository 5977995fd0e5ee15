"""Both Spark paths on a simulated sharded cluster, with the readers' mongos killed mid-stream.

Writes spread over both shards (hashed key); every event must reach the sink
exactly once, in resume-token order, although the mongos serving the stream
dies halfway.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
from bson import json_util
from spark_support import PANDAS_WARNING, ParquetSink, wait_for

from changestream.spark_adapter import foreach_batch, stream_opener
from changestream.stores import FileTokenStore
from changestream.testing import ShardedCluster

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]

TOTAL = 60


@pytest.fixture
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.1) as c:
        admin = pymongo.MongoClient(c.mongos_uri(0), directConnection=True)
        admin.admin.command("shardCollection", "sp.c", key={"_id": "hashed"})
        admin.close()
        yield c


def _holder(cluster: ShardedCluster) -> int:
    return (
        wait_for(
            lambda: next(
                (i + 1 for i in range(2) if cluster.mongos(i).deployment.cursors.ids()), None
            ),
            what="a mongos holding the stream's cursor",
        )
        - 1
    )


def _tokens(sink: ParquetSink) -> list[str]:
    """The ``resume_token`` column (the token's ``_data`` hex) in delivery order."""
    return [
        token
        for _, table in sorted(sink.batches().items())
        for token in table.column("resume_token").to_pylist()
    ]


def _check(sink: ParquetSink) -> None:
    ids = sink.ids()
    assert sorted(ids) == list(range(TOTAL)), f"every event exactly once: {ids}"
    tokens = _tokens(sink)
    assert tokens == sorted(tokens), "in resume-token order"


def test_foreach_batch_across_a_killed_mongos(
    spark: Any, cluster: ShardedCluster, tmp_path: Path
) -> None:
    reader: pymongo.MongoClient[Any] = pymongo.MongoClient(
        cluster.uri, serverSelectionTimeoutMS=2000
    )
    sink = ParquetSink(tmp_path / "out")
    store = FileTokenStore(tmp_path / "token.json")
    stop = threading.Event()
    open_stream = stream_opener(reader.sp.c, max_await_time_ms=100)
    runner = threading.Thread(
        target=foreach_batch,
        args=(spark, open_stream, sink, store),
        kwargs={"max_rows": 10, "max_seconds": 0.2, "stop_event": stop},
        daemon=True,
    )
    runner.start()
    victim = _holder(cluster)
    writer = pymongo.MongoClient(cluster.mongos_uri(1 - victim), directConnection=True)
    writer.sp.c.insert_many([{"_id": i} for i in range(TOTAL // 2)])
    wait_for(lambda: len(sink.ids()) >= 5, what="batches before the kill")
    cluster.kill_mongos(victim)
    writer.sp.c.insert_many([{"_id": i} for i in range(TOTAL // 2, TOTAL)])
    wait_for(lambda: len(sink.ids()) >= TOTAL, timeout=120, what="every event")
    stop.set()
    runner.join(60)
    _check(sink)
    writer.close()
    reader.close()


def test_streaming_source_across_a_killed_mongos(
    spark: Any, cluster: ShardedCluster, tmp_path: Path
) -> None:
    sink = ParquetSink(tmp_path / "out")
    now = cluster.clock.current()  # every later write is after it
    df = (
        spark.readStream.format("changestream")
        .option("uri", cluster.uri + "?serverSelectionTimeoutMS=2000")
        .option("database", "sp")
        .option("collection", "c")
        .option("max_await_time_ms", "100")
        .option("startup_mode", "timestamp")
        .option("start_at_operation_time", json_util.dumps(now))
        .load()
    )
    query = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        first = pymongo.MongoClient(cluster.mongos_uri(0), directConnection=True)
        first.sp.c.insert_many([{"_id": i} for i in range(TOTAL // 2)])
        first.close()
        wait_for(lambda: len(sink.ids()) >= 5, timeout=120, what="batches before the kill")
        victim = next((i for i in range(2) if cluster.mongos(i).deployment.cursors.ids()), 0)
        cluster.kill_mongos(victim)
        writer = pymongo.MongoClient(cluster.mongos_uri(1 - victim), directConnection=True)
        writer.sp.c.insert_many([{"_id": i} for i in range(TOTAL // 2, TOTAL)])
        writer.close()
        deadline = time.monotonic() + 120
        while len(sink.ids()) < TOTAL:
            assert query.exception() is None, query.exception()
            assert time.monotonic() < deadline, f"{len(sink.ids())} of {TOTAL} events"
            time.sleep(0.2)
    finally:
        query.stop()
    _check(sink)


def test_until_idle_waits_for_what_mongos_holds_back(spark: Any, tmp_path: Path) -> None:
    """A write to one shard is released by mongos only once the idle shard's no-op passes it;
    ``until_idle`` must wait for that, not end at the first empty getMore."""
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=3.0) as slow:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(slow.mongos_uri(0))
        client.admin.command("shardCollection", "sp.c", key={"_id": "hashed"})
        sink = ParquetSink(tmp_path / "out")
        store = FileTokenStore(tmp_path / "token.json")
        open_stream = stream_opener(client.sp.c, max_await_time_ms=50)
        first = foreach_batch(spark, open_stream, sink, store, until_idle=True)
        assert (first.reason, first.rows) == ("idle", 0)
        for round_ in range(3):  # each write lands on one shard; the other one is idle
            client.sp.c.insert_one({"_id": round_})
            result = foreach_batch(spark, open_stream, sink, store, until_idle=True)
            assert (result.reason, result.rows) == ("idle", 1), round_
        assert sink.ids() == [0, 1, 2]
        client.close()
