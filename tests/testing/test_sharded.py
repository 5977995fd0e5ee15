"""The simulated sharded cluster: mongos routing, change streams merged across shards, LB."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pymongo
import pytest
from bson.int64 import Int64
from bson.max_key import MaxKey
from pymongo.errors import OperationFailure

from changestream.testing import ShardedCluster

DEADLINE = 20.0


def wait_until(check: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.2) as c:
        yield c


@pytest.fixture
def client(cluster: ShardedCluster) -> Iterator[pymongo.MongoClient[dict[str, Any]]]:
    c = _one(cluster, 0)  # raw getMores must reach the mongos holding the cursor
    yield c
    c.close()


def _one(cluster: ShardedCluster, i: int) -> pymongo.MongoClient[dict[str, Any]]:
    return pymongo.MongoClient(cluster.mongos_uri(i), directConnection=True)


def _range_sharded(
    client: pymongo.MongoClient[dict[str, Any]], cluster: ShardedCluster, ns: str
) -> None:
    """``ns`` sharded on ``{x: 1}``: x < 0 on shard0, x >= 0 on shard1."""
    admin = client.admin
    admin.command("shardCollection", ns, key={"x": 1})
    admin.command("split", ns, middle={"x": 0})
    owner = cluster.state.table.sharded(ns)
    assert owner is not None
    admin.command("moveChunk", ns, find={"x": 5}, to=cluster.shard_names[1])
    admin.command("moveChunk", ns, find={"x": -5}, to=cluster.shard_names[0])


def _docs_on(cluster: ShardedCluster, shard: int, db: str, coll: str) -> list[dict[str, Any]]:
    state = cluster.shards[shard].deployment.catalog.get(db, coll)
    return [] if state is None else list(state.documents())


# -- identity and routing ---------------------------------------------------------------------


def test_mongos_identity_and_ports(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    hello = client.admin.command("hello")
    assert hello["msg"] == "isdbgrid" and "setName" not in hello
    ports = [int(name.rsplit(":", 1)[1]) for name in cluster.mongoses]
    assert ports[1] == ports[0] + 1
    assert set(cluster.uri.removeprefix("mongodb://").strip("/").split(",")) == set(
        cluster.mongoses
    )
    shards = list(client.config.shards.find())
    assert [s["_id"] for s in shards] == cluster.shard_names
    assert all(s["host"].startswith(s["_id"] + "/") for s in shards)
    assert client.admin.command("listShards")["shards"][0]["_id"] == "shard0"


def test_one_cluster_clock(cluster: ShardedCluster) -> None:
    a, b = cluster.shards
    assert a.deployment.clock is b.deployment.clock is cluster.clock


def test_range_sharding_routes_documents_and_both_mongoses_agree(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    _range_sharded(client, cluster, "routing.r")
    coll = client.routing.r
    coll.insert_many([{"x": x} for x in range(-5, 5)])
    assert sorted(d["x"] for d in _docs_on(cluster, 0, "routing", "r")) == list(range(-5, 0))
    assert sorted(d["x"] for d in _docs_on(cluster, 1, "routing", "r")) == list(range(0, 5))
    for i in (0, 1):
        other = _one(cluster, i)
        try:
            found = [d["x"] for d in other.routing.r.find({}, sort=[("x", -1)], limit=3)]
            assert found == [4, 3, 2]
            assert other.routing.r.count_documents({"x": {"$gte": -1}}) == 6
        finally:
            other.close()
    coll.update_one({"x": -3}, {"$set": {"y": 1}})
    coll.update_many({}, {"$inc": {"z": 1}})
    coll.delete_one({"x": 4})
    assert coll.find_one({"x": -3})["y"] == 1
    assert coll.count_documents({"z": 1}) == 9
    assert sorted(coll.distinct("x")) == list(range(-5, 4))
    assert [d["n"] for d in coll.aggregate([{"$count": "n"}])] == [9]


def test_get_more_on_an_unsharded_collection_keeps_the_session(
    client: pymongo.MongoClient[Any],
) -> None:
    """mongos forwards getMore and killCursors in the session the shard cursor was opened in.

    mongod refuses (50737) a getMore without the lsid of the find that made the cursor; the
    Node.js driver's ``find().batchSize(1)`` through mongos found that mongos dropped it.
    """
    coll = client.routing.unsharded_batches
    coll.insert_many([{"_id": i} for i in range(5)])
    with client.start_session() as session:
        assert [d["_id"] for d in coll.find({}, batch_size=1, session=session)] == list(range(5))
        cursor = coll.find({}, batch_size=1, session=session)
        assert next(cursor)["_id"] == 0
        cursor.close()  # killCursors on mongos kills the shard cursor in the same session
    assert [d["_id"] for d in coll.find({}, batch_size=2)] == list(range(5))  # implicit session


def test_hashed_sharding_spreads_and_6_0_needs_no_enable_sharding(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    client.admin.command("shardCollection", "hashed.h", key={"k": "hashed"})
    client.hashed.h.insert_many([{"k": i} for i in range(40)])
    counts = [len(_docs_on(cluster, i, "hashed", "h")) for i in (0, 1)]
    assert sum(counts) == 40 and min(counts) > 0


def test_before_6_0_shard_collection_needs_enable_sharding() -> None:
    with ShardedCluster("5.0", shards=1, mongoses=1, noop_interval=0.2) as c:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(c.uri)
        with pytest.raises(OperationFailure) as err:
            client.admin.command("shardCollection", "old.c", key={"_id": 1})
        assert err.value.code == 20
        client.admin.command("enableSharding", "old")
        client.admin.command("shardCollection", "old.c", key={"_id": 1})
        client.close()


def test_move_primary_moves_unsharded_collections(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    client.admin.command("enableSharding", "mp", primaryShard="shard0")
    client.mp.u.insert_one({"a": 1})
    client.admin.command("movePrimary", "mp", to="shard1")
    assert _docs_on(cluster, 0, "mp", "u") == []
    assert [d["a"] for d in _docs_on(cluster, 1, "mp", "u")] == [1]
    assert client.mp.u.find_one()["a"] == 1


# -- change streams through mongos ------------------------------------------------------------


def _aggregate(db: Any, target: Any, pipeline: list[Any], **extra: Any) -> dict[str, Any]:
    return db.command({"aggregate": target, "pipeline": pipeline, "cursor": {}, **extra})


def _get_more(db: Any, cursor: dict[str, Any], **extra: Any) -> dict[str, Any]:
    coll = cursor["ns"].split(".", 1)[1]
    return db.command({"getMore": Int64(cursor["id"]), "collection": coll, **extra})["cursor"]


def _collect(db: Any, cursor: dict[str, Any], count: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    def more() -> bool:
        events.extend(_get_more(db, cursor, maxTimeMS=200)["nextBatch"])
        return len(events) >= count

    wait_until(more, f"{count} events")
    return events


def test_stream_merges_shards_in_token_order(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    _range_sharded(client, cluster, "cs.merge")
    db = client.cs
    first = _aggregate(db, "merge", [{"$changeStream": {}}])["cursor"]
    assert first["firstBatch"] == [] and "postBatchResumeToken" in first
    for x in (-1, 1, -2, 2, -3, 3):
        db.merge.insert_one({"x": x})
    events = _collect(db, first, 6)
    assert [e["fullDocument"]["x"] for e in events] == [-1, 1, -2, 2, -3, 3]
    tokens = [e["_id"]["_data"] for e in events]
    assert tokens == sorted(tokens)
    assert list(events[0]["documentKey"]) == ["x", "_id"]


def test_quiet_shard_holds_back_a_busy_shards_events() -> None:
    """Without no-ops the idle shard's promise stays put: nothing is released past it."""
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0) as c:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(c.uri)
        _range_sharded(client, c, "q.c")
        db = client.q
        cursor = _aggregate(db, "c", [{"$changeStream": {}}])["cursor"]
        db.c.insert_one({"x": 1})  # shard1 only
        batch = _get_more(db, cursor, maxTimeMS=300)
        assert batch["nextBatch"] == []
        promise = batch["postBatchResumeToken"]
        with c.shards[0].deployment.lock:  # shard0's periodic no-op
            c.shards[0].deployment.log("n", "", {"msg": "periodic noop"})
        events = _collect(db, cursor, 1)
        assert events[0]["fullDocument"]["x"] == 1
        assert promise["_data"] < events[0]["_id"]["_data"]
        client.close()


