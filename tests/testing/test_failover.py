"""ReplicaSet.step_down() as PyMongo lives through it: rediscovery, retried writes, cursors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pymongo import MongoClient, monitoring
from pymongo.errors import ConnectionFailure, OperationFailure

from changestream.testing import ReplicaSet

Client = MongoClient[dict[str, Any]]


class Served(monitoring.CommandListener):
    """Which member answered each successful command."""

    def __init__(self) -> None:
        self.succeeded_on: list[tuple[str, str]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        host, port = event.connection_id
        self.succeeded_on.append((event.command_name, f"{host}:{port}"))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.fixture
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0", members=3) as replset:
        yield replset


@pytest.fixture
def served() -> Served:
    return Served()


@pytest.fixture
def client(rs: ReplicaSet, served: Served) -> Iterator[Client]:
    c: Client = MongoClient(
        rs.uri, serverSelectionTimeoutMS=5000, heartbeatFrequencyMS=500, event_listeners=[served]
    )
    c.admin.command("ping")
    yield c
    c.close()


@pytest.mark.parametrize("close_connections", [True, False])
def test_writes_go_to_the_new_primary(
    rs: ReplicaSet, client: Client, served: Served, close_connections: bool
) -> None:
    coll = client.db.coll
    coll.insert_one({"_id": 1})
    old = rs.primary
    new = rs.step_down(close_connections=close_connections)
    assert new != old and rs.primary == new
    coll.insert_one({"_id": 2})  # a retryable write: retried on the new primary if needed
    coll.insert_one({"_id": 3})
    assert sorted(d["_id"] for d in coll.find()) == [1, 2, 3]
    inserts = [addr for name, addr in served.succeeded_on if name == "insert"]
    assert inserts[0] == old and inserts[1:] == [new, new]


def test_write_on_the_stepped_down_primary_fails_without_retries(rs: ReplicaSet) -> None:
    old = rs.primary
    assert old is not None
    with MongoClient(f"mongodb://{old}/?directConnection=true", retryWrites=False) as direct:
        direct.db.coll.insert_one({"_id": 1})
        rs.step_down(close_connections=False)
        with pytest.raises(ConnectionFailure) as exc:  # NotPrimaryError
            direct.db.coll.insert_one({"_id": 2})
        details = getattr(exc.value, "details", None)
        assert details is not None and details["code"] == 10107
        assert "errorLabels" not in details  # no txnNumber: not a retryable write


def test_find_cursor_on_a_crashed_primary_is_lost(rs: ReplicaSet, client: Client) -> None:
    coll = client.db.coll
    coll.insert_many([{"_id": i} for i in range(10)])
    cursor = coll.find(batch_size=2)
    assert [next(cursor)["_id"] for _ in range(2)] == [0, 1]
    rs.step_down(close_connections=True)
    with pytest.raises((ConnectionFailure, OperationFailure)) as exc:
        list(cursor)
    if isinstance(exc.value, OperationFailure):
        assert exc.value.code == 43  # CursorNotFound on the restarted member
    assert rs.deployment.cursors.ids() == []


def test_find_cursor_survives_repl_set_step_down(rs: ReplicaSet, client: Client) -> None:
    coll = client.db.coll
    coll.insert_many([{"_id": i} for i in range(10)])
    cursor = coll.find(batch_size=2)
    assert next(cursor)["_id"] == 0
    rs.step_down(close_connections=False)
    assert [d["_id"] for d in cursor] == list(range(1, 10))  # continued on the now-secondary


def test_single_member_step_down_reelects_itself() -> None:
    with (
        ReplicaSet("8.0") as single,
        MongoClient(single.uri, serverSelectionTimeoutMS=5000, heartbeatFrequencyMS=500) as c,
    ):
        c.db.coll.insert_one({"_id": 1})
        member = single.primary
        assert single.step_down() == member and single.deployment.term == 2
        c.db.coll.insert_one({"_id": 2})
        assert c.db.coll.count_documents({}) == 2


def test_change_stream_resumes_across_a_failover(rs: ReplicaSet, client: Client) -> None:
    coll = client.db.coll
    coll.insert_one({"_id": 0})
    with coll.watch(max_await_time_ms=100) as stream:
        coll.insert_one({"_id": 1})
        assert stream.next()["documentKey"] == {"_id": 1}
        rs.step_down(close_connections=True)
        coll.insert_one({"_id": 2})
        coll.insert_one({"_id": 3})
        seen = [stream.next()["documentKey"]["_id"] for _ in range(2)]
    assert seen == [2, 3]


def test_step_down_of_a_standalone_is_refused() -> None:
    with ReplicaSet("8.0", standalone=True) as single, pytest.raises(RuntimeError):
        single.step_down()


def test_a_get_more_waiting_during_a_crash_sees_a_network_error(
    rs: ReplicaSet, client: Client
) -> None:
    """The stream resumes: a crash drops the connection before the cursor is gone."""
    coll = client.db.coll
    coll.insert_one({"_id": 0})
    with coll.watch(max_await_time_ms=2000) as stream:
        received: list[Any] = []
        waiter = threading.Thread(target=lambda: received.append(stream.next()))
        waiter.start()
        time.sleep(0.3)  # the getMore is now waiting on the primary
        new_primary = rs.step_down(close_connections=True)
        with MongoClient(new_primary, directConnection=True) as direct:
            direct.db.coll.insert_one({"_id": 1})
        waiter.join(timeout=30)
        assert not waiter.is_alive()
    assert received and received[0]["documentKey"] == {"_id": 1}
