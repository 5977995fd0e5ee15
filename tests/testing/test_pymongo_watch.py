"""The simulator driven by PyMongo's own ``watch()``: events at every scope, resuming,
``start_after``, postBatchResumeToken on empty batches, oplog rollover, token contents."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from bson.binary import Binary
from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet
from changestream.testing.changestreams.resume_token import decode_token

Client = pymongo.MongoClient[dict[str, Any]]
AWAIT_MS = 50


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replset:
        yield replset


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[Client]:
    client: Client = pymongo.MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
    for name in client.list_database_names():
        if name not in ("admin", "config", "local"):
            client.drop_database(name)
    yield client
    client.close()


def kinds(stream: Any, count: int) -> list[str]:
    return [stream.next()["operationType"] for _ in range(count)]


def test_collection_stream_sees_every_event_type_then_invalidates(client: Client) -> None:
    coll = client.db.c
    coll.insert_one({"_id": 0})
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.insert_one({"_id": 1, "a": 1})
        coll.update_one({"_id": 1}, {"$set": {"a": 2}})
        coll.replace_one({"_id": 1}, {"b": 1})
        coll.delete_one({"_id": 1})
        coll.drop()
        insert = stream.next()
        assert insert["fullDocument"] == {"_id": 1, "a": 1}
        update = stream.next()
        assert update["updateDescription"] == {
            "updatedFields": {"a": 2},
            "removedFields": [],
            "truncatedArrays": [],
        }
        assert kinds(stream, 4) == ["replace", "delete", "drop", "invalidate"]
        assert not stream.alive


def test_rename_event_carries_to(client: Client) -> None:
    coll = client.db.c
    coll.insert_one({"_id": 0})
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.rename("d")
        rename = stream.next()
        assert rename["operationType"] == "rename"
        assert rename["to"] == {"db": "db", "coll": "d"}
        assert stream.next()["operationType"] == "invalidate"


def test_database_stream(client: Client) -> None:
    db = client.db
    db.a.insert_one({"_id": 0})
    with db.watch(max_await_time_ms=AWAIT_MS) as stream:
        db.a.insert_one({"_id": 1})
        db.b.insert_one({"_id": 2})
        db.a.drop()
        client.other.c.insert_one({"_id": 3})
        client.drop_database("db")
        events = [stream.next() for _ in range(4)]
        assert [(e["operationType"], e["ns"]) for e in events] == [
            ("insert", {"db": "db", "coll": "a"}),
            ("insert", {"db": "db", "coll": "b"}),
            ("drop", {"db": "db", "coll": "a"}),
            ("drop", {"db": "db", "coll": "b"}),
        ]
        assert kinds(stream, 2) == ["dropDatabase", "invalidate"]


def test_cluster_stream(client: Client) -> None:
    with client.watch(max_await_time_ms=AWAIT_MS) as stream:
        client.db.c.insert_one({"_id": 1})
        client.admin.command("ping")
        client.other.d.insert_one({"_id": 2})
        assert [stream.next()["ns"] for _ in range(2)] == [
            {"db": "db", "coll": "c"},
            {"db": "other", "coll": "d"},
        ]


def test_update_lookup_and_expanded_events(client: Client) -> None:
    coll = client.db.c
    coll.insert_one({"_id": 1, "a": 1})
    with coll.watch(full_document="updateLookup", max_await_time_ms=AWAIT_MS) as stream:
        coll.update_one({"_id": 1}, {"$inc": {"a": 1}})
        assert stream.next()["fullDocument"] == {"_id": 1, "a": 2}
    with client.db.watch(show_expanded_events=True, max_await_time_ms=AWAIT_MS) as stream:
        coll.create_index("x")
        event = stream.next()
        assert event["operationType"] == "createIndexes"
        assert event["operationDescription"]["indexes"][0]["key"] == {"x": 1}


def test_pre_and_post_images(client: Client) -> None:
    client.db.create_collection("c", changeStreamPreAndPostImages={"enabled": True})
    coll = client.db.c
    coll.insert_one({"_id": 1, "a": 1})
    with coll.watch(
        full_document="required", full_document_before_change="required",
        max_await_time_ms=AWAIT_MS,
    ) as stream:  # fmt: skip
        coll.update_one({"_id": 1}, {"$set": {"a": 2}})
        event = stream.next()
        assert event["fullDocument"] == {"_id": 1, "a": 2}
        assert event["fullDocumentBeforeChange"] == {"_id": 1, "a": 1}


def test_resume_after_a_token(client: Client) -> None:
    coll = client.db.c
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.insert_many([{"_id": i} for i in range(3)])
        first = stream.next()
    with coll.watch(resume_after=first["_id"], max_await_time_ms=AWAIT_MS) as resumed:
        assert [resumed.next()["documentKey"] for _ in range(2)] == [{"_id": 1}, {"_id": 2}]


def test_start_after_an_invalidate(client: Client) -> None:
    coll = client.db.c
    coll.insert_one({"_id": 0})
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.drop()
        assert kinds(stream, 2) == ["drop", "invalidate"]
        token = stream.resume_token
    assert token is not None
    coll.insert_one({"_id": "recreated"})
    with coll.watch(start_after=token, max_await_time_ms=AWAIT_MS) as after:
        assert after.next()["documentKey"] == {"_id": "recreated"}
    with pytest.raises(OperationFailure) as info, coll.watch(resume_after=token):
        pass
    assert info.value.code == 260


def test_empty_batches_advance_the_resume_token(client: Client) -> None:
    coll = client.db.c
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        assert stream.try_next() is None
        start = stream.resume_token
        assert start is not None
        reply = client.db.command("insert", "other", documents=[{"_id": 1}])
        assert stream.try_next() is None
        advanced = stream.resume_token
        assert advanced is not None and advanced != start
        token = decode_token(advanced)
        assert token.token_type == 0
        assert token.cluster_time == reply["operationTime"]
        assert advanced["_data"] > start["_data"]


def test_event_token_contents(client: Client) -> None:
    coll = client.db.c
    coll.insert_one({"_id": 0})
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.insert_one({"_id": 5})
        event = stream.next()
    token = decode_token(event["_id"])
    assert token.cluster_time == event["clusterTime"]
    assert token.version == 2 and token.token_type == 128 and token.txn_op_index == 0
    assert token.event_identifier == {"operationType": "insert", "documentKey": {"_id": 5}}
    info = client.db.command("listCollections", filter={"name": "c"})["cursor"]["firstBatch"]
    assert token.uuid is not None and info[0]["info"]["uuid"] == Binary.from_uuid(token.uuid)


def test_resuming_from_a_token_that_rolled_off_the_oplog_fails() -> None:
    with ReplicaSet("8.0", oplog_max_entries=5) as small:
        client: Client = pymongo.MongoClient(small.uri, serverSelectionTimeoutMS=5000)
        coll = client.db.c
        with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
            coll.insert_one({"_id": 1})
            token = stream.next()["_id"]
        for i in range(10):
            client.db.other.insert_one({"_id": i})
        with pytest.raises(OperationFailure) as info, coll.watch(resume_after=token):
            pass
        assert info.value.code == 286
        assert info.value.has_error_label("NonResumableChangeStreamError")
        client.close()


def test_a_44_replica_set() -> None:
    with ReplicaSet("4.4") as old:
        client: Client = pymongo.MongoClient(old.uri, serverSelectionTimeoutMS=5000)
        coll = client.db.c
        with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
            coll.insert_one({"_id": 1})
            event = stream.next()
        assert list(event) == [
            "_id",
            "operationType",
            "clusterTime",
            "fullDocument",
            "ns",
            "documentKey",
        ]
        assert decode_token(event["_id"]).version == 1
        assert isinstance(event["clusterTime"], Timestamp)
        client.close()


def test_resume_after_the_last_fragment_of_a_split_event(client: Client) -> None:
    """The last fragment's token resumes at the next event, as on mongod (issue 33, item 18).

    mongod re-splits the event, drops the fragments before the token's and lets
    EnsureResumeTokenPresent swallow the token's own; the simulator used to fail with 280
    ("the resumed stream produced a different split").
    """
    db = client.split_resume
    db.create_collection("c", changeStreamPreAndPostImages={"enabled": True})
    big = 10 * 1024 * 1024
    db.c.insert_one({"_id": 1, "v": "q" * big})
    pipeline = [{"$changeStreamSplitLargeEvent": {}}]
    options: dict[str, Any] = {"full_document_before_change": "required"}
    with db.c.watch(pipeline, max_await_time_ms=AWAIT_MS, **options) as stream:
        db.c.update_one({"_id": 1}, {"$set": {"v": "z" * big}})
        db.c.insert_one({"_id": 2})
        fragments = [stream.next() for _ in range(2)]
        following = stream.next()
    assert [f["splitEvent"] for f in fragments] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]
    resume_options = {**options, "max_await_time_ms": AWAIT_MS}
    with db.c.watch(pipeline, resume_after=fragments[1]["_id"], **resume_options) as stream:
        after = stream.next()
        assert (after["operationType"], after["_id"]) == ("insert", following["_id"])
    with db.c.watch(pipeline, resume_after=fragments[0]["_id"], **resume_options) as stream:
        assert stream.next()["_id"] == fragments[1]["_id"]
        assert stream.next()["_id"] == following["_id"]