def test_ddl_on_a_sharded_collection_gives_one_event(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    db = client.ddl
    db.create_collection("s")
    cursor = _aggregate(db, 1, [{"$changeStream": {"showExpandedEvents": True}}])["cursor"]
    client.admin.command("shardCollection", "ddl.s", key={"_id": "hashed"})
    db.s.insert_many([{"_id": i} for i in range(10)])
    db.s.drop()
    events = _collect(db, cursor, 12)
    kinds = [e["operationType"] for e in events]
    assert kinds.count("shardCollection") == 1
    assert kinds.count("insert") == 10
    assert kinds.count("drop") == 1
    shard_event = next(e for e in events if e["operationType"] == "shardCollection")
    assert shard_event["operationDescription"]["shardKey"] == {"_id": "hashed"}


def test_collection_stream_is_invalidated_once(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    client.admin.command("shardCollection", "inv.c", key={"_id": "hashed"})
    db = client.inv
    cursor = _aggregate(db, "c", [{"$changeStream": {}}])["cursor"]
    db.c.insert_many([{"_id": i} for i in range(4)])
    db.c.drop()
    events: list[dict[str, Any]] = []

    def done() -> bool:
        batch = _get_more(db, cursor, maxTimeMS=200)
        events.extend(batch["nextBatch"])
        cursor["id"] = batch["id"]
        return batch["id"] == 0

    wait_until(done, "the invalidate")
    assert [e["operationType"] for e in events] == ["insert"] * 4 + ["drop", "invalidate"]


def test_start_after_an_invalidate_does_not_replay_it(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    """startAfter an invalidate token: the next events, never the invalidate again.

    The shard that saw the drop hands the invalidate back; mongos must skip it (found by the
    Node.js driver's fidelity checks).
    """
    db = client.inv_start_after
    db.c.insert_one({"_id": 0})
    with db.c.watch(max_await_time_ms=200) as stream:
        db.c.drop()
        kinds = [stream.next()["operationType"] for _ in range(2)]
        assert kinds == ["drop", "invalidate"]
        invalidate = stream.resume_token
    with db.c.watch(start_after=invalidate, max_await_time_ms=200) as stream:
        assert stream.try_next() is None
        db.c.insert_one({"_id": 1})
        event = wait_until(stream.try_next, "the insert after startAfter")
        assert (event["operationType"], event["documentKey"]) == ("insert", {"_id": 1})


def test_resume_after_a_split_event_fragment_through_mongos(
    client: pymongo.MongoClient[Any],
) -> None:
    """Resuming after fragment 1 of a split event gives fragment 2, not 280 (token not found).

    The shard must hand mongos the token's own fragment so mongos finds it (found by the
    Node.js driver's fidelity checks).
    """
    db = client.split_resume
    db.create_collection("c", changeStreamPreAndPostImages={"enabled": True})
    big = 10 * 1024 * 1024
    db.c.insert_one({"_id": 1, "v": "q" * big})
    pipeline = [{"$changeStreamSplitLargeEvent": {}}]
    options: dict[str, Any] = {"full_document_before_change": "required", "max_await_time_ms": 200}
    with db.c.watch(pipeline, **options) as stream:
        assert stream.try_next() is None
        db.c.update_one({"_id": 1}, {"$set": {"v": "z" * big}})
        fragments = [wait_until(stream.try_next, f"fragment {i}") for i in (1, 2)]
    assert [f["splitEvent"] for f in fragments] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]
    with db.c.watch(pipeline, resume_after=fragments[0]["_id"], **options) as stream:
        after = wait_until(stream.try_next, "the fragment after the token")
        assert (after["_id"], after["splitEvent"]) == (
            fragments[1]["_id"],
            {"fragment": 2, "of": 2},
        )
    db.c.insert_one({"_id": 2})
    # the last fragment's token resumes at the next event (issue 33, item 18)
    with db.c.watch(pipeline, resume_after=fragments[1]["_id"], **options) as stream:
        after = wait_until(stream.try_next, "the event after the last fragment")
        assert (after["operationType"], after["documentKey"]) == ("insert", {"_id": 2})


def test_resume_after_through_the_other_mongos_and_unknown_token(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    client.admin.command("shardCollection", "res.c", key={"_id": "hashed"})
    a, b = _one(cluster, 0), _one(cluster, 1)
    try:
        cursor = _aggregate(a.res, "c", [{"$changeStream": {}}])["cursor"]
        client.res.c.insert_many([{"_id": i} for i in range(6)])
        events = _collect(a.res, cursor, 6)
        for option in ("resumeAfter", "startAfter"):
            resumed = _aggregate(b.res, "c", [{"$changeStream": {option: events[2]["_id"]}}])
            rest = _collect(b.res, resumed["cursor"], 3)
            assert [e["_id"] for e in rest] == [e["_id"] for e in events[3:]], option
        other = client.res.other
        other.insert_one({"_id": 1})
        foreign = _aggregate(
            b.res, "other", [{"$changeStream": {"startAtOperationTime": events[0]["clusterTime"]}}]
        )
        token = _collect(b.res, foreign["cursor"], 1)[0]["_id"]
        bad = _aggregate(b.res, "c", [{"$changeStream": {"resumeAfter": token}}])["cursor"]
        client.res.c.insert_one({"_id": 100})
        with pytest.raises(OperationFailure) as err:
            _collect(b.res, bad, 1)
        assert err.value.code == 280
    finally:
        a.close()
        b.close()


def test_update_lookup_follows_the_document_to_its_shard(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    _range_sharded(client, cluster, "look.c")
    db = client.look
    db.c.insert_one({"_id": 1, "x": 3})
    cursor = _aggregate(db, "c", [{"$changeStream": {"fullDocument": "updateLookup"}}])["cursor"]
    db.c.update_one({"x": 3}, {"$set": {"v": 1}})
    client.admin.command("moveChunk", "look.c", find={"x": 3}, to="shard0")
    event = _collect(db, cursor, 1)[0]
    assert event["fullDocument"] == {"_id": 1, "x": 3, "v": 1}
    assert _docs_on(cluster, 1, "look", "c") == []


def test_cluster_and_database_streams_span_shards(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    client.admin.command("enableSharding", "span0", primaryShard="shard0")
    client.admin.command("enableSharding", "span1", primaryShard="shard1")
    whole = _aggregate(client.admin, 1, [{"$changeStream": {"allChangesForCluster": True}}])
    client.span0.c.insert_one({"a": 0})
    client.span1.c.insert_one({"a": 1})
    events = _collect(client.admin, whole["cursor"], 2)
    assert [e["ns"]["db"] for e in events] == ["span0", "span1"]


def test_an_ordered_insert_many_is_applied_in_statement_order(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    """mongos sends an ordered batch one shard at a time, in runs of consecutive statements."""
    _range_sharded(client, cluster, "cs.ordered")
    db = client.cs
    first = _aggregate(db, "ordered", [{"$changeStream": {}}])["cursor"]
    xs = [-1, 1, 2, -2, -3, 3]
    db.ordered.insert_many([{"x": x} for x in xs])
    db.ordered.insert_many([{"x": x} for x in (10, -10, 11)], ordered=False)
    events = _collect(db, first, 9)
    assert [e["fullDocument"]["x"] for e in events][:6] == xs, "the change events follow it"
    assert sorted(e["fullDocument"]["x"] for e in events[6:]) == [-10, 10, 11]
    with pytest.raises(pymongo.errors.BulkWriteError) as err:  # stops at the first error
        db.ordered.insert_many([{"_id": "a", "x": -5}, {"_id": "a", "x": -4}, {"x": 6}])
    assert err.value.details["nInserted"] == 1
    assert db.ordered.count_documents({"x": {"$in": [-4, 6]}}) == 0


def test_a_killed_mongos_restarts_on_its_port() -> None:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.2) as c:
        uri = c.mongos_uri(0)
        with pytest.raises(RuntimeError, match="already running"):
            c.restart_mongos(0)
        service_id = c.mongos(0).service_id
        c.kill_mongos(0)
        assert c.mongoses == [c.mongos(1).name]
        assert c.restart_mongos(0) == uri.removeprefix("mongodb://").rstrip("/")
        assert c.mongos(0).service_id != service_id, "a new process"
        with pymongo.MongoClient(uri, directConnection=True) as again:
            assert again.admin.command("hello")["msg"] == "isdbgrid"
            again.r.c.insert_one({"_id": 1})
            assert again.r.c.find_one() == {"_id": 1}
        assert len(c.mongoses) == 2


def test_a_cursor_killed_while_its_get_more_runs_fails_it_and_promises_nothing(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """killCursors landing mid-getMore: 237, never a postBatchResumeToken past unsent events.

    The kill empties the merge cursor's shard cursors; a getMore whose time was up then
    answered an empty batch promising the current cluster time, and a client resuming
    from it skipped every event not yet sent (found by the sharded chaos run).
    """
    from changestream.testing.sharding import merge

    client.admin.command("shardCollection", "cs.killed", key={"_id": "hashed"})
    db = client.cs
    first = _aggregate(db, "killed", [{"$changeStream": {}}])["cursor"]
    db.killed.insert_many([{"_id": i} for i in range(10)])
    poll = merge.MergedChangeStream._poll

    def killed_meanwhile(self: Any) -> None:
        self.close()  # what a killCursors from another connection does
        time.sleep(0.01)  # and the getMore's time (1 ms) runs out
        poll(self)

    monkeypatch.setattr(merge.MergedChangeStream, "_poll", killed_meanwhile)
    with pytest.raises(OperationFailure) as err:
        _get_more(db, first, maxTimeMS=1)
    assert err.value.code == 237
    monkeypatch.undo()
    resumed = _aggregate(
        db, "killed", [{"$changeStream": {"resumeAfter": first["postBatchResumeToken"]}}]
    )["cursor"]
    assert [e["documentKey"]["_id"] for e in _collect(db, resumed, 10)] == list(range(10))


def test_failcommand_is_per_mongos(cluster: ShardedCluster) -> None:
    a, b = _one(cluster, 0), _one(cluster, 1)
    try:
        a.admin.command(
            "configureFailPoint", "failCommand", mode={"times": 1},
            data={"failCommands": ["aggregate"], "errorCode": 6},
        )  # fmt: skip
        _aggregate(b.fp, "c", [{"$changeStream": {}}])  # the other mongos is not affected
        with pytest.raises(OperationFailure) as err:
            _aggregate(a.fp, "c", [{"$changeStream": {}}])
        assert err.value.code == 6
        _aggregate(a.fp, "c", [{"$changeStream": {}}])  # times: 1
    finally:
        a.close()
        b.close()


def test_a_shard_added_mid_stream_shows_up() -> None:
    with ShardedCluster("8.0", shards=1, mongoses=1, noop_interval=0.2) as c:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(c.uri)
        cursor = _aggregate(client.admin, 1, [{"$changeStream": {"allChangesForCluster": True}}])
        name = c.add_shard()
        client.admin.command("enableSharding", "late", primaryShard=name)
        client.late.c.insert_one({"on": name})
        events = _collect(client.admin, cursor["cursor"], 1)
        assert events[0]["fullDocument"]["on"] == name
        client.close()


def test_a_shard_that_is_down_fails_the_aggregate_resumably() -> None:
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.2) as c:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(c.uri)
        c.shards[1].stop()
        with pytest.raises(OperationFailure) as err:
            _aggregate(client.down, "c", [{"$changeStream": {}}])
        assert err.value.code == 133
        assert "ResumableChangeStreamError" in err.value.details["errorLabels"]
        client.close()


def test_show_migration_events_is_refused_by_mongos(client: pymongo.MongoClient[Any]) -> None:
    with pytest.raises(OperationFailure) as err:
        _aggregate(client.m, "c", [{"$changeStream": {"showMigrationEvents": True}}])
    assert err.value.code == 31123


def test_pymongo_watch_survives_a_killed_mongos() -> None:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.2) as c:
        writer: pymongo.MongoClient[Any] = pymongo.MongoClient(
            c.mongos_uri(1), directConnection=True
        )
        writer.admin.command("shardCollection", "kill.c", key={"_id": "hashed"})
        reader: pymongo.MongoClient[Any] = pymongo.MongoClient(
            c.uri, localThresholdMS=0, serverSelectionTimeoutMS=3000
        )  # a getMore waits for its dead mongos this long, then resumes elsewhere
        with reader.kill.c.watch(max_await_time_ms=200) as stream:
            writer.kill.c.insert_many([{"_id": i} for i in range(5)])
            seen = [stream.next()["documentKey"]["_id"] for _ in range(5)]
            index = next(i for i in range(2) if c.mongos(i).deployment.cursors.ids())
            c.kill_mongos(index)
            if index == 1:
                writer.close()
                writer = pymongo.MongoClient(c.mongos_uri(0), directConnection=True)
            writer.kill.c.insert_many([{"_id": i} for i in range(5, 10)])
            seen += [stream.next()["documentKey"]["_id"] for _ in range(5)]
        assert sorted(seen) == list(range(10))  # every event once (order: by token)
        reader.close()
        writer.close()


# -- load balancer ----------------------------------------------------------------------------


def test_load_balancer_service_id_and_cursor_dies_with_its_connection() -> None:
    with ShardedCluster("8.0", shards=2, mongoses=2, load_balancer=True, noop_interval=0.2) as c:
        assert "loadBalanced=true" in c.lb_uri
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(c.lb_uri)
        hello = client.admin.command("hello", loadBalanced=True)
        assert hello["msg"] == "isdbgrid"
        assert hello["serviceId"] in {c.mongos(i).service_id for i in range(2)}
        direct: pymongo.MongoClient[Any] = pymongo.MongoClient(c.uri)
        assert "serviceId" not in direct.admin.command("hello", loadBalanced=True)
        direct.close()
        stream = client.lb.c.watch()
        assert stream.try_next() is None
        mongos = [c.mongos(i) for i in range(2)]
        wait_until(lambda: sum(len(m.deployment.cursors.ids()) for m in mongos) == 1, "a cursor")
        assert c.balancer is not None and c.balancer.connections >= 1
        c.balancer.drop_connections()  # the connection goes away, no killCursors sent
        wait_until(lambda: sum(len(m.deployment.cursors.ids()) for m in mongos) == 0, "no cursor")
        client.close()


def test_serve_sharded_from_the_command_line() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "changestream.testing", "serve", "--sharded", "--port", "0",
         "--shards", "2", "--mongoses", "2", "--noop-interval", "0.5"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        uri = proc.stdout.readline().strip()
        assert uri.startswith("mongodb://") and uri.count(",") == 1
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
        assert client.admin.command("hello")["msg"] == "isdbgrid"
        assert len(client.admin.command("listShards")["shards"]) == 2
        client.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_a_token_older_than_a_shards_oplog_fails_with_286() -> None:
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0, oplog_max_entries=20) as c:
        client = _one(c, 0)
        client.admin.command("shardCollection", "old.c", key={"_id": "hashed"})
        cursor = _aggregate(client.old, "c", [{"$changeStream": {}}])["cursor"]
        client.old.c.insert_many([{"_id": i} for i in range(4)])
        token = _collect(client.old, cursor, 1)[0]["_id"]
        client.old.c.insert_many([{"_id": i} for i in range(4, 200)])  # both oplogs roll over
        with pytest.raises(OperationFailure) as err:
            _aggregate(client.old, "c", [{"$changeStream": {"resumeAfter": token}}])
        assert err.value.code == 286
        assert "NonResumableChangeStreamError" in err.value.details["errorLabels"]
        client.close()


def test_the_first_batchs_token_never_passes_events_still_buffered(
    client: pymongo.MongoClient[dict[str, Any]], cluster: ShardedCluster
) -> None:
    """Opened at a past time with events on both shards, the empty first batch's
    postBatchResumeToken must not promise past events mongos has not returned yet:
    PyMongo's ``watch(resume_after=<that token>)`` still sees every event."""
    _range_sharded(client, cluster, "cs.early")
    start = cluster.clock.current()
    coll = client.cs.early
    coll.insert_many([{"_id": i, "x": x} for i, x in enumerate([-3, 4, -2, 5, -1, 6])])
    with coll.watch(start_at_operation_time=start, max_await_time_ms=50) as opened:
        first_token = opened.resume_token
    assert first_token is not None
    seen: list[Any] = []
    with coll.watch(resume_after=first_token, max_await_time_ms=50) as stream:
        deadline = time.monotonic() + DEADLINE
        while len(seen) < 6 and time.monotonic() < deadline:
            change = stream.try_next()
            if change is not None:
                seen.append(change["documentKey"]["_id"])
    assert sorted(seen) == list(range(6)), seen


# -- split ------------------------------------------------------------------------------------


def test_split_at_middle_find_and_bounds_as_mongos_does(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    """``find`` and ``bounds`` split a chunk at its median (the shard's splitVector with
    force), ``middle`` where it says; config.chunks lists the halves and moveChunk moves one."""
    admin, ns = client.admin, "splits.c"
    admin.command("shardCollection", ns, key={"x": 1})
    client.splits.c.insert_many([{"x": x} for x in range(100)])
    admin.command("split", ns, middle={"x": 50})
    admin.command("split", ns, find={"x": 10})  # the chunk [MinKey, 50): 50 documents
    admin.command("split", ns, bounds=[{"x": 50}, {"x": MaxKey()}])
    owner = cluster.state.table.sharded(ns)
    assert owner is not None
    assert [(c.min[0], c.max[0]) for c in owner.chunks][1:3] == [(25, 50), (50, 75)]
    chunks = client.config.chunks.find({"uuid": client.config.collections.find_one(
        {"_id": ns})["uuid"]})
    assert sorted(c["min"]["x"] for c in chunks if isinstance(c["min"]["x"], int)) == [25, 50, 75]
    other = cluster.shard_names[1] if owner.chunks[0].shard == cluster.shard_names[0] \
        else cluster.shard_names[0]
    admin.command("moveChunk", ns, bounds=[{"x": 25}, {"x": 50}], to=other)
    assert sorted(d["x"] for d in _docs_on(cluster, cluster.shard_names.index(other),
                                           "splits", "c")) == list(range(25, 50))
    assert client.splits.c.count_documents({}) == 100
    moved = client.config.chunks.find_one({"min": {"x": 25}})
    assert moved["shard"] == other and moved["max"] == {"x": 50}


def test_split_errors_as_mongos_reports_them(client: pymongo.MongoClient[Any]) -> None:
    admin, ns = client.admin, "splits.e"
    admin.command("shardCollection", ns, key={"x": 1})
    client.splits.e.insert_many([{"x": 1}, {"x": 1}])
    admin.command("split", ns, middle={"x": 5})
    cases = [
        ({"middle": {"x": 5}}, "new split key {'x': 5} is a boundary key of existing chunk"),
        ({"middle": {"y": 5}}, "new split key {'y': 5} is not valid for shard key pattern"),
        ({}, "need to specify find/bounds or middle"),
        ({"find": {"x": 1}, "middle": {"x": 2}}, "cannot specify find and middle together"),
        ({"find": {"x": 1}, "bounds": [{"x": 1}, {"x": 2}]},
         "cannot specify bounds and find at the same time"),
        ({"bounds": [{"x": 1}]}, "upper bound not specified"),
        ({"bounds": [{"x": 1}, {"x": 5}]}, "no chunk found with the shard key bounds"),
        ({"find": {"y": 1}}, "no shard key found in chunk query"),
    ]
    for args, message in cases:
        with pytest.raises(OperationFailure) as caught:
            admin.command("split", ns, **args)
        assert message in str(caught.value), args
        assert caught.value.code is None and "codeName" not in caught.value.details  # errmsg only
    with pytest.raises(OperationFailure) as caught:  # one key value: indivisible
        admin.command("split", ns, find={"x": -3})
    assert caught.value.code == 106
    assert "Unable to find median in chunk because chunk is indivisible" in str(caught.value)
    with pytest.raises(OperationFailure) as caught:
        admin.command("split", "splits.unsharded", middle={"x": 1})
    assert caught.value.code == 118


# -- snapshot reads and migrations -----------------------------------------------------------


def _snapshot_ids(client: pymongo.MongoClient[Any], db: str, coll: str,
                  at: Any = None) -> list[Any]:
    concern: dict[str, Any] = {"level": "snapshot"}
    if at is not None:
        concern["atClusterTime"] = at
    reply = client[db].command({"aggregate": coll, "pipeline": [{"$sort": {"_id": 1}}],
                                "cursor": {"batchSize": 10_000}, "readConcern": concern})
    return [doc["_id"] for doc in reply["cursor"]["firstBatch"]]


def test_a_snapshot_read_right_after_a_migration_sees_the_moved_chunk() -> None:
    """mongod logs a migration's copies and deletes (``fromMigrate``) at their own times, so
    a snapshot read after moveChunk sees the chunk on its new shard. The simulator's
    migration wrote no oplog entry: until the recipient's next write, a read saw the chunk
    gone from the donor (which had written since) and not yet on the recipient."""
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0) as cluster, \
            pymongo.MongoClient(cluster.uri) as client:
        admin, ns = client.admin, "moved.c"
        admin.command("shardCollection", ns, key={"_id": 1})
        client.moved.c.insert_many([{"_id": i} for i in range(100)])
        admin.command("split", ns, middle={"_id": 50})
        donor = client.config.chunks.find_one({"min._id": 50})["shard"]
        recipient = next(name for name in cluster.shard_names if name != donor)
        admin.command("moveChunk", ns, find={"_id": 50}, to=recipient)
        client.moved.c.insert_one({"_id": -1})  # a write on the donor only
        assert _snapshot_ids(client, "moved", "c") == list(range(-1, 100))


def test_a_snapshot_read_at_a_time_before_a_migration_reads_the_chunk_where_it_was(
    cluster: ShardedCluster, client: pymongo.MongoClient[Any]
) -> None:
    """mongos routes a snapshot read by the chunks at its cluster time: the only chunk moved
    to another shard since is still read (the recipient alone had none of it then)."""
    admin, ns = client.admin, "before.c"
    admin.command("shardCollection", ns, key={"_id": 1})
    client.before.c.insert_many([{"_id": i} for i in range(20)])
    reply = client.before.command({"aggregate": "c", "pipeline": [{"$limit": 1}],
                                   "cursor": {}, "readConcern": {"level": "snapshot"}})
    at = reply["cursor"]["atClusterTime"]
    sharded = cluster.state.table.sharded(ns)
    assert sharded is not None and len(sharded.chunks) == 1
    other = next(name for name in cluster.shard_names if name != sharded.chunks[0].shard)
    admin.command("moveChunk", ns, find={"_id": 0}, to=other)
    assert _snapshot_ids(client, "before", "c", at) == list(range(20))
    found = client.before.command({"find": "c", "filter": {"_id": 7},
                                   "readConcern": {"level": "snapshot", "atClusterTime": at}})
    assert found["cursor"]["firstBatch"] == [{"_id": 7}]
