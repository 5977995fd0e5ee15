"""Snapshot reads through a URI listing two mongoses: each getMore reaches the mongos holding
its cursor.

A mongos keeps its own cursors, so a getMore sent to the other one fails (CursorNotFound,
43). ``Database.command`` selects a server on every call; the client here makes that
selection alternate between the mongoses (``server_selector``), so a read that lets the
getMore select again fails at its first getMore instead of half the time. Every copy
below needs several batches: ``snapshot_then_watch`` (sync and async, its default batch of
1000), the parallel first copy, a re-snapshot's chunks and ``verify`` (its default batch of
10,000).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient
from snapshot_support import (
    Alternate,
    GetMores,
    Sink,
    Writer,
    collection_state,
    make_collection,
)

import changestream
from changestream._snapshot import SnapshotBatches
from changestream.testing import ShardedCluster

WATCH = {"full_document": "required", "max_await_time_ms": 50}
DOCS = 3500
"""Four batches of ``snapshot_then_watch``'s default 1000: three getMores."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.1) as c:
        assert len(c.mongoses) == 2 and len(c.uri.split(",")) == 2
        yield c


def _client(cluster: ShardedCluster, *extra: Any) -> MongoClient[dict[str, Any]]:
    return MongoClient(cluster.uri, server_selector=Alternate(), event_listeners=list(extra),
                       serverSelectionTimeoutMS=10000)


