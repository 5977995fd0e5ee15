"""v1 and v2 change streams through mongos (issue 32): the reader mongos picks, precise
shard targeting, placement changes, the FCV fallback, ``removeShard`` and removed shards,
and mongos's ``shardTargeting`` counters; driven by PyMongo."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp
from pymongo import monitoring
from pymongo.errors import OperationFailure

from changestream.testing import ShardedCluster

Client = pymongo.MongoClient[dict[str, Any]]


def opened(cluster: ShardedCluster) -> list[int]:
    """Change-stream cursors each shard opened so far (9.0's ``cursor.totalOpened``)."""
    return [
        int(rs.deployment.cs_metrics.document()["cursor"]["totalOpened"])  # type: ignore[index]
        for rs in cluster.shards
    ]


def aggregate(client: Client, db: str, coll: Any, spec: dict[str, Any], **cursor: Any) -> Any:
    return client[db].command("aggregate", coll, pipeline=[{"$changeStream": spec}], cursor=cursor)


def get_more(client: Client, db: str, reply: dict[str, Any], ms: int = 2000) -> dict[str, Any]:
    cursor = reply["cursor"]
    out: dict[str, Any] = client[db].command(
        "getMore", cursor["id"], collection=cursor["ns"].split(".", 1)[1], maxTimeMS=ms
    )
    return out


@pytest.fixture(scope="module")
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("9.0", shards=2, mongoses=1) as c:  # no-op every 10 s, as mongod
        yield c


@pytest.fixture
def client(cluster: ShardedCluster) -> Iterator[Client]:
    c: Client = pymongo.MongoClient(cluster.uri)
    yield c
    c.close()


def test_v2_targets_only_the_shard_holding_the_collection(
    cluster: ShardedCluster, client: Client
) -> None:
    client.admin.command("enableSharding", "one", primaryShard=cluster.shard_names[0])
    client.one.c.insert_one({"_id": 0})
    before = opened(cluster)
    v2 = aggregate(client, "one", "c", {})  # no version on 9.0: v2
    assert opened(cluster) == [before[0] + 1, before[1]]
    v1 = aggregate(client, "one", "c", {"version": "v1"})
    assert opened(cluster) == [before[0] + 2, before[1] + 1]
    client.one.c.insert_one({"_id": 1})
    batch = get_more(client, "one", v2, ms=5000)["cursor"]["nextBatch"]
    assert [e["documentKey"] for e in batch] == [{"_id": 1}]  # no wait for shard1's no-op
    idle = get_more(client, "one", v1, ms=300)["cursor"]["nextBatch"]
    assert idle == []  # v1 waits for the idle shard's promise (10 s no-op)


def test_v2_opens_its_cursors_on_the_first_pull(cluster: ShardedCluster, client: Client) -> None:
    client.admin.command("enableSharding", "lazy", primaryShard=cluster.shard_names[1])
    client.lazy.c.insert_one({"_id": 0})
    before = opened(cluster)
    reply = aggregate(client, "lazy", "c", {"version": "v2"}, batchSize=0)
    assert opened(cluster) == before
    client.lazy.c.insert_one({"_id": 1})
    batch = get_more(client, "lazy", reply)["cursor"]["nextBatch"]
    assert [e["documentKey"] for e in batch] == [{"_id": 1}]  # read from the start time
    assert opened(cluster) == [before[0], before[1] + 1]


def test_a_chunk_move_moves_the_cursor_to_the_new_owner(
    cluster: ShardedCluster, client: Client
) -> None:
    """The stream follows its only chunk to shard1 (a cursor opened there from the move's
    time, shard0's closed once read up to it), still with no wait for an idle shard."""
    client.admin.command("enableSharding", "moving", primaryShard=cluster.shard_names[0])
    client.admin.command("shardCollection", "moving.c", key={"x": 1})
    before = opened(cluster)
    mongos = client.admin.command("serverStatus")["metrics"]["changeStreams"]["shardTargeting"]
    with client.moving.c.watch(max_await_time_ms=5000) as stream:
        assert opened(cluster) == [before[0] + 1, before[1]]
        client.moving.c.insert_one({"x": 1})
        assert stream.next()["fullDocument"]["x"] == 1
        client.admin.command("moveChunk", "moving.c", find={"x": 5}, to=cluster.shard_names[1])
        client.moving.c.insert_one({"x": 2})
        started = time.monotonic()
        assert stream.next()["fullDocument"]["x"] == 2
        assert time.monotonic() - started < 5  # not the 10 s no-op of the shard it left
        assert opened(cluster) == [before[0] + 1, before[1] + 1]
    after = client.admin.command("serverStatus")["metrics"]["changeStreams"]["shardTargeting"]
    assert after["controlEvents"]["moveChunk"] == mongos["controlEvents"]["moveChunk"] + 1
    scope = after["targeterScope"]["collection"]["dbPresent"]
    assert scope == mongos["targeterScope"]["collection"]["dbPresent"] + 1


def test_a_database_stream_follows_a_chunk_to_another_shard(
    cluster: ShardedCluster, client: Client
) -> None:
    client.admin.command("enableSharding", "dbwide", primaryShard=cluster.shard_names[0])
    client.admin.command("shardCollection", "dbwide.c", key={"x": 1})
    before = client.admin.command("serverStatus")["metrics"]["changeStreams"]["shardTargeting"]
    with client.dbwide.watch(max_await_time_ms=5000) as stream:
        client.admin.command("moveChunk", "dbwide.c", find={"x": 1}, to=cluster.shard_names[1])
        client.dbwide.c.insert_one({"x": 1})  # now on shard1
        # the primary (shard0) can hold the database's other collections, so the stream still
        # reads it: a write there moves its promise past the first event (no 10 s no-op)
        client.dbwide.other.insert_one({"x": 2})
        assert stream.next()["fullDocument"]["x"] == 1
    after = client.admin.command("serverStatus")["metrics"]["changeStreams"]["shardTargeting"]
    assert after["controlEvents"]["moveChunk"] == before["controlEvents"]["moveChunk"] + 1
    dbs = after["targeterScope"]["database"]["dbPresent"]
    assert dbs == before["targeterScope"]["database"]["dbPresent"] + 1


def test_a_stream_on_a_database_not_created_yet(cluster: ShardedCluster, client: Client) -> None:
    status = client.admin.command("serverStatus")["metrics"]["changeStreams"]["shardTargeting"]
    with client.later.c.watch(max_await_time_ms=2000) as stream:
        client.later.c.insert_one({"_id": 7})
        assert stream.next()["documentKey"] == {"_id": 7}
    after = client.admin.command("serverStatus")["metrics"]["changeStreams"]["shardTargeting"]
    absent = after["targeterScope"]["collection"]["dbAbsent"]
    assert absent == status["targeterScope"]["collection"]["dbAbsent"] + 1
    created = after["controlEvents"]["databaseCreated"]
    assert created == status["controlEvents"]["databaseCreated"] + 1


def test_mongos_keeps_the_old_expanded_events_path(client: Client) -> None:
    cs = client.admin.command("serverStatus")["metrics"]["changeStreams"]
    assert set(cs) == {"largeEventsFailed", "largeEventsSplit", "showExpandedEvents",
                       "shardTargeting"}  # fmt: skip
    client.x.c.watch(show_expanded_events=True).close()
    after = client.admin.command("serverStatus")["metrics"]["changeStreams"]
    assert after["showExpandedEvents"] == cs["showExpandedEvents"] + 1
    assert isinstance(after["showExpandedEvents"], Int64)


class _Errors(monitoring.CommandListener):
    def __init__(self) -> None:
        self.codes: list[int] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.codes.append(int(event.failure.get("code", 0)))


def test_an_fcv_downgrade_sends_an_open_v2_stream_back_to_v1() -> None:
    """234 "Downgrading change stream reader to v1 version"; PyMongo resumes (the error is
    labelled resumable) and mongos picks v1 for the resumed stream: no event lost. Back at
    9.0, new streams read v2 again; one starting before the upgrade reads v1."""
    errors = _Errors()
    with ShardedCluster("9.0", shards=2, mongoses=1, noop_interval=0.2) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri, event_listeners=[errors])
        try:
            with pytest.raises(OperationFailure) as unconfirmed:
                client.admin.command("setFeatureCompatibilityVersion", "8.0")
            assert unconfirmed.value.code == 7369100
            with client.f.c.watch(max_await_time_ms=500) as stream:
                client.f.c.insert_one({"_id": 1})
                assert stream.next()["documentKey"] == {"_id": 1}
                before = opened(cluster)
                client.admin.command("setFeatureCompatibilityVersion", "8.0", confirm=True)
                client.f.c.insert_one({"_id": 2})
                assert stream.next()["documentKey"] == {"_id": 2}
                assert 234 in errors.codes
                assert opened(cluster) == [before[0] + 1, before[1] + 1]  # resumed as v1
            # back to 9.0: placement history is recorded from now on, so a new stream reads
            # v2 while one starting before the upgrade still reads v1
            client.admin.command("enableSharding", "g", primaryShard=cluster.shard_names[0])
            before_upgrade = client.admin.command("ping")["operationTime"]
            client.admin.command("setFeatureCompatibilityVersion", "9.0", confirm=True)
            before = opened(cluster)
            aggregate(client, "g", "c", {})
            assert opened(cluster) == [before[0] + 1, before[1]]
            aggregate(client, "g", "c", {"startAtOperationTime": before_upgrade})
            assert opened(cluster) == [before[0] + 2, before[1] + 1]
            shard: Client = pymongo.MongoClient(cluster.shards[0].uri)
            fcv = shard.admin.command("getParameter", 1, featureCompatibilityVersion=1)
            shard.close()
            assert fcv["featureCompatibilityVersion"] == {"version": "9.0"}
        finally:
            client.close()


