"""``ReplicaSet(dbpath=...)`` / ``serve --dbpath``: data, oplog, cluster time and resume
tokens survive a restart (issue 11, deliverable 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.errors import DuplicateKeyError, OperationFailure

from changestream.testing import ReplicaSet
from changestream.testing.storage.persist import DbPathError

Client = MongoClient[dict[str, Any]]
StartRs = Callable[..., ReplicaSet]
Clients = Callable[..., Client]


def _op_time(client: Client) -> Timestamp:
    reply = client.admin.command("ping")
    ts = reply["operationTime"]
    assert isinstance(ts, Timestamp)
    return ts


def test_data_indexes_views_and_cluster_time_survive_a_restart(
    tmp_path: Path, start_rs: StartRs, clients: Clients
) -> None:
    first = start_rs("8.0", dbpath=tmp_path)
    client = clients(first.uri)
    db = client.shop
    db.orders.insert_many([{"_id": i, "sku": f"s{i}", "n": i * 1.5} for i in range(5)])
    db.orders.create_index("sku", unique=True)
    db.orders.update_one({"_id": 2}, {"$set": {"n": 99}})
    db.orders.delete_one({"_id": 4})
    db.create_collection("big", viewOn="orders", pipeline=[{"$match": {"n": {"$gt": 5}}}])
    before = {c["name"]: c for c in db.list_collections()}
    indexes = list(db.orders.list_indexes())
    last = _op_time(client)
    client.close()
    first.stop()

    second = start_rs("8.0", dbpath=tmp_path)
    client = clients(second.uri)
    db = client.shop
    assert list(db.orders.find()) == [
        {"_id": 0, "sku": "s0", "n": 0.0},
        {"_id": 1, "sku": "s1", "n": 1.5},
        {"_id": 2, "sku": "s2", "n": 99},
        {"_id": 3, "sku": "s3", "n": 4.5},
    ]
    assert {c["name"]: c for c in db.list_collections()} == before, "same options and UUIDs"
    assert list(db.orders.list_indexes()) == indexes
    assert [d["_id"] for d in db.big.find()] == [2]
    with pytest.raises(DuplicateKeyError):
        db.orders.insert_one({"_id": 9, "sku": "s1"})  # the unique index still holds
    assert db.orders.insert_one({"_id": 10}).inserted_id == 10
    assert _op_time(client) > last, "new writes are stamped after the old ones"


@pytest.mark.parametrize("version", ["4.4", "7.0"])
def test_a_token_taken_before_a_restart_resumes_after_it(
    version: str, tmp_path: Path, start_rs: StartRs, clients: Clients
) -> None:
    first = start_rs(version, dbpath=tmp_path)
    client = clients(first.uri)
    coll = client.app.events
    with coll.watch() as stream:
        coll.insert_one({"_id": "before"})
        assert next(stream)["documentKey"] == {"_id": "before"}
        token = stream.resume_token
    coll.insert_one({"_id": "missed"})  # written after the token, before the restart
    with client.start_session() as session, session.start_transaction():
        coll.insert_many([{"_id": "t1"}, {"_id": "t2"}], session=session)
    client.close()
    first.stop()

    second = start_rs(version, dbpath=tmp_path)
    client = clients(second.uri)
    coll = client.app.events
    coll.insert_one({"_id": "after"})
    with coll.watch(resume_after=token) as resumed:
        events = [next(resumed) for _ in range(4)]
        assert [e["documentKey"]["_id"] for e in events] == ["missed", "t1", "t2", "after"]
        assert events[1]["clusterTime"] == events[2]["clusterTime"], "one transaction"
        assert "lsid" in events[1] and "txnNumber" in events[1]
        assert resumed.try_next() is None


def test_an_open_pymongo_stream_carries_on_across_a_restart(
    tmp_path: Path, start_rs: StartRs, clients: Clients
) -> None:
    first = start_rs("8.0", dbpath=tmp_path)
    port = first.deployment.members[0].port
    client = clients(first.uri, serverSelectionTimeoutMS=20000)
    coll = client.app.events
    stream = coll.watch(max_await_time_ms=100)
    try:
        coll.insert_one({"_id": 1})
        assert next(stream)["documentKey"] == {"_id": 1}
        first.stop()
        start_rs("8.0", port=port, dbpath=tmp_path)
        with clients(first.uri) as writer:
            writer.app.events.insert_one({"_id": 2})
        # PyMongo's own resume: a network error, then aggregate with the cached token.
        assert next(stream)["documentKey"] == {"_id": 2}
    finally:
        stream.close()


def test_restart_brings_a_three_member_set_back_on_its_ports(
    tmp_path: Path, start_rs: StartRs, clients: Clients
) -> None:
    rs = start_rs("8.0", members=3, dbpath=tmp_path)
    uri, members = rs.uri, rs.members
    client = clients(uri, serverSelectionTimeoutMS=20000)
    coll = client.app.events
    stream = coll.watch(max_await_time_ms=100)
    try:
        coll.insert_one({"_id": 1})
        assert next(stream)["documentKey"] == {"_id": 1}
        token = stream.resume_token
        term = rs.deployment.term
        rs.kill_member(1)  # a member that is down comes back too
        rs.restart()
        assert (rs.uri, rs.members) == (uri, members), "same ports, same URI"
        assert all(m.up for m in rs.deployment.members) and rs.primary is not None
        assert rs.deployment.term == term + 1, "the set elects a primary again"
        coll.insert_one({"_id": 2})
        # PyMongo's own resume: InterruptedAtShutdown or a network error, then aggregate.
        assert next(stream)["documentKey"] == {"_id": 2}
        with coll.watch(resume_after=token) as resumed:
            assert next(resumed)["documentKey"] == {"_id": 2}, "the token survived"
        rs.restart()  # restarts again (its listeners and no-op writer are new)
        assert [d["_id"] for d in coll.find()] == [1, 2]
    finally:
        stream.close()


def test_restart_needs_a_dbpath(start_rs: StartRs) -> None:
    rs = start_rs("8.0")
    with pytest.raises(RuntimeError, match=r"restart\(\) needs a dbpath"):
        rs.restart()
    with pytest.raises(RuntimeError, match="not started"):
        ReplicaSet("8.0").restart()


def test_one_deployment_per_dbpath(tmp_path: Path, start_rs: StartRs) -> None:
    start_rs("8.0", dbpath=tmp_path)
    with pytest.raises(DbPathError, match="Unable to lock the lock file"):
        ReplicaSet("8.0", dbpath=tmp_path)


def test_another_deployments_data_is_refused(tmp_path: Path, start_rs: StartRs) -> None:
    start_rs("8.0", dbpath=tmp_path).stop()
    with pytest.raises(DbPathError, match="replica set 'rs0', not of replica set 'other'"):
        ReplicaSet("8.0", set_name="other", dbpath=tmp_path)
    with pytest.raises(DbPathError, match="replica set 'rs0', not of a standalone"):
        ReplicaSet("8.0", standalone=True, dbpath=tmp_path)
    ReplicaSet("8.0", dbpath=tmp_path).start().stop()  # the refusals released the lock


def _serve(dbpath: Path) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "changestream.testing",
            "serve",
            "--port",
            "0",
            "--dbpath",
            str(dbpath),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_serve_keeps_its_data_in_dbpath_across_ctrl_c(tmp_path: Path) -> None:
    proc, uri = _serve(tmp_path)
    try:
        with MongoClient(uri, serverSelectionTimeoutMS=10000) as client:
            client.db.c.insert_one({"_id": "kept"})
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        proc, uri = _serve(tmp_path)
        with MongoClient(uri, serverSelectionTimeoutMS=10000) as client:
            assert list(client.db.c.find()) == [{"_id": "kept"}]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_standalone_keeps_its_data(tmp_path: Path, start_rs: StartRs, clients: Clients) -> None:
    first = start_rs("8.0", standalone=True, dbpath=tmp_path)
    writer = clients(first.uri)
    writer.db.c.insert_many([{"_id": 1}, {"_id": 2}])
    writer.close()  # before the stop: closed after it, it waits 5 s to send endSessions
    first.stop()
    second = start_rs("8.0", standalone=True, dbpath=tmp_path)
    assert [d["_id"] for d in clients(second.uri).db.c.find()] == [1, 2]


def test_history_lost_stays_lost_after_a_restart(
    tmp_path: Path, start_rs: StartRs, clients: Clients
) -> None:
    first = start_rs("8.0", dbpath=tmp_path, oplog_max_entries=5)
    client = clients(first.uri)
    with client.db.c.watch() as stream:
        client.db.c.insert_one({"_id": 0})
        next(stream)
        old_token = stream.resume_token
    client.db.c.insert_many([{"_id": i} for i in range(1, 10)])
    client.close()  # before the stop: closed after it, it waits 5 s to send endSessions
    first.stop()
    second = start_rs("8.0", dbpath=tmp_path, oplog_max_entries=5)
    with pytest.raises(OperationFailure) as exc:
        clients(second.uri).db.c.watch(resume_after=old_token).try_next()
    assert exc.value.code == 286
