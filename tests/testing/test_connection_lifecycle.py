"""A connection the client closes is closed on the server too: no CLOSE_WAIT socket, no worker.

The simulator serves each request in flight on a worker thread. A client may leave while
the server is waiting on its behalf (an awaitable hello, a change-stream getMore
waiting for events, failCommand's ``blockConnection``); mongod notices that the
client is gone and ends the operation, so the simulator must too, or the thread
and its socket (in CLOSE_WAIT) outlive the client for as long as the wait lasts.
Stopping a replica set or a crash-like step-down closes every connection at once.

Every wait here is 60 s long and every check is bounded well below that, so each
test fails (with what was left over) when a closed peer goes unnoticed.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bson
import pytest
from bson.int64 import Int64
from pymongo import MongoClient, monitoring

from changestream.testing import ReplicaSet
from changestream.testing.server import wire

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("MONGODB_URI")),
    reason="simulator-specific: counts the simulator's own sockets and threads "
    "(MONGODB_URI is set)",
)

LONG_WAIT_MS = 60_000
"""How long each server-side wait would last if the closed peer went unnoticed."""
BOUND = 10.0
"""Seconds within which the server must have let go of closed connections."""
HEADER = struct.Struct("<iiii")
_CLOSE_WAIT = "08"


# -- a raw client that can leave at any moment ---------------------------------------------------


class RawConnection:
    """One OP_MSG connection to a member, without a driver."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=5)
        self._request_id = 0

    def send(self, body: dict[str, Any], *, flags: int = 0) -> None:
        self._request_id += 1
        payload = b"\x00" + bson.encode(body)
        header = HEADER.pack(20 + len(payload), self._request_id, 0, wire.OP_MSG)
        self.sock.sendall(header + struct.pack("<I", flags) + payload)

    def reply(self) -> dict[str, Any]:
        header = self._recv(16)
        length = HEADER.unpack(header)[0]
        return bson.decode(self._recv(length - 16)[5:])

    def command(self, body: dict[str, Any]) -> dict[str, Any]:
        self.send(body)
        reply = self.reply()
        assert reply.get("ok") == 1.0, reply
        return reply

    def assert_waiting(self) -> None:
        """The server holds the request: no reply has come (call a moment after sending)."""
        self.sock.setblocking(False)
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        finally:
            self.sock.settimeout(5)
        raise AssertionError(f"expected the server to wait, got {data!r}")

    def close(self) -> None:
        self.sock.close()

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            buf += chunk
        return buf


def awaitable_hello(conn: RawConnection, *, exhaust: bool) -> None:
    """Leave ``conn`` waiting in a streaming (exhaust) or long-polling hello."""
    tv = conn.command({"hello": 1, "$db": "admin"})["topologyVersion"]
    body = {"hello": 1, "topologyVersion": tv, "maxAwaitTimeMS": LONG_WAIT_MS, "$db": "admin"}
    conn.send(body, flags=wire.EXHAUST_ALLOWED if exhaust else 0)


def waiting_get_more(conn: RawConnection) -> None:
    """Leave ``conn`` in a change-stream getMore waiting for events."""
    cursor = conn.command(
        {"aggregate": "coll", "pipeline": [{"$changeStream": {}}], "cursor": {}, "$db": "db"}
    )["cursor"]
    conn.send(
        {
            "getMore": Int64(cursor["id"]),
            "collection": "coll",
            "maxTimeMS": LONG_WAIT_MS,
            "$db": "db",
        }
    )


def block(rs: ReplicaSet, *commands: str, block_ms: int = LONG_WAIT_MS, times: int = 100) -> None:
    """failCommand ``blockConnection`` for ``commands`` on the primary."""
    assert rs.primary is not None
    conn = RawConnection(rs.primary)
    conn.command(
        {
            "configureFailPoint": "failCommand",
            "mode": {"times": times},
            "data": {
                "failCommands": list(commands),
                "blockConnection": True,
                "blockTimeMS": block_ms,
            },
            "$db": "admin",
        }
    )
    conn.close()