def test_before_90_mongos_reads_v1_even_when_v2_is_asked() -> None:
    with ShardedCluster("8.3", shards=2, mongoses=1) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri)
        try:
            client.admin.command("enableSharding", "d", primaryShard=cluster.shard_names[0])
            reply = aggregate(client, "d", "c", {"version": "v2"})
            assert reply["cursor"]["id"]
            assert [len(rs.deployment.cursors) for rs in cluster.shards] == [1, 1]
        finally:
            client.close()


def test_remove_shard_states_and_errors() -> None:
    with ShardedCluster("9.0", shards=2, mongoses=1, noop_interval=0.2) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri)
        try:
            first, second = cluster.shard_names
            client.admin.command("enableSharding", "kept", primaryShard=first)
            client.admin.command("enableSharding", "moved", primaryShard=second)
            client.admin.command("shardCollection", "kept.s", key={"_id": "hashed"})
            client.moved.u.insert_one({})
            client.admin.command("shardCollection", "moved.s", key={"_id": "hashed"})
            with pytest.raises(OperationFailure) as unknown:
                client.admin.command("removeShard", "nope")
            assert (unknown.value.code, unknown.value.details["errmsg"]) == (
                70, "Shard nope does not exist"
            )  # fmt: skip
            started = client.admin.command("removeShard", second)
            fields = ("msg", "state", "shard", "note", "dbsToMove", "collectionsToMove")
            assert {k: started[k] for k in fields} == {
                "msg": "draining started successfully", "state": "started", "shard": second,
                "note": "you need to call moveCollection for collectionsToMove and afterwards "
                "movePrimary for the dbsToMove",
                "dbsToMove": ["moved"], "collectionsToMove": ["moved.u"],
            }  # fmt: skip
            with pytest.raises(OperationFailure) as last:
                client.admin.command("removeShard", first)
            assert last.value.code == 20
            assert "would remove the last shard" in str(last.value)
            ongoing = client.admin.command("removeShard", second)
            assert (ongoing["msg"], ongoing["state"]) == ("draining ongoing", "ongoing")
            assert ongoing["remaining"] == {"chunks": 0, "dbs": 1, "jumboChunks": 0}
            client.admin.command("movePrimary", "moved", to=first)
            done = client.admin.command("removeShard", second)
            assert {k: done[k] for k in ("msg", "state", "shard")} == {
                "msg": "removeshard completed successfully", "state": "completed",
                "shard": second,
            }  # fmt: skip
            assert [s["_id"] for s in client.admin.command("listShards")["shards"]] == [first]
        finally:
            client.close()


