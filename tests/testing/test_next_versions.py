"""MongoDB 8.3, 9.0 and 9.1 (issue 32): the version table, the options each parses, and
PyMongo's own ``watch()`` against a replica set of each (a client this project did not write)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from pymongo.errors import OperationFailure

from changestream.testing import VERSIONS, ReplicaSet, get_profile
from tests.testing.test_cs_stage import error, stream

NEW = ("8.3", "9.0", "9.1")
Client = pymongo.MongoClient[dict[str, Any]]


def test_the_new_lines_are_emulated_with_their_wire_versions() -> None:
    assert {v: VERSIONS[v].max_wire_version for v in NEW} == {"8.3": 28, "9.0": 29, "9.1": 30}
    assert [VERSIONS[v].version for v in NEW] == ["8.3.0", "9.0.0", "9.1.0"]
    assert all(VERSIONS[v].token_version == 2 and VERSIONS[v].ns_type for v in NEW)


@pytest.mark.parametrize("version", ["8.2", *NEW])
def test_reader_version_is_parsed_from_82(version: str) -> None:
    assert stream({"version": "v2"}, version=version)["cursor"]["id"]
    assert stream({"version": "v1"}, version=version)["cursor"]["id"]
    bad = error(lambda: stream({"version": "v3"}, version=version))
    assert (bad.code, bad.errmsg) == (
        2, "Enumeration value 'v3' for field '$changeStream.version' is not a valid value."
    )  # fmt: skip


@pytest.mark.parametrize(("version", "known"), [("8.2", False), ("8.3", False), ("9.0", True)])
def test_ignore_removed_shards_is_a_90_field_accepted_on_a_replica_set(
    version: str, known: bool
) -> None:
    """mongod accepts it on any stream (the option-metrics jstest opens it on a replica set)."""
    if known:
        assert stream({"ignoreRemovedShards": True}, version=version)["cursor"]["id"]
        assert error(lambda: stream({"ignoreRemovedShards": 1}, version=version)).code == 14
    else:
        assert error(lambda: stream({"ignoreRemovedShards": True}, version=version)).code == 40415


def test_show_commit_timestamp_is_known_from_821() -> None:
    """8.2.0 does not know the flag ("older versions ... error out if set"); 8.2.1+ do."""
    assert stream({"showCommitTimestamp": True}, version="8.2")["cursor"]["id"]
    assert stream({"showCommitTimestamp": True}, version="9.1")["cursor"]["id"]
    assert error(lambda: stream({"showCommitTimestamp": True}, version="8.2.0")).code == 40415
    assert get_profile("8.2.0").expanded_fields_by_default
    assert not any(VERSIONS[v].expanded_fields_by_default for v in ("8.2", *NEW))


@pytest.fixture(scope="module", params=NEW)
def rs(request: pytest.FixtureRequest) -> Iterator[ReplicaSet]:
    with ReplicaSet(request.param) as replset:
        yield replset


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[Client]:
    client: Client = pymongo.MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
    client.drop_database("db")
    yield client
    client.close()


def test_pymongo_watch_at_each_new_version(rs: ReplicaSet, client: Client) -> None:
    """PyMongo's watch(): events, a resume after an injected resumable error, expanded
    events with ``nsType``, and buildInfo/hello reporting the version."""
    info = client.admin.command("buildInfo")
    profile = rs.deployment.profile
    assert info["version"] == profile.version
    assert client.admin.command("hello")["maxWireVersion"] == profile.max_wire_version
    coll = client.db.c
    with coll.watch(max_await_time_ms=50, show_expanded_events=True) as stream:
        client.db.create_collection("c")
        coll.insert_one({"_id": 1})
        client.admin.command(
            "configureFailPoint", "failCommand", mode={"times": 1},
            data={"failCommands": ["getMore"], "errorCode": 6,
                  "errorLabels": ["ResumableChangeStreamError"]},
        )  # fmt: skip
        coll.update_one({"_id": 1}, {"$set": {"a": 1}})
        create = stream.next()
        assert (create["operationType"], create["nsType"]) == ("create", "collection")
        insert = stream.next()
        assert insert["fullDocument"] == {"_id": 1}
        assert "collectionUUID" in insert  # showExpandedEvents
        update = stream.next()
        assert update["updateDescription"]["disambiguatedPaths"] == {}
    with coll.watch(max_await_time_ms=50) as plain:
        coll.insert_one({"_id": 2})
        event = plain.next()
        assert "collectionUUID" not in event and "nsType" not in event
        token = plain.resume_token
    with coll.watch(resume_after=token, max_await_time_ms=50) as resumed:
        coll.delete_one({"_id": 2})
        assert resumed.next()["operationType"] == "delete"


def test_pymongo_aggregate_with_v2_and_ignore_removed_shards_on_a_replica_set(
    rs: ReplicaSet, client: Client
) -> None:
    """A replica set accepts both (9.0+) and runs a v1 reader: the events are the same."""
    pipeline: list[dict[str, Any]] = [{"$changeStream": {"version": "v2"}}]
    if rs.deployment.profile.ignore_removed_shards:
        pipeline = [{"$changeStream": {"version": "v2", "ignoreRemovedShards": True}}]
    else:
        with pytest.raises(OperationFailure) as refused:
            client.db.c.aggregate([{"$changeStream": {"ignoreRemovedShards": True}}])
        assert refused.value.code == 40415
    with client.db.c.aggregate(pipeline, maxAwaitTimeMS=50) as cursor:
        client.db.c.insert_one({"_id": 3})
        assert cursor.next()["documentKey"] == {"_id": 3}


@pytest.mark.parametrize(
    ("version", "by_default"), [("8.2.0", True), ("8.2", False), ("9.0", False)]
)
def test_expanded_fields_by_default_only_on_820(version: str, by_default: bool) -> None:
    """always_show_expanded_fields.js (8.2.0), reverted in 8.2.1 (SERVER-109626): without
    showExpandedEvents, collectionUUID, disambiguatedPaths and rename's operationDescription;
    create events and nsType still need showExpandedEvents."""
    with ReplicaSet(version) as rs:
        client: Client = pymongo.MongoClient(rs.uri)
        try:
            coll = client.db.c
            with coll.watch(max_await_time_ms=50) as stream:
                client.db.create_collection("c")
                coll.insert_one({"_id": 1})
                coll.update_one({"_id": 1}, {"$set": {"a": 1}})
                coll.rename("d")
                insert, update, rename = stream.next(), stream.next(), stream.next()
            assert insert["operationType"] == "insert"  # no create event without the flag
            assert ("collectionUUID" in insert) is by_default
            assert ("disambiguatedPaths" in update["updateDescription"]) is by_default
            assert ("operationDescription" in rename) is by_default
            assert "nsType" not in insert
        finally:
            client.close()
