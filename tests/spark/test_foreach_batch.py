"""``foreach_batch``: batching, token-store bookkeeping, idle advance, invalidate, history lost."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from bson.raw_bson import RawBSONDocument
from pymongo import MongoClient
from spark_support import PANDAS_WARNING, ParquetSink, wait_for

from changestream.spark_adapter import (
    ChangeStreamHistoryLostError,
    foreach_batch,
    stream_opener,
)
from changestream.spark_adapter._offsets import token_passed
from changestream.stores import FileTokenStore
from changestream.testing import ReplicaSet

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]


def _ids(df: Any) -> list[Any]:
    return [json.loads(row.document_key)["_id"] for row in df.collect()]


def test_first_run_pins_the_start_then_batches_by_rows_and_continues_ids(
    spark: Any, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    open_stream = stream_opener(coll, max_await_time_ms=50)
    first = foreach_batch(spark, open_stream, sink, store, until_idle=True)
    stored = store.load()
    assert first.batches == 0 and first.reason == "idle"
    assert stored is not None and stored.batch_id is None and stored.token == first.resume_token

    coll.insert_many([{"_id": i} for i in range(10)])
    second = foreach_batch(spark, open_stream, sink, store, max_rows=4, until_idle=True)
    assert [t.num_rows for t in sink.batches().values()] == [4, 4, 2]
    assert sink.ids() == list(range(10))
    assert (second.batches, second.rows, second.last_batch_id) == (3, 10, 2)
    assert store.load().batch_id == 2  # type: ignore[union-attr]

    coll.insert_many([{"_id": i} for i in range(10, 13)])
    third = foreach_batch(spark, open_stream, sink, store, max_rows=4, until_idle=True)
    assert third.last_batch_id == 3 and sorted(sink.batches()) == [0, 1, 2, 3]
    assert sink.ids() == list(range(13))


def test_failed_func_stores_nothing_and_the_retry_gets_the_same_batch(
    spark: Any, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    open_stream = stream_opener(coll, max_await_time_ms=50, document_class=RawBSONDocument)
    foreach_batch(spark, open_stream, sink, store, until_idle=True)
    pinned = store.load()
    coll.insert_many([{"_id": i, "v": "x" * i} for i in range(6)])
    attempts: list[tuple[int, list[Any]]] = []

    def failing(df: Any, batch_id: int) -> None:
        attempts.append((batch_id, _ids(df)))
        raise RuntimeError("sink unavailable")

    with pytest.raises(RuntimeError, match="sink unavailable"):
        foreach_batch(spark, open_stream, failing, store, until_idle=True)
    assert store.load() == pinned
    result = foreach_batch(spark, open_stream, sink, store, until_idle=True)
    assert attempts == [(0, list(range(6)))]
    assert result.last_batch_id == 0 and sink.ids() == list(range(6))
    row = sink.batches()[0].to_pylist()[5]
    assert json.loads(row["full_document"]) == {"_id": 5, "v": "xxxxx"}
    assert row["operation_type"] == "insert" and row["cluster_time"]["i"] >= 0


def test_batches_are_cut_by_time_and_stop_event_ends_the_run(
    spark: Any, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    open_stream = stream_opener(coll, max_await_time_ms=50)
    foreach_batch(spark, open_stream, sink, store, until_idle=True)
    stop = threading.Event()

    def produce() -> None:
        for i in range(30):
            coll.insert_one({"_id": i})
            time.sleep(0.05)
        try:  # stop once all arrived (the open batch is delivered first), however loaded
            wait_for(lambda: len(sink.ids()) >= 30, timeout=60, what="30 events in the sink")
        finally:
            stop.set()

    producer = threading.Thread(target=produce)
    producer.start()
    result = foreach_batch(
        spark, open_stream, sink, store, max_rows=1000, max_seconds=0.3, stop_event=stop
    )
    producer.join()
    sizes = [t.num_rows for t in sink.batches().values()]
    assert result.reason == "stopped"
    assert len(sizes) >= 3 and max(sizes) < 30, sizes
    assert sink.ids() == list(range(30))


def test_idle_stream_stores_the_post_batch_resume_token(
    spark: Any, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    open_stream = stream_opener(coll, max_await_time_ms=50)
    foreach_batch(spark, open_stream, sink, store, until_idle=True)
    pinned = store.load()
    assert pinned is not None
    coll.database["elsewhere"].insert_one({"unrelated": True})  # moves the oplog, not the stream
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    result = foreach_batch(spark, open_stream, sink, store, idle_seconds=0.1, stop_event=stop)
    stored = store.load()
    assert result.batches == 0 and sink.batches() == {}
    assert stored is not None and stored.batch_id is None
    assert token_passed(stored.token, pinned.token)


def test_invalidate_ends_the_run_and_the_next_run_continues_after_it(
    spark: Any, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    store = FileTokenStore(tmp_path / "token.json")
    open_stream = stream_opener(coll, max_await_time_ms=50)
    foreach_batch(spark, open_stream, sink, store, until_idle=True)
    coll.insert_many([{"_id": i} for i in range(3)])
    coll.drop()
    result = foreach_batch(spark, open_stream, sink, store, until_idle=True)
    rows = sink.batches()[0].to_pylist()
    assert result.reason == "invalidated"
    assert [r["operation_type"] for r in rows] == ["insert"] * 3 + ["drop"]
    coll.insert_one({"_id": "again"})
    after = foreach_batch(spark, open_stream, sink, store, until_idle=True)
    assert after.reason == "idle" and after.last_batch_id == 1
    assert [r["document_key"] for r in sink.batches()[1].to_pylist()] == ['{"_id": "again"}']


def test_history_lost_fails_with_recovery_steps(spark: Any, tmp_path: Path) -> None:
    if os.environ.get("MONGODB_URI"):
        pytest.skip("needs the simulator's small oplog (MONGODB_URI is set)")
    with ReplicaSet("8.0", oplog_max_entries=20) as rs, MongoClient(rs.uri) as client:
        coll = client.db.events
        store = FileTokenStore(tmp_path / "token.json")
        open_stream = stream_opener(coll, max_await_time_ms=50)
        foreach_batch(spark, open_stream, lambda df, i: None, store, until_idle=True)
        coll.insert_many([{"_id": i} for i in range(100)])
        with pytest.raises(ChangeStreamHistoryLostError, match="token store") as caught:
            foreach_batch(spark, open_stream, lambda df, i: None, store, until_idle=True)
        assert "code 286" in str(caught.value)
        assert caught.value.token == store.load().token  # type: ignore[union-attr]


def test_until_idle_never_ends_on_a_new_streams_start_token() -> None:
    """A new stream's first postBatchResumeToken is a high-water mark one tick past the
    server's time: a write made at exactly that time comes after it. Stored as the idle
    position, it made the next call end at its first empty getMore without that write."""
    import uuid

    from bson import Timestamp

    from changestream.spark_adapter._batches import _Cuts
    from changestream.testing.changestreams.resume_token import (
        encode_event_token,
        encode_token,
        high_water_mark,
    )

    at = Timestamp(1_800_000_000, 22)
    start = encode_token(high_water_mark(at, 2))
    write = encode_event_token(at, 2, 0, uuid.uuid4(), "insert", {"_id": 0}, None)
    later = encode_token(high_water_mark(Timestamp(at.time, at.inc + 1), 2))
    cuts = _Cuts(max_rows=10, max_seconds=1.0, idle_seconds=60.0, until_idle=True,
                 stop_event=None, called_at=at, start=start)
    assert not cuts.caught_up(start), "the start token is a promise, not a scan"
    assert cuts.caught_up(write) and cuts.caught_up(later)
    resumed = _Cuts(max_rows=10, max_seconds=1.0, idle_seconds=60.0, until_idle=True,
                    stop_event=None, called_at=at)
    assert resumed.caught_up(start), "a scanned mark at the call's time is caught up"
    assert not resumed.caught_up(encode_token(high_water_mark(Timestamp(at.time, 21), 2)))