# -- what the server still holds --------------------------------------------------------------


def _close_wait_sockets(ports: set[int]) -> int | None:
    """Server sockets (local port a member's) in CLOSE_WAIT; None where /proc/net/tcp is absent."""
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():
        return None
    count = 0
    for table in tables:
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _CLOSE_WAIT and int(fields[1].rsplit(":", 1)[1], 16) in ports:
                count += 1
    return count


def _server_threads() -> set[threading.Thread]:
    """The simulator's I/O threads and workers."""
    return {t for t in threading.enumerate() if t.name.startswith("sim-")}


class Leftovers:
    """The server side of a replica set's connections, against a count the test keeps open."""

    def __init__(self, rs: ReplicaSet) -> None:
        self.rs = rs
        self.ports = {m.port for m in rs.deployment.members}

    def snapshot(self) -> dict[str, Any]:
        servers = [m.server for m in self.rs.deployment.members]
        return {
            "connections": sum(s.connection_count for s in servers if s is not None),
            "serving": sum(s.listener.busy_count() for s in servers if s is not None),
            "close_wait": _close_wait_sockets(self.ports),
        }

    def wait_for(self, open_connections: int, what: str) -> None:
        """Within :data:`BOUND`, exactly ``open_connections`` remain, each still served
        (they all wait), and nothing in CLOSE_WAIT."""
        deadline = time.monotonic() + BOUND
        while True:
            now = self.snapshot()
            if (
                now["connections"] == open_connections
                and now["serving"] == open_connections
                and not now["close_wait"]
            ):
                return
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{what}: {BOUND:.0f}s later the server still holds {now} "
                    f"(expected {open_connections} connections served, no CLOSE_WAIT)"
                )
            time.sleep(0.05)


@pytest.fixture
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0", members=2, noop_interval=0) as started:
        yield started


@pytest.fixture
def leftovers(rs: ReplicaSet) -> Leftovers:
    return Leftovers(rs)


def _open(rs: ReplicaSet, n: int, start: Callable[[RawConnection], None]) -> list[RawConnection]:
    assert rs.primary is not None
    conns = [RawConnection(rs.primary) for _ in range(n)]
    for conn in conns:
        start(conn)
    time.sleep(0.3)
    for conn in conns:
        conn.assert_waiting()
    return conns


# -- the client leaves ---------------------------------------------------------------------------


@pytest.mark.parametrize("exhaust", [True, False], ids=["streaming", "polling"])
def test_a_client_leaving_an_awaitable_hello_is_noticed(
    rs: ReplicaSet, leftovers: Leftovers, exhaust: bool
) -> None:
    conns = _open(rs, 5, lambda c: awaitable_hello(c, exhaust=exhaust))
    stays = RawConnection(rs.members[1])
    awaitable_hello(stays, exhaust=exhaust)
    time.sleep(0.3)
    for conn in conns:
        conn.close()
    leftovers.wait_for(1, "5 clients closed while waiting in an awaitable hello")
    stays.assert_waiting()  # a client still there keeps waiting
    stays.close()
    leftovers.wait_for(0, "the last client closed")


def test_a_client_leaving_a_change_stream_get_more_is_noticed(
    rs: ReplicaSet, leftovers: Leftovers
) -> None:
    conns = _open(rs, 5, waiting_get_more)
    assert len(rs.deployment.cursors.ids()) == 5
    for conn in conns:
        conn.close()
    leftovers.wait_for(0, "5 clients closed while their getMore waited for events")
    # As on mongod, the interrupted getMore takes its cursor with it.
    assert rs.deployment.cursors.ids() == []


def test_a_client_leaving_a_blocked_read_is_noticed(rs: ReplicaSet, leftovers: Leftovers) -> None:
    block(rs, "find")
    conns = _open(rs, 3, lambda c: c.send({"find": "coll", "$db": "db"}))
    for conn in conns:
        conn.close()
    leftovers.wait_for(0, "3 clients closed while failCommand blocked their find")