def test_streams_across_a_removed_shard() -> None:
    """v1: resuming from before a removal fails with 286; v2: a stream that never read the
    removed shard goes on; v2 starting before the removal on data the shard held: strict
    fails, and ``ignoreRemovedShards`` goes on without its events (as mongod's smoke test,
    with ``startAtOperationTime``)."""
    with ShardedCluster("9.0", shards=2, mongoses=1, noop_interval=0.2) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri)
        try:
            first, second = cluster.shard_names
            client.admin.command("enableSharding", "kept", primaryShard=first)
            client.admin.command("enableSharding", "moved", primaryShard=second)
            removed = cluster.shards[1]
            v1 = client.kept.c.aggregate([{"$changeStream": {"version": "v1"}}], maxAwaitTimeMS=300)
            v2 = client.kept.c.watch(max_await_time_ms=300)
            client.moved.c.insert_one({"_id": "old"})
            with client.moved.c.watch(max_await_time_ms=300) as before:
                client.moved.c.insert_one({"_id": "on shard1"})
                on_shard1 = before.next()
                assert on_shard1["documentKey"] == {"_id": "on shard1"}
                at = on_shard1["clusterTime"]
            client.kept.c.insert_one({"_id": 1})
            seen = v1.next()
            assert seen["documentKey"] == {"_id": 1}
            assert v2.next()["documentKey"] == {"_id": 1}
            client.admin.command("removeShard", second)
            client.admin.command("movePrimary", "moved", to=first)
            assert client.admin.command("removeShard", second)["state"] == "completed"
            removed.stop()
            client.kept.c.insert_one({"_id": 2})
            assert v2.next()["documentKey"] == {"_id": 2}  # never read shard1
            with pytest.raises(OperationFailure) as gone:
                v1.next()  # its shard1 cursor is gone (resumable, 6)...
            assert gone.value.code == 6
            assert "ResumableChangeStreamError" in gone.value.details["errorLabels"]
            with pytest.raises(OperationFailure) as lost:  # ...and resuming finds it removed
                aggregate(client, "kept", "c", {"version": "v1", "resumeAfter": seen["_id"]})
            assert lost.value.code == 286
            assert str(lost.value).startswith(
                "Change stream events no more available due to removed shard"
            )
            v2.close()
            with pytest.raises(OperationFailure) as strict:
                aggregate(client, "moved", "c", {"startAtOperationTime": at})
            assert strict.value.code == 70
            assert "at least one required shard has been removed" in str(strict.value)
            irs = aggregate(
                client, "moved", "c", {"startAtOperationTime": at, "ignoreRemovedShards": True}
            )
            client.moved.c.insert_one({"_id": "after"})
            batch = get_more(client, "moved", irs)["cursor"]["nextBatch"]
            assert [e["documentKey"] for e in batch] == [{"_id": "after"}]
        finally:
            client.close()


