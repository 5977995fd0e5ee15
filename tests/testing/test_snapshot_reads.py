"""Point-in-time reads (``readConcern: {level: "snapshot", atClusterTime}``) in the simulator.

What mongod does, per ``jstests/replsets/non_transaction_snapshot_reads.js`` and the
server notes: find and aggregate read at the given time (or pick one and report it),
every cursor reply carries ``atClusterTime``, getMores keep it, times older than
``minSnapshotHistoryWindowInSeconds`` fail with SnapshotTooOld (239), servers before
5.0 refuse snapshot reads outside transactions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet, get_profile
from changestream.testing.commands.aggregate import aggregate
from changestream.testing.commands.reads import find
from changestream.testing.core.context import CommandContext, ConnectionInfo
from changestream.testing.core.errors import CommandError
from changestream.testing.storage.deployment import Deployment

Client = MongoClient[dict[str, Any]]


def _find(db: Any, at: Timestamp | None = None, **extra: Any) -> dict[str, Any]:
    concern: dict[str, Any] = {"level": "snapshot"}
    if at is not None:
        concern["atClusterTime"] = at
    return db.command({"find": "c", "readConcern": concern, **extra})  # type: ignore[no-any-return]


@pytest.fixture
def sim(start_rs: Callable[..., ReplicaSet], clients: Callable[..., Client]) -> tuple[ReplicaSet, Client]:
    rs = start_rs("8.0")
    return rs, clients(rs.uri)


def test_find_at_cluster_time_sees_the_documents_as_they_were(sim: tuple[ReplicaSet, Client]) -> None:
    _, client = sim
    db = client.test
    t1 = db.command({"insert": "c", "documents": [{"_id": i, "v": 0} for i in range(5)]})[
        "operationTime"
    ]
    db.c.update_one({"_id": 1}, {"$set": {"v": 1}})
    db.c.delete_one({"_id": 2})
    db.c.replace_one({"_id": 3}, {"w": 3})
    db.c.insert_one({"_id": 9})
    reply = _find(db, t1, sort={"_id": 1})
    assert reply["cursor"]["atClusterTime"] == t1
    assert reply["cursor"]["firstBatch"] == [{"_id": i, "v": 0} for i in range(5)]
    now = _find(db, sort={"_id": 1})["cursor"]["firstBatch"]
    assert now == [{"_id": 0, "v": 0}, {"_id": 1, "v": 1}, {"_id": 3, "w": 3}, {"_id": 4, "v": 0}, {"_id": 9}]


def test_without_at_cluster_time_the_server_picks_the_last_write(sim: tuple[ReplicaSet, Client]) -> None:
    _, client = sim
    db = client.test
    t = db.command({"insert": "c", "documents": [{"_id": 1}]})["operationTime"]
    assert _find(db)["cursor"]["atClusterTime"] == t
    reply = db.command(
        {"aggregate": "c", "pipeline": [{"$sort": {"_id": 1}}], "cursor": {},
         "readConcern": {"level": "snapshot"}}
    )
    assert reply["cursor"]["atClusterTime"] == t
    plain = db.command({"find": "c"})
    assert "atClusterTime" not in plain["cursor"]


def test_get_more_keeps_the_time(sim: tuple[ReplicaSet, Client]) -> None:
    _, client = sim
    db = client.test
    t = db.command({"insert": "c", "documents": [{"_id": i} for i in range(10)]})["operationTime"]
    with client.start_session() as session:
        first = db.command(
            {"aggregate": "c", "pipeline": [{"$sort": {"_id": 1}}], "cursor": {"batchSize": 3},
             "readConcern": {"level": "snapshot", "atClusterTime": t}},
            session=session,
        )
        db.c.delete_many({})
        db.c.insert_one({"_id": 100})
        ids = [d["_id"] for d in first["cursor"]["firstBatch"]]
        cid = first["cursor"]["id"]
        while cid:
            more = db.command({"getMore": cid, "collection": "c", "batchSize": 3}, session=session)
            assert more["cursor"]["atClusterTime"] == t
            ids += [d["_id"] for d in more["cursor"]["nextBatch"]]
            cid = more["cursor"]["id"]
    assert ids == list(range(10))


def test_id_range_match_and_sort_at_a_time(sim: tuple[ReplicaSet, Client]) -> None:
    _, client = sim
    db = client.test
    db.c.insert_many([{"_id": i} for i in range(20, 0, -1)])
    t = client.admin.command("ping")["operationTime"]
    db.c.insert_one({"_id": 7.5})
    reply = db.command(
        {"aggregate": "c",
         "pipeline": [{"$match": {"_id": {"$gte": 5, "$lt": 9}}}, {"$sort": {"_id": 1}},
                      {"$project": {"x": "$_id"}}],
         "cursor": {}, "readConcern": {"level": "snapshot", "atClusterTime": t}}
    )
    assert reply["cursor"]["firstBatch"] == [{"_id": i, "x": i} for i in (5, 6, 7, 8)]
    mixed = db.command(
        {"find": "c", "filter": {"_id": {"$gte": 19}}, "sort": {"_id": -1},
         "readConcern": {"level": "snapshot"}}
    )
    assert [d["_id"] for d in mixed["cursor"]["firstBatch"]] == [20, 19]


def test_set_parameter_window_and_snapshot_too_old(sim: tuple[ReplicaSet, Client]) -> None:
    _, client = sim
    db = client.test
    assert client.admin.command("getParameter", 1, minSnapshotHistoryWindowInSeconds=1)[
        "minSnapshotHistoryWindowInSeconds"
    ] == 300
    t = db.command({"insert": "c", "documents": [{"_id": 1}]})["operationTime"]
    was = client.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 1})
    assert was["was"] == 300
    deadline = time.monotonic() + 30
    while True:
        db.c.insert_one({})  # writes move the oldest timestamp, as they do on mongod
        try:
            _find(db, t)
        except OperationFailure as exc:
            assert exc.code == 239
            assert f"Read timestamp Timestamp({t.time}, {t.inc}) is older than the oldest" in str(exc)
            break
        assert time.monotonic() < deadline, "the read never became too old"
        time.sleep(0.2)
    with pytest.raises(OperationFailure) as bad:
        client.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": -1})
    assert bad.value.code == 2
    with pytest.raises(OperationFailure) as unknown:
        client.admin.command({"setParameter": 1, "noSuchKnob": 1})
    assert unknown.value.code == 72


def test_a_cursor_that_outlives_the_window_fails(sim: tuple[ReplicaSet, Client]) -> None:
    rs, client = sim
    db = client.test
    t = db.command({"insert": "c", "documents": [{"_id": i} for i in range(5)]})["operationTime"]
    with client.start_session() as session:
        first = db.command(
            {"find": "c", "batchSize": 1, "readConcern": {"level": "snapshot", "atClusterTime": t}},
            session=session,
        )
        more = {"getMore": first["cursor"]["id"], "collection": "c", "batchSize": 1}
        assert db.command(more, session=session)["cursor"]["nextBatch"] == [{"_id": 1}]
        client.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 0})
        deadline = time.monotonic() + 30
        while rs.deployment.history.oldest() <= t:
            assert time.monotonic() < deadline, "the window never moved past the read time"
            # the latest write stays readable: a newer one (the next second) moves the window
            db.command({"insert": "other", "documents": [{}]})
            time.sleep(0.1)
        with pytest.raises(OperationFailure) as exc:
            db.command(more, session=session)
        assert exc.value.code == 239


def test_drop_during_a_snapshot_cursor_kills_it(sim: tuple[ReplicaSet, Client]) -> None:
    _, client = sim
    db = client.test
    db.c.insert_many([{"_id": i} for i in range(5)])
    with client.start_session() as session:
        first = db.command(
            {"find": "c", "batchSize": 1, "readConcern": {"level": "snapshot"}}, session=session
        )
        db.c.rename("d")
        with pytest.raises(OperationFailure) as renamed:
            db.command({"getMore": first["cursor"]["id"], "collection": "c"}, session=session)
        assert renamed.value.code == 175
        assert "collection renamed from 'test.c' to 'test.d'" in str(renamed.value)
        second = db.command(
            {"find": "d", "batchSize": 1, "readConcern": {"level": "snapshot"}}, session=session
        )
        db.d.drop()
        with pytest.raises(OperationFailure) as dropped:
            db.command({"getMore": second["cursor"]["id"], "collection": "d"}, session=session)
        assert dropped.value.code == 175
        assert "collection dropped" in str(dropped.value)


@pytest.mark.parametrize("version", ["4.2", "4.4"])
def test_before_5_0_snapshot_reads_need_a_transaction(version: str) -> None:
    # PyMongo 4.x cannot connect to 4.2: call the handlers directly
    d = Deployment(get_profile(version))

    def run(body: dict[str, Any]) -> dict[str, Any]:
        ctx = CommandContext(
            deployment=d, member=d.members[0], connection=ConnectionInfo(1, ("127.0.0.1", 1)),
            db="test", name=next(iter(body)), body=body,
        )
        return find(ctx) if "find" in body else aggregate(ctx)

    for body in (
        {"find": "c", "readConcern": {"level": "snapshot"}},
        {"aggregate": "c", "pipeline": [], "cursor": {}, "readConcern": {"level": "snapshot"}},
    ):
        with pytest.raises(CommandError) as plain:
            run(body)
        assert plain.value.code == 72
        assert "only valid in multi-statement transactions" in plain.value.errmsg
    with pytest.raises(CommandError) as at:
        run({"find": "c", "readConcern": {"level": "snapshot", "atClusterTime": Timestamp(1, 1)}})
    assert at.value.code == 72
    assert "atClusterTime is only used for testing" in at.value.errmsg


def test_bad_at_cluster_time(sim: tuple[ReplicaSet, Client]) -> None:
    _, client = sim
    db = client.test
    db.c.insert_one({"_id": 1})
    future = client.admin.command("ping")["operationTime"]
    with pytest.raises(OperationFailure) as ahead:
        _find(db, Timestamp(future.time + 100, 1))
    assert ahead.value.code == 72
    with pytest.raises(OperationFailure) as level:
        db.command({"find": "c", "readConcern": {"level": "local", "atClusterTime": future}})
    assert level.value.code == 72


def test_collection_created_after_the_time(
    start_rs: Callable[..., ReplicaSet], clients: Callable[..., Client]
) -> None:
    for version, code in (("6.0", 246), ("8.0", None)):
        rs = start_rs(version)
        client = clients(rs.uri)
        client.test.other.insert_one({})
        t = client.admin.command("ping")["operationTime"]
        client.test.c.insert_one({"_id": 1})
        if code is None:
            assert _find(client.test, t)["cursor"]["firstBatch"] == []
        else:
            with pytest.raises(OperationFailure) as exc:
                _find(client.test, t)
            assert exc.value.code == code


def test_history_memory_is_bounded(sim: tuple[ReplicaSet, Client]) -> None:
    rs, client = sim
    history = rs.deployment.history
    history.max_versions = 200
    coll = client.test.c
    coll.insert_one({"_id": 1, "n": 0})
    t = client.admin.command("ping")["operationTime"]
    for n in range(1, 400):
        coll.update_one({"_id": 1}, {"$set": {"n": n}})
    assert history.stats()["versions"] <= 200
    with pytest.raises(OperationFailure) as exc:
        _find(client.test, t)
    assert exc.value.code == 239
    recent = client.admin.command("ping")["operationTime"]
    assert _find(client.test, recent)["cursor"]["firstBatch"] == [{"_id": 1, "n": 399}]


def test_after_a_restart_from_dbpath_older_times_are_too_old(tmp_path: Any) -> None:
    with ReplicaSet("8.0", dbpath=tmp_path) as rs, MongoClient(rs.uri) as client:
        client.test.c.insert_many([{"_id": i} for i in range(3)])
        t = client.admin.command("ping")["operationTime"]
        client.test.c.insert_one({"_id": 3})
    with ReplicaSet("8.0", dbpath=tmp_path) as rs, MongoClient(rs.uri) as client:
        with pytest.raises(OperationFailure) as exc:
            _find(client.test, t)
        assert exc.value.code == 239
        assert len(_find(client.test)["cursor"]["firstBatch"]) == 4
