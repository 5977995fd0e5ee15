"""Point-in-time reads through mongos: one cluster time on every shard, merged replies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure

from changestream.testing import ShardedCluster

Client = pymongo.MongoClient[dict[str, Any]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0) as c:
        yield c


@pytest.fixture
def client(cluster: ShardedCluster) -> Iterator[Client]:
    c: Client = pymongo.MongoClient(cluster.mongos_uri(0), directConnection=True)
    yield c
    c.close()


def _sharded(client: Client, cluster: ShardedCluster, ns: str) -> None:
    """``ns`` sharded on ``_id``: _id < 100 on shard0, _id >= 100 on shard1."""
    admin = client.admin
    admin.command("shardCollection", ns, key={"_id": 1})
    admin.command("split", ns, middle={"_id": 100})
    admin.command("moveChunk", ns, find={"_id": 100}, to=cluster.shard_names[1])
    admin.command("moveChunk", ns, find={"_id": 0}, to=cluster.shard_names[0])


def _on_shard(cluster: ShardedCluster, i: int, ns: str) -> set[Any]:
    db, coll = ns.split(".", 1)
    state = cluster.shards[i].deployment.catalog.get(db, coll)
    return set() if state is None else {d["_id"] for d in state.documents()}


def _find(db: Any, coll: str, at: Timestamp | None = None, **extra: Any) -> dict[str, Any]:
    concern: dict[str, Any] = {"level": "snapshot"}
    if at is not None:
        concern["atClusterTime"] = at
    reply: dict[str, Any] = db.command({"find": coll, "readConcern": concern, **extra})
    return reply


def _get_all(db: Any, first: dict[str, Any]) -> tuple[list[dict[str, Any]], set[Timestamp]]:
    cursor = first["cursor"]
    docs = list(cursor["firstBatch"])
    times = {cursor["atClusterTime"]}
    coll = cursor["ns"].split(".", 1)[1]
    while cursor["id"]:
        cursor = db.command({"getMore": Int64(cursor["id"]), "collection": coll, "batchSize": 7})[
            "cursor"
        ]
        docs.extend(cursor["nextBatch"])
        times.add(cursor["atClusterTime"])
    return docs, times


def test_a_find_at_t_sees_both_shards_as_they_were(client: Client, cluster: ShardedCluster) -> None:
    db = client.snap
    _sharded(client, cluster, "snap.a")
    db.a.insert_many([{"_id": i, "v": 0} for i in range(0, 200, 2)])
    assert _on_shard(cluster, 0, "snap.a") and _on_shard(cluster, 1, "snap.a")
    picked = _find(db, "a", batchSize=5, sort={"_id": 1})
    t = picked["cursor"]["atClusterTime"]
    assert isinstance(t, Timestamp)
    # writes after T on both shards: updates, deletes, inserts
    db.a.update_many({}, {"$inc": {"v": 1}})
    db.a.delete_many({"_id": {"$in": [0, 2, 150, 198]}})
    db.a.insert_many([{"_id": 1, "v": 9}, {"_id": 151, "v": 9}])
    expected = [{"_id": i, "v": 0} for i in range(0, 200, 2)]
    docs, times = _get_all(db, picked)  # the server-picked time, kept across getMores
    assert docs == expected and times == {t}
    docs, times = _get_all(db, _find(db, "a", t, batchSize=3, sort={"_id": 1}))
    assert docs == expected and times == {t}
    now = _find(db, "a", sort={"_id": 1}, batchSize=1000)["cursor"]
    assert now["atClusterTime"] > t
    assert [d["_id"] for d in now["firstBatch"]] == sorted(
        {*range(4, 198, 2), 1, 151} - {150}
    )
    assert all(d["v"] == (9 if d["_id"] in (1, 151) else 1) for d in now["firstBatch"])


def test_aggregate_at_t_on_a_sharded_and_an_unsharded_collection(client: Client, cluster: ShardedCluster) -> None:
    db = client.snap
    _sharded(client, cluster, "snap.b")
    db.b.insert_many([{"_id": i, "v": i} for i in range(0, 200, 10)])
    db.u.insert_many([{"_id": i} for i in range(5)])
    t = client.admin.command("ping")["$clusterTime"]["clusterTime"]
    db.b.update_many({}, {"$set": {"v": -1}})
    db.u.delete_many({})
    concern = {"level": "snapshot", "atClusterTime": t}
    pipeline = [{"$match": {"_id": {"$gte": 50}}}, {"$sort": {"_id": 1}}, {"$project": {"v": 1}}]
    reply = db.command({"aggregate": "b", "pipeline": pipeline, "cursor": {"batchSize": 2},
                        "readConcern": concern})  # fmt: skip
    docs, times = _get_all(db, reply)
    assert docs == [{"_id": i, "v": i} for i in range(50, 200, 10)] and times == {t}
    reply = db.command({"aggregate": "u", "pipeline": [], "cursor": {"batchSize": 2},
                        "readConcern": concern})  # fmt: skip
    docs, times = _get_all(db, reply)
    assert docs == [{"_id": i} for i in range(5)] and times == {t}
    picked = db.command({"aggregate": "u", "pipeline": [], "cursor": {},
                         "readConcern": {"level": "snapshot"}})["cursor"]  # fmt: skip
    assert picked["firstBatch"] == [] and picked["atClusterTime"] > t


def test_snapshot_too_old_from_a_shard_comes_back_through_mongos(
    client: Client, cluster: ShardedCluster
) -> None:
    db = client.snap
    _sharded(client, cluster, "snap.c")
    db.c.insert_many([{"_id": i} for i in range(0, 200, 10)])
    first = _find(db, "c", batchSize=2)["cursor"]
    for rs in cluster.shards:
        rs.deployment.history.restarted(rs.deployment.clock.tick())  # the window moves past T
    with pytest.raises(OperationFailure) as err:
        db.command({"getMore": Int64(first["id"]), "collection": "c"})
    assert err.value.code == 239
    with pytest.raises(OperationFailure) as err:
        _find(db, "c", first["atClusterTime"])
    assert err.value.code == 239 and err.value.details is not None
    assert err.value.details["codeName"] == "SnapshotTooOld"


def test_before_5_0_mongos_refuses_snapshot_reads_outside_transactions() -> None:
    with ShardedCluster("4.4", shards=2, mongoses=1, noop_interval=0) as cluster:
        client: Client = pymongo.MongoClient(cluster.mongos_uri(0), directConnection=True)
        try:
            client.old.c.insert_one({"_id": 1})
            with pytest.raises(OperationFailure) as err:
                _find(client.old, "c")
            assert err.value.code == 72
        finally:
            client.close()