def test_a_shard_added_after_a_removal_gets_a_name_of_its_own(tmp_path: Path) -> None:
    """``add_shard`` after ``removeShard`` neither clashes with a shard still there nor
    reuses a removed shard's name or its directory (its old data)."""
    with ShardedCluster("9.0", shards=2, mongoses=1, dbpath=tmp_path) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri)
        try:
            first, second = cluster.shard_names
            client.admin.command("enableSharding", "gone", primaryShard=first)
            client.gone.c.insert_one({"_id": "on the removed shard"})
            client.admin.command("removeShard", first)
            client.admin.command("movePrimary", "gone", to=second)
            client.gone.c.drop()
            assert client.admin.command("removeShard", first)["state"] == "completed"
            cluster.state.retired[first].stop()  # its files are written: not to be loaded
            added = cluster.add_shard()
            assert added not in (first, second)
            assert cluster.shard_names == [second, added]
            assert not cluster.state.pending
            new = cluster.state.replica_set(added).deployment
            with new.lock:
                assert new.catalog.get("gone", "c") is None
            assert cluster.add_shard() not in (first, second, added)
        finally:
            client.close()


def test_every_mongos_reports_the_cluster_fcv() -> None:
    """After ``setFeatureCompatibilityVersion`` through one mongos, every mongos's
    ``getParameter`` answers the new FCV (as the shards do), a restarted one too."""
    with ShardedCluster("9.0", shards=1, mongoses=2) as cluster:
        first: Client = pymongo.MongoClient(cluster.mongos_uri(0))
        second: Client = pymongo.MongoClient(cluster.mongos_uri(1))
        try:
            first.admin.command("setFeatureCompatibilityVersion", "8.0", confirm=True)
            cluster.kill_mongos(0)
            cluster.restart_mongos(0)
            for client in (first, second):
                reply = client.admin.command("getParameter", 1, featureCompatibilityVersion=1)
                assert reply["featureCompatibilityVersion"] == {"version": "8.0"}
                everything = client.admin.command("getParameter", "*")
                assert everything["featureCompatibilityVersion"] == {"version": "8.0"}
        finally:
            first.close()
            second.close()


def test_v2_start_time_before_another_namespaces_move_opens_only_its_shards(
    cluster: ShardedCluster, client: Client
) -> None:
    """Placement changes of other databases after the start time do not widen a v2
    stream's initial shards (only its own namespaces' moves do)."""
    client.admin.command("enableSharding", "own", primaryShard=cluster.shard_names[0])
    client.own.c.insert_one({"_id": 0})
    start = client.admin.command("ping")["operationTime"]
    client.elsewhere.c.insert_one({"_id": 0})  # a database created after the start
    client.admin.command("movePrimary", "elsewhere", to=cluster.shard_names[1])
    before = opened(cluster)
    aggregate(client, "own", "c", {"startAtOperationTime": start})
    assert opened(cluster) == [before[0] + 1, before[1]]