def test_a_blocked_write_still_happens_after_its_client_left(
    rs: ReplicaSet, leftovers: Leftovers
) -> None:
    """mongod finishes a write whose client left (only the reply is lost); so does the simulator."""
    block(rs, "insert", block_ms=1500, times=1)
    conns = _open(
        rs, 1, lambda c: c.send({"insert": "coll", "documents": [{"_id": 1}], "$db": "db"})
    )
    conns[0].close()
    client: MongoClient[dict[str, Any]] = MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
    try:
        deadline = time.monotonic() + BOUND
        while client.db.coll.find_one({"_id": 1}) is None:
            assert time.monotonic() < deadline, "the blocked insert never happened"
            time.sleep(0.05)
    finally:
        client.close()
    leftovers.wait_for(0, "the insert's client left and the other client closed")


class _Heartbeats(monitoring.ServerHeartbeatListener):
    def __init__(self) -> None:
        self.awaited: set[Any] = set()

    def started(self, event: monitoring.ServerHeartbeatStartedEvent) -> None:
        if event.awaited:
            self.awaited.add(event.connection_id)

    def succeeded(self, event: monitoring.ServerHeartbeatSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.ServerHeartbeatFailedEvent) -> None:
        pass


def test_pymongo_clients_closed_while_streaming_hellos_leave_nothing(
    rs: ReplicaSet, leftovers: Leftovers
) -> None:
    clients = []
    for _ in range(5):
        heartbeats = _Heartbeats()
        client: MongoClient[dict[str, Any]] = MongoClient(
            rs.uri, heartbeatFrequencyMS=LONG_WAIT_MS, event_listeners=[heartbeats]
        )
        client.db.coll.insert_one({})
        clients.append((client, heartbeats))
    deadline = time.monotonic() + BOUND
    while any(len(h.awaited) < len(rs.members) for _, h in clients):
        assert time.monotonic() < deadline, "PyMongo never started streaming hellos"
        time.sleep(0.05)
    time.sleep(0.2)  # the streaming hellos reach the server and wait there
    for client, _ in clients:
        client.close()
    leftovers.wait_for(0, "5 PyMongo clients closed while their monitors streamed hellos")


# -- the server closes ---------------------------------------------------------------------------


def _every_kind_of_wait(rs: ReplicaSet) -> list[RawConnection]:
    block(rs, "find", "insert")
    return [
        *_open(rs, 2, lambda c: awaitable_hello(c, exhaust=True)),
        *_open(rs, 2, waiting_get_more),
        *_open(rs, 2, lambda c: c.send({"find": "coll", "$db": "db"})),
        *_open(rs, 2, lambda c: c.send({"insert": "coll", "documents": [{}], "$db": "db"})),
        *_open(rs, 1, lambda c: c.command({"ping": 1, "$db": "admin"})),  # idle
    ]


def _assert_closed_by_server(conns: list[RawConnection]) -> None:
    for i, conn in enumerate(conns):
        conn.sock.settimeout(BOUND)
        try:
            while conn.sock.recv(65536):  # a last reply may come before the EOF
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"connection {i} of {len(conns)} still open {BOUND:.0f}s later")
        finally:
            conn.close()


def test_stop_closes_every_connection_and_ends_its_threads(rs: ReplicaSet) -> None:
    before = _server_threads()
    conns = _every_kind_of_wait(rs)
    rs.stop()
    left = sorted(t.name for t in _server_threads() - before if t.is_alive())
    assert left == [], f"ReplicaSet.stop() returned with server threads running: {left}"
    _assert_closed_by_server(conns)


def test_step_down_closing_connections_ends_their_threads(
    rs: ReplicaSet, leftovers: Leftovers
) -> None:
    conns = _every_kind_of_wait(rs)
    rs.step_down(close_connections=True)
    _assert_closed_by_server(conns)
    leftovers.wait_for(0, "step_down(close_connections=True) dropped every connection")
