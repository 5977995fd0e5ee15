"""``serverStatus().metrics.changeStreams`` (issue 32): paths, shapes and when each moves,
as mongod's source and jstests give them, read with PyMongo."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from bson.int64 import Int64
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet

Client = pymongo.MongoClient[dict[str, Any]]


def metrics(client: Client) -> dict[str, Any]:
    status = client.admin.command({"serverStatus": 1, "metrics": 1})
    cs: dict[str, Any] = status["metrics"]["changeStreams"]
    return cs


@pytest.fixture(scope="module")
def rs90() -> Iterator[ReplicaSet]:
    with ReplicaSet("9.0") as rs:
        yield rs


@pytest.fixture
def client(rs90: ReplicaSet) -> Iterator[Client]:
    # ShutdownInProgress (91) marks the server unknown: PyMongo finds it again on its next
    # heartbeat, 10 s away by default
    client: Client = pymongo.MongoClient(rs90.uri, heartbeatFrequencyMS=500)
    yield client
    client.close()


def open_and_close(client: Client, spec: dict[str, Any], db: str = "m", coll: str | None = "c"):  # type: ignore[no-untyped-def]
    target: Any = coll if coll is not None else 1
    reply = client[db].command("aggregate", target, pipeline=[{"$changeStream": spec}], cursor={})
    cursor = reply["cursor"]
    client[db].command("killCursors", cursor["ns"].split(".", 1)[1], cursors=[cursor["id"]])


def test_the_90_shape_on_mongod(client: Client) -> None:
    cs = metrics(client)
    assert set(cs) == {
        "largeEventsFailed",
        "largeEventsSplit",
        "option",
        "scope",
        "cursor",
        "error",
    }
    assert "showExpandedEvents" not in cs  # renamed to option.showExpandedEvents on mongod
    assert set(cs["scope"]) == {"cluster", "db", "collection"}
    assert set(cs["option"]["fullDocument"]) == {"required", "updateLookup", "whenAvailable"}
    assert set(cs["option"]["fullDocumentBeforeChange"]) == {"required", "whenAvailable"}
    assert isinstance(cs["cursor"]["totalOpened"], Int64)
    for name in ("docsReturned", "bytesReturned", "batchesReturned", "docsExamined", "bytesRead"):
        assert set(cs["cursor"][name]) == {"sum"}, name
    assert set(cs["error"]["nonRetriable"]) == {
        "changeStreamHistoryLost", "changeStreamFatalError", "bsonObjectTooLarge", "other"
    }  # fmt: skip
    assert set(cs["error"]["retriable"]) == {"interruptedDueToReplStateChange", "other"}


def test_option_and_scope_counters_move_once_per_open(client: Client) -> None:
    before = metrics(client)
    open_and_close(client, {"ignoreRemovedShards": True, "showExpandedEvents": True})
    open_and_close(client, {"fullDocument": "updateLookup", "showSystemEvents": False})
    open_and_close(client, {"fullDocument": "default"}, coll=None)
    after = metrics(client)
    assert after["option"]["ignoreRemovedShards"] == before["option"]["ignoreRemovedShards"] + 1
    assert after["option"]["showExpandedEvents"] == before["option"]["showExpandedEvents"] + 1
    assert after["option"]["showSystemEvents"] == before["option"]["showSystemEvents"]  # false
    full = after["option"]["fullDocument"]
    assert full["updateLookup"] == before["option"]["fullDocument"]["updateLookup"] + 1
    assert after["option"]["startAtOperationTime"] == before["option"]["startAtOperationTime"]
    assert after["scope"]["collection"] == before["scope"]["collection"] + 2
    assert after["scope"]["db"] == before["scope"]["db"] + 1
    assert after["cursor"]["totalOpened"] == before["cursor"]["totalOpened"] + 3


def test_throughput_sums_grow_with_batches(client: Client) -> None:
    """As change_stream_throughput_metrics.js: three batches of batchSize 1."""
    coll = client.m.tp
    before = metrics(client)["cursor"]
    with coll.watch(batch_size=1, max_await_time_ms=50) as stream:
        coll.insert_many([{"_id": i} for i in range(3)])
        for _ in range(3):
            stream.next()
    after = metrics(client)["cursor"]
    for name in ("docsReturned", "bytesReturned", "batchesReturned", "docsExamined"):
        assert after[name]["sum"] > before[name]["sum"], name
    assert after["docsReturned"]["sum"] - before["docsReturned"]["sum"] == 3
    assert after["bytesRead"]["sum"] >= before["bytesRead"]["sum"]


def _fail_next_get_more(client: Client, code: int) -> None:
    client.admin.command(
        "configureFailPoint", "failGetMoreAfterCursorCheckout", mode={"times": 1},
        data={"errorCode": code},
    )  # fmt: skip


def test_errors_are_counted_by_kind(client: Client) -> None:
    """By mongod's ``incrementChangeStreamErrorCounters``: named codes, then the
    RetriableError category (not the resumable label: StaleConfig 13388 is resumable but
    not retriable), and only for an open cursor (a ``$changeStream`` refused at parse time
    counts nothing)."""
    before = metrics(client)["error"]
    with pytest.raises(OperationFailure):
        client.m.e.aggregate([{"$changeStream": {"version": 7}}])  # TypeMismatch (14)
    assert metrics(client)["error"] == before
    with client.m.e.watch(max_await_time_ms=50) as stream:
        for code in (11602, 13388, 91):
            _fail_next_get_more(client, code)
            client.m.e.insert_one({})
            assert stream.next()["operationType"] == "insert"  # resumed after the error
    after = metrics(client)["error"]
    assert after["nonRetriable"]["other"] == before["nonRetriable"]["other"] + 1  # 13388
    assert after["retriable"]["other"] == before["retriable"]["other"] + 1  # 91
    retriable = after["retriable"]["interruptedDueToReplStateChange"]
    assert retriable == before["retriable"]["interruptedDueToReplStateChange"] + 1


def test_split_and_failed_large_events(client: Client) -> None:
    coll = client.m.big
    before = metrics(client)
    big = "x" * (9 * 1024 * 1024)
    pipeline: list[dict[str, Any]] = [{"$changeStreamSplitLargeEvent": {}}]
    with coll.watch(
        pipeline, full_document_before_change="whenAvailable", max_await_time_ms=50
    ) as s:
        client.m.create_collection("big", changeStreamPreAndPostImages={"enabled": True})
        coll.insert_one({"_id": 1, "a": big})
        coll.replace_one({"_id": 1}, {"a": big + "y"})
        assert s.next()["operationType"] == "insert"
        fragment = s.next()
        assert fragment["splitEvent"]["fragment"] == 1
    mid = metrics(client)
    assert mid["largeEventsSplit"] == before["largeEventsSplit"] + 1
    with coll.watch(full_document="updateLookup", max_await_time_ms=50) as s2:
        coll.update_one({"_id": 1}, {"$set": {"b": "z" * (5 * 1024 * 1024)}})
        with pytest.raises(OperationFailure) as too_big:
            s2.next()
        assert too_big.value.code == 10334
    after = metrics(client)
    assert after["largeEventsFailed"] == mid["largeEventsFailed"] + 1
    assert after["error"]["nonRetriable"]["bsonObjectTooLarge"] == (
        mid["error"]["nonRetriable"]["bsonObjectTooLarge"] + 1
    )


@pytest.mark.parametrize("version", ["5.0.19", "6.0", "8.0"])
def test_before_90_only_the_old_counters(version: str) -> None:
    """The large-event counters from 5.0.19, 6.0.7 and 7.0 (SERVER-67699);
    ``showExpandedEvents`` from 7.1."""
    with ReplicaSet(version) as rs:
        client: Client = pymongo.MongoClient(rs.uri)
        try:
            status = client.admin.command("serverStatus")
            cs = status["metrics"]["changeStreams"]
            if version != "8.0":
                assert cs == {"largeEventsFailed": 0, "largeEventsSplit": 0}
                return
            assert set(cs) == {"largeEventsFailed", "largeEventsSplit", "showExpandedEvents"}
            client.m.c.watch(show_expanded_events=True).close()
            client.m.c.watch().close()
            assert metrics(client)["showExpandedEvents"] == cs["showExpandedEvents"] + 1
        finally:
            client.close()


@pytest.mark.parametrize("version", ["4.4", "5.0.18", "6.0.6"])
def test_no_change_stream_metrics_before_the_large_event_counters(version: str) -> None:
    with ReplicaSet(version) as rs:
        client: Client = pymongo.MongoClient(rs.uri)
        try:
            assert "metrics" not in client.admin.command("serverStatus")
        finally:
            client.close()
