"""The client on MongoDB 9.0's v2 change streams through the simulated mongos (issue 32):
``version="v2"`` gets a collection's events without waiting for an idle shard's no-op, and
``ignore_removed_shards=True`` keeps a stream going across a removed shard, where a v1
stream's resume is a dead end ``consume`` explains."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest

import changestream
from changestream.stores import MemoryTokenStore
from changestream.testing import ShardedCluster

Client = pymongo.MongoClient[dict[str, Any]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("9.0", shards=2, mongoses=1) as c:  # no-op every 10 s, as mongod
        yield c


def first_event_seconds(coll: Any, **options: Any) -> float:
    with changestream.watch(coll, max_await_time_ms=500, **options) as stream:
        started = time.monotonic()
        coll.insert_one({"at": started})
        while stream.try_next() is None:
            assert time.monotonic() - started < 30
        return time.monotonic() - started


def test_v2_gets_events_without_waiting_for_the_idle_shard(cluster: ShardedCluster) -> None:
    with pymongo.MongoClient(cluster.uri) as client:
        client.admin.command("enableSharding", "busy", primaryShard=cluster.shard_names[0])
        coll = client.busy.orders
        coll.insert_one({"_id": "created"})
        v2 = first_event_seconds(coll, version="v2")
    # v1 would wait for shard1's no-op (up to 10 s; benchmarks/v2_latency.py measures both)
    assert v2 < 2.0, f"v2 waited {v2:.1f} s"


def test_ignore_removed_shards_goes_on_and_v1_stops_saying_why() -> None:
    with ShardedCluster("9.0", shards=2, mongoses=1, noop_interval=0.2) as cluster, \
            pymongo.MongoClient(cluster.uri) as client:
        first, second = cluster.shard_names
        client.admin.command("enableSharding", "moved", primaryShard=second)
        coll = client.moved.c
        removed = cluster.shards[1]
        coll.insert_one({"_id": "old"})
        with changestream.watch(coll, max_await_time_ms=300) as stream:
            coll.insert_one({"_id": "on shard1"})
            at = stream.next()["clusterTime"]
        client.admin.command("removeShard", second)
        client.admin.command("movePrimary", "moved", to=first)
        assert client.admin.command("removeShard", second)["state"] == "completed"
        removed.stop()
        with changestream.watch(coll, start_at_operation_time=at, version="v2",
                                ignore_removed_shards=True, max_await_time_ms=300) as going_on:
            coll.insert_one({"_id": "after"})
            change = None
            deadline = time.monotonic() + 20
            while change is None and time.monotonic() < deadline:
                change = going_on.try_next()
        assert change is not None and change["documentKey"] == {"_id": "after"}

        store = MemoryTokenStore(changestream.stores.StoredToken(
            change["_id"], None, changestream.stores._now()))
        with pytest.raises(changestream.ConsumeError) as stopped:  # v1 past the removal
            changestream.consume(
                lambda token: changestream.watch(coll, start_at_operation_time=at,
                                                 version="v1", max_await_time_ms=300),
                print, store, retry_for=5)
        text = str(stopped.value)
        assert "removed" in text and "ignore_removed_shards=True" in text, text