def test_v2_strict_finds_a_removed_shard_at_its_first_pull() -> None:
    """With ``batchSize: 0`` the aggregate opens nothing, so the removed shard is found by
    the first getMore (mongod's v2 stage targets shards in ``doGetNext``)."""
    with ShardedCluster("9.0", shards=2, mongoses=1, noop_interval=0.2) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri)
        try:
            first, second = cluster.shard_names
            client.admin.command("enableSharding", "moved", primaryShard=second)
            client.moved.c.insert_one({"_id": "on shard1"})
            at = client.admin.command("ping")["operationTime"]
            client.admin.command("removeShard", second)
            client.admin.command("movePrimary", "moved", to=first)
            assert client.admin.command("removeShard", second)["state"] == "completed"
            reply = aggregate(client, "moved", "c", {"startAtOperationTime": at}, batchSize=0)
            assert reply["cursor"]["id"]
            with pytest.raises(OperationFailure) as strict:
                get_more(client, "moved", reply)
            assert strict.value.code == 70
            assert "at least one required shard has been removed" in str(strict.value)
        finally:
            client.close()


@pytest.mark.parametrize(
    ("version", "left"),
    [
        ("9.0", {"dbsToMove": [], "collectionsToMove": []}),
        ("7.0", {"note": "you need to drop or movePrimary these databases", "dbsToMove": []}),
    ],
)
def test_remove_shard_with_nothing_left_to_move(version: str, left: dict[str, Any]) -> None:
    """8.0+ (``appendDBAndCollDrainingInfo``): no note when nothing is left, the two lists
    always; before 8.0 the older note and ``dbsToMove``."""
    with ShardedCluster(version, shards=2, mongoses=1) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri)
        try:
            first, second = cluster.shard_names
            client.admin.command("enableSharding", "x", primaryShard=first)
            started = client.admin.command("removeShard", second)
            shown = {k: started[k] for k in ("note", "dbsToMove", "collectionsToMove") if k in started}
            assert shown == left
        finally:
            client.close()


def _fcv(uri: str) -> Any:
    client: Client = pymongo.MongoClient(uri, directConnection=True)
    try:
        return client.admin.command("getParameter", 1, featureCompatibilityVersion=1)[
            "featureCompatibilityVersion"
        ]["version"]
    finally:
        client.close()


def test_the_fcv_and_placement_history_survive_a_restart_and_reach_a_new_shard(
    tmp_path: Path,
) -> None:
    """The FCV is kept in the dbpath (mongod: ``admin.system.version``), and with it since
    when placement history is recorded; ``addShard`` gives a new shard the cluster's FCV."""
    with ShardedCluster("9.0", shards=2, mongoses=1, dbpath=tmp_path) as cluster:
        client: Client = pymongo.MongoClient(cluster.uri)
        try:
            client.admin.command("enableSharding", "p", primaryShard=cluster.shard_names[0])
            client.admin.command("setFeatureCompatibilityVersion", "8.0", confirm=True)
            added = cluster.add_shard()
            assert _fcv(cluster.state.replica_set(added).uri) == "8.0"
        finally:
            client.close()
    with ShardedCluster("9.0", shards=3, mongoses=1, dbpath=tmp_path) as cluster:
        client = pymongo.MongoClient(cluster.uri)
        try:
            assert [_fcv(rs.uri) for rs in cluster.shards] == ["8.0"] * 3
            assert _fcv(cluster.mongos_uri(0)) == "8.0"
            before = opened(cluster)
            aggregate(client, "p", "c", {})  # below 9.0: v1, a cursor on every shard
            assert opened(cluster) == [n + 1 for n in before]
            client.admin.command("setFeatureCompatibilityVersion", "9.0", confirm=True)
            upgraded = client.admin.command("ping")["operationTime"]
        finally:
            client.close()
    with ShardedCluster("9.0", shards=3, mongoses=1, dbpath=tmp_path) as cluster:
        client = pymongo.MongoClient(cluster.uri)
        try:
            before = opened(cluster)
            aggregate(client, "p", "c", {"startAtOperationTime": upgraded})  # v2 from then
            assert opened(cluster) == [before[0] + 1, *before[1:]]
            earlier = Timestamp(upgraded.time - 1, 0)
            aggregate(client, "p", "c", {"startAtOperationTime": earlier})  # no history: v1
            assert opened(cluster) == [before[0] + 2, *(n + 1 for n in before[1:])]
        finally:
            client.close()