def _sharded(cluster: ShardedCluster, name: str, n: int) -> None:
    """``db.<name>`` range-sharded on ``_id``, split at ``n // 2`` over both shards, ``n`` docs."""
    with MongoClient(cluster.mongos_uri(0), directConnection=True) as one:
        ns = f"db.{name}"
        make_collection(one.db, name, 0)  # post-images: full_document="required"
        one.admin.command("shardCollection", ns, key={"_id": 1})
        one.admin.command("split", ns, middle={"_id": n // 2})
        one.admin.command("moveChunk", ns, find={"_id": n}, to=cluster.shard_names[1])
        one.admin.command("moveChunk", ns, find={"_id": 0}, to=cluster.shard_names[0])
        one.db[name].insert_many([{"_id": i, "v": 0} for i in range(n)])


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _drain(next_change: Callable[[], Any], sink: Sink, writer: Writer) -> None:
    deadline = time.monotonic() + 60
    while len(sink.data_events()) < writer.events:
        assert time.monotonic() < deadline, f"{len(sink.data_events())} of {writer.events}"
        change = next_change()
        if change is not None:
            sink.apply(change)


def test_snapshot_then_watch_through_two_mongoses(cluster: ShardedCluster) -> None:
    _sharded(cluster, "stw", DOCS)
    listener = GetMores()
    with _client(cluster, listener) as client:
        coll = client.db.stw
        writer, sink = Writer(coll, DOCS), Sink()
        with changestream.snapshot_then_watch(coll, **WATCH) as stream:
            while stream.copying:
                record = stream.try_next()
                if record is None:
                    break
                sink.apply(record)
                if len(sink.copied) % 500 == 0:
                    writer.write(3)
            writer.write(10)
            _drain(stream.try_next, sink, writer)
        assert set(sink.copied) == set(range(DOCS)) and max(sink.copied.values()) == 1
        assert sink.docs == collection_state(coll)
    assert listener.check() >= 3


def test_async_snapshot_then_watch_through_two_mongoses(cluster: ShardedCluster) -> None:
    _sharded(cluster, "astw", DOCS)
    listener = GetMores()
    sink = Sink()
    with _client(cluster) as sync:
        writer = Writer(sync.db.astw, DOCS)

        async def main() -> None:
            client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(
                cluster.uri, server_selector=Alternate(), event_listeners=[listener])
            try:
                async with await changestream.aio.snapshot_then_watch(
                    client.db.astw, **WATCH
                ) as stream:
                    while stream.copying:
                        record = await stream.try_next()
                        if record is None:
                            break
                        sink.apply(record)
                    await asyncio.to_thread(writer.write, 10)
                    deadline = time.monotonic() + 60
                    while len(sink.data_events()) < writer.events:
                        assert time.monotonic() < deadline
                        change = await stream.try_next()
                        if change is not None:
                            sink.apply(change)
            finally:
                await client.close()

        asyncio.run(asyncio.wait_for(main(), 120))
        assert set(sink.copied) == set(range(DOCS)) and max(sink.copied.values()) == 1
        assert sink.docs == collection_state(sync.db.astw)
    assert listener.check() >= 3


class _QuarterBatches(SnapshotBatches):
    """A re-snapshot chunk's read in four batches (it asks for the whole chunk in one, which
    the simulator's mongos then never continues with a getMore), counting its getMores."""

    get_mores = 0

    def __init__(self, read: Callable[[dict[str, Any]], Mapping[str, Any]], coll: str,
                 pipeline: Any, *, at: Any = None, batch_size: int = 10_000) -> None:
        def counted(command: dict[str, Any]) -> Mapping[str, Any]:
            if "getMore" in command:
                _QuarterBatches.get_mores += 1
            return read(command)

        super().__init__(counted, coll, pipeline, at=at, batch_size=max(1, batch_size // 4))


def test_parallel_copy_resnapshot_and_verify_through_two_mongoses(
    cluster: ShardedCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parallel copy's ranges, a re-snapshot's chunks (read in four batches each) and
    ``verify`` (12,000 documents: two batches at its default 10,000) each read several
    batches through both mongoses."""
    pytest.importorskip("deltalake", reason="the delta extra is not installed")
    from delta_support import assert_mirrors, table_state

    from changestream import _delta_resnapshot
    from changestream._delta_resnapshot import DeltaResnapshot
    from changestream._parallel_copy import parallel_copy
    from changestream.delta import DeltaSink

    n = 12_000
    _sharded(cluster, "par", n)
    listener = GetMores()
    with _client(cluster, listener) as client:
        coll = client.db.par
        path = tmp_path / "t"
        sink = DeltaSink(str(path), full_document="updateLookup")
        result = parallel_copy(coll, sink, readers=2, batch=1000)
        assert result.documents == n
        copied = listener.check()
        assert copied >= n // 1000 - result.ranges
        monkeypatch.setattr(_delta_resnapshot, "SnapshotBatches", _QuarterBatches)
        _QuarterBatches.get_mores = 0
        mirror = DeltaResnapshot(sink, coll, chunk_size=1000, poll_seconds=0)
        stop = threading.Event()
        runner = threading.Thread(target=changestream.consume, args=(coll, mirror, mirror), kwargs={
            "initial_snapshot": True, "save_interval": 0.2, "stop": stop,
            "watch_options": {"full_document": "updateLookup", "max_await_time_ms": 100}},
            daemon=True)
        runner.start()
        try:
            coll.delete_many({"_id": {"$lt": 100}})
            version = sink.request_snapshot()
            coll.update_many({"_id": {"$gte": n - 100}}, {"$set": {"late": True}})
            wait_for(lambda: mirror.progress.request == version and not mirror.progress.active,
                     "the re-snapshot")
            wait_for(lambda: table_state(path) == {d["_id"]: d for d in coll.find()},
                     "the table to equal the collection")
        finally:
            stop.set()
            runner.join(60)
        assert mirror.progress.chunks >= 10
        assert _QuarterBatches.get_mores >= 3 * 10  # three per full chunk, each on its mongos
        assert listener.check() > copied
        before = listener.check()
        verification = DeltaSink(str(path), full_document="updateLookup").verify(coll)
        assert verification.ok, verification
        assert listener.check() > before  # verify's own getMore
        assert_mirrors(path, coll, "changestream")


def test_read_snapshot_through_two_mongoses(cluster: ShardedCluster) -> None:
    """The public ``read_snapshot`` (what Spark's executors read their ranges with): every
    getMore on the mongos of its cursor, the documents as at its cluster time; stopped
    early, its cursor is killed on that mongos."""
    _sharded(cluster, "rs", DOCS)
    listener = GetMores()
    with _client(cluster, listener) as client:
        coll = client.db.rs
        at = client.db.command({"find": "rs", "limit": 1, "singleBatch": True,
                                "readConcern": {"level": "snapshot"}})["cursor"]["atClusterTime"]
        coll.delete_many({"_id": {"$lt": 100}})  # after ``at``: still read
        pipeline = [{"$match": {"_id": {"$gte": 10}}}, {"$sort": {"_id": 1}}]
        batches = list(changestream.read_snapshot(coll, pipeline, at=at, batch_size=500))
        assert [doc["_id"] for batch in batches for doc in batch] == list(range(10, DOCS))
        assert listener.check() >= 6
        early = changestream.read_snapshot(coll, at=at, batch_size=100)
        assert len(next(early)) == 100
        early.close()
        wait_for(lambda: not any(cluster.mongos(i).deployment.cursors.ids() for i in range(2)),
                 "the abandoned cursor to be killed")
        with pytest.raises(ValueError, match="batch_size"):
            changestream.read_snapshot(coll, batch_size=0)
        with pytest.raises(TypeError, match="pymongo Collection"):
            changestream.read_snapshot(client.db, [])  # type: ignore[arg-type]
