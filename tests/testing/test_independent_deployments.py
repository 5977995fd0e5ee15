"""Several deployments in one process never affect each other (issue 11, deliverable 2).

Two replica sets of different versions run side by side; failpoints, step-downs,
data, sessions, change streams and connection counters of one never show in the
other.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from bson.int64 import Int64
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet

Client = MongoClient[dict[str, Any]]


@pytest.fixture
def pair(
    start_rs: Callable[..., ReplicaSet], clients: Callable[..., Client]
) -> tuple[ReplicaSet, Client, ReplicaSet, Client]:
    old = start_rs("4.4", members=2, noop_interval=0)
    new = start_rs("8.0", members=3, noop_interval=0)
    return old, clients(old.uri), new, clients(new.uri)


def _topology(client: Client) -> tuple[Any, Any]:
    hello = client.admin.command("hello")
    return hello.get("topologyVersion"), hello.get("electionId")


def test_versions_are_per_deployment(pair: tuple[ReplicaSet, Client, ReplicaSet, Client]) -> None:
    _, old, _, new = pair
    assert old.admin.command("buildInfo")["version"].startswith("4.4")
    assert new.admin.command("buildInfo")["version"].startswith("8.0")
    assert (
        old.admin.command("hello")["maxWireVersion"] < new.admin.command("hello")["maxWireVersion"]
    )


def test_a_failpoint_fails_only_its_own_deployment(
    pair: tuple[ReplicaSet, Client, ReplicaSet, Client],
) -> None:
    _, old, _, new = pair
    old.admin.command(
        "configureFailPoint",
        "failCommand",
        mode="alwaysOn",
        data={"failCommands": ["insert"], "errorCode": 2},
    )
    try:
        with pytest.raises(OperationFailure) as exc:
            old.db.c.insert_one({"_id": 1})
        assert exc.value.code == 2
        new.db.c.insert_one({"_id": 1})  # the other deployment has no failpoint
        assert new.db.c.count_documents({}) == 1
    finally:
        old.admin.command("configureFailPoint", "failCommand", mode="off")
    assert old.db.c.count_documents({}) == 0, "data is per deployment"


def test_a_step_down_moves_only_its_own_deployment(
    pair: tuple[ReplicaSet, Client, ReplicaSet, Client],
) -> None:
    old_rs, _, new_rs, new = pair
    new_primary, new_term = new_rs.primary, new_rs.deployment.term
    new_topology = _topology(new)
    old_primary = old_rs.primary
    assert old_rs.step_down() != old_primary
    assert old_rs.deployment.term == 2
    assert [m.topology_counter for m in old_rs.deployment.members] == [0, 1]
    assert (new_rs.primary, new_rs.deployment.term) == (new_primary, new_term)
    assert _topology(new) == new_topology
    assert new.admin.command("replSetGetStatus")["term"] == new_term


def test_sessions_and_transactions_are_per_deployment(
    pair: tuple[ReplicaSet, Client, ReplicaSet, Client],
) -> None:
    _, old, _, new = pair
    lsid = {"id": new.start_session().session_id["id"]}
    for client in (old, new):
        client.db.create_collection("t")
    new.db.command(
        "insert",
        "t",
        documents=[{"_id": 1}],
        lsid=lsid,
        txnNumber=Int64(1),
        startTransaction=True,
        autocommit=False,
    )
    # The same session id means nothing to the other deployment.
    with pytest.raises(OperationFailure) as exc:
        old.admin.command("commitTransaction", lsid=lsid, txnNumber=Int64(1), autocommit=False)
    assert exc.value.code == 251  # NoSuchTransaction
    new.admin.command("commitTransaction", lsid=lsid, txnNumber=Int64(1), autocommit=False)
    assert new.db.t.find_one() == {"_id": 1}
    assert old.db.t.find_one() is None


def test_change_streams_and_event_caches_are_per_deployment(
    pair: tuple[ReplicaSet, Client, ReplicaSet, Client],
) -> None:
    old_rs, old, new_rs, new = pair
    assert old_rs.deployment.event_cache is not new_rs.deployment.event_cache
    with (
        old.db.c.watch(max_await_time_ms=50) as old_stream,
        new.db.c.watch(max_await_time_ms=50) as new_stream,
    ):
        new.db.c.insert_one({"_id": "new"})
        old.db.c.insert_one({"_id": "old"})
        assert next(old_stream)["documentKey"] == {"_id": "old"}
        assert next(new_stream)["documentKey"] == {"_id": "new"}
        assert old_stream.try_next() is None and new_stream.try_next() is None


def test_connection_counters_are_per_member(start_rs: Callable[..., ReplicaSet]) -> None:
    old_rs = start_rs("4.4", members=2, noop_interval=0)
    new_rs = start_rs("8.0", members=3, noop_interval=0)  # no client connects to it
    old_server = old_rs.deployment.members[0].server
    new_servers = [m.server for m in new_rs.deployment.members]
    assert old_server is not None and old_server not in new_servers
    old_before = old_server.total_created
    new_before = [s.total_created for s in new_servers if s is not None]
    member = old_rs.deployment.members[0]
    socks = [socket.create_connection((member.host, member.port), timeout=10) for _ in range(3)]
    try:
        deadline = time.monotonic() + 30
        while old_server.total_created < old_before + 3:
            assert time.monotonic() < deadline, "the old deployment counted its connections"
            time.sleep(0.01)
        assert [s.total_created for s in new_servers if s is not None] == new_before
    finally:
        for sock in socks:
            sock.close()
