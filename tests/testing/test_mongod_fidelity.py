"""Behaviours where the simulator follows mongod closely, checked through PyMongo (and raw
sockets for the wire layer): split events on 6.0.9+, wire compression, the 8.0 ``bulkWrite``
command, retryable-write de-duplication, session kills, index builds, view DDL events and
Decimal128 resume tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet
from changestream.testing.changestreams.resume_token import decode_token

Client = MongoClient[dict[str, Any]]
MIB = 1024 * 1024
AWAIT_MS = 50


@pytest.fixture
def start_rs() -> Iterator[Callable[..., ReplicaSet]]:
    """Start replica sets that outlive the test's clients (stopped after them)."""
    started: list[ReplicaSet] = []

    def start(*args: Any, **kwargs: Any) -> ReplicaSet:
        rs = ReplicaSet(*args, **kwargs).start()
        started.append(rs)
        return rs

    yield start
    for rs in started:
        rs.stop()


@pytest.fixture
def clients(start_rs: Any) -> Iterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(uri: str, **kwargs: Any) -> Client:
        kwargs.setdefault("serverSelectionTimeoutMS", 5000)
        client: Client = MongoClient(uri, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


# -- 1. $changeStreamSplitLargeEvent on 6.0.9+ -------------------------------------------------------
def test_split_large_event_works_on_6_0_with_v2_fragment_tokens(
    start_rs: Any, clients: Any
) -> None:
    rs = start_rs("6.0")
    db = clients(rs.uri).db
    coll = db.create_collection("c", changeStreamPreAndPostImages={"enabled": True})
    coll.insert_one({"_id": 1, "big": "a" * (10 * MIB)})
    split = [{"$changeStreamSplitLargeEvent": {}}]
    with (
        coll.watch(max_await_time_ms=AWAIT_MS) as plain,
        coll.watch(
            split, full_document_before_change="required", max_await_time_ms=AWAIT_MS
        ) as stream,
    ):
        coll.update_one({"_id": 1}, {"$set": {"big": "b" * (10 * MIB)}})
        fragments = [stream.next(), stream.next()]
        assert decode_token(plain.next()["_id"]).version == 1  # 6.0's default
    assert [f["splitEvent"] for f in fragments] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]
    tokens = [decode_token(f["_id"]) for f in fragments]
    assert [(t.version, t.fragment_num) for t in tokens] == [(2, 0), (2, 1)]


def test_split_large_event_is_unknown_before_6_0_9(start_rs: Any, clients: Any) -> None:
    coll = clients(start_rs("6.0.8").uri).db.c
    with pytest.raises(OperationFailure) as info:
        coll.watch([{"$changeStreamSplitLargeEvent": {}}])
    assert info.value.code == 40324
    assert clients(start_rs("6.0.8").uri).admin.command("buildInfo")["version"] == "6.0.8"


# -- 2. wire compression ----------------------------------------------------------------------------
def test_pymongo_zlib_compression_round_trips_requests_and_replies(
    start_rs: Any, clients: Any
) -> None:
    rs = start_rs("8.0")
    plain, zipped = clients(rs.uri), clients(rs.uri, compressors="zlib")
    before = plain.admin.command("serverStatus")["network"]["compression"]["zlib"]
    coll = zipped.db.c
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.insert_many([{"_id": i, "text": "abc" * 2000} for i in range(20)])
        assert [stream.next()["documentKey"]["_id"] for _ in range(20)] == list(range(20))
    assert [d["_id"] for d in coll.find({}, batch_size=5)] == list(range(20))
    after = plain.admin.command("serverStatus")["network"]
    zlib_after = after["compression"]["zlib"]
    # requests arrived compressed, replies left compressed, and both shrank on the wire
    inflated = zlib_after["decompressor"]["bytesOut"] - before["decompressor"]["bytesOut"]
    deflated = zlib_after["decompressor"]["bytesIn"] - before["decompressor"]["bytesIn"]
    assert inflated > 20 * 6000 > deflated > 0
    sent = zlib_after["compressor"]["bytesIn"] - before["compressor"]["bytesIn"]
    sent_wire = zlib_after["compressor"]["bytesOut"] - before["compressor"]["bytesOut"]
    assert sent > 2 * 20 * 6000 > sent_wire > 0  # the change events and the find batches
    assert after["physicalBytesOut"] < after["bytesOut"]
    assert list(after["compression"]) == ["zlib"]  # mongod's default minus what is missing here
