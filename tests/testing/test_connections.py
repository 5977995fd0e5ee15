"""Connections as a server must handle them (the listener; numbers in benchmarks/connections.py).

Idle connections cost no thread; a message is read as its bytes arrive, never
allocated from the length a header announces, and must arrive within the
listener's message timeout (slowloris); accepting survives running out of
descriptors and threads; nesting beyond mongod's limits gets mongod's errors.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bson
import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure, WriteError

from changestream.testing import ReplicaSet
from changestream.testing.server import wire, workers
from changestream.testing.server.listener import MemberServer
from tests.testing.test_connection_lifecycle import HEADER, RawConnection

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("MONGODB_URI")),
    reason="simulator-specific: the simulator's listener (MONGODB_URI is set)",
)

BOUND = 15.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0", noop_interval=0) as started:
        yield started


def _server(rs: ReplicaSet) -> MemberServer:
    server = rs.deployment.members[0].server
    assert isinstance(server, MemberServer)
    return server


def _op_msg(body: dict[str, Any] | bytes, request_id: int = 1) -> bytes:
    payload = b"\x00" + (body if isinstance(body, bytes) else bson.encode(body))
    return HEADER.pack(20 + len(payload), request_id, 0, wire.OP_MSG) + b"\0\0\0\0" + payload


def _closed_by_server(sock: socket.socket, within: float = BOUND) -> bool:
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _ping(address: str) -> None:
    conn = RawConnection(address)
    conn.sock.settimeout(BOUND)
    try:
        conn.command({"ping": 1, "$db": "admin"})
    finally:
        conn.close()


# -- partial messages ------------------------------------------------------------------------


def test_a_header_announcing_a_large_message_is_closed_after_the_message_timeout(
    rs: ReplicaSet,
) -> None:
    _server(rs).listener.message_timeout = 1.0
    assert rs.primary is not None
    host, port = rs.primary.rsplit(":", 1)
    liars = []
    for i in range(20):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(HEADER.pack(wire.MAX_MESSAGE_SIZE, i, 0, wire.OP_MSG))  # and no body
        liars.append(sock)
    _ping(rs.primary)  # everyone else is served meanwhile
    for sock in liars:
        assert _closed_by_server(sock), "a header with no body was never timed out"
        sock.close()


def test_slowloris_is_closed_and_an_idle_connection_is_not(rs: ReplicaSet) -> None:
    _server(rs).listener.message_timeout = 1.0
    assert rs.primary is not None
    idle = RawConnection(rs.primary)
    slow = RawConnection(rs.primary)
    message = _op_msg({"ping": 1, "$db": "admin"})
    started = time.monotonic()
    closed = False
    for byte in message[:-1]:  # one byte every 0.2 s: 5 s for the message
        try:
            slow.sock.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        time.sleep(0.2)
        if time.monotonic() - started > 3:
            break
    assert closed or _closed_by_server(slow.sock, BOUND), "slowloris was never timed out"
    slow.close()
    # Idle for longer than the message timeout, and still served.
    idle.sock.settimeout(BOUND)
    idle.command({"ping": 1, "$db": "admin"})
    idle.close()


def test_a_message_arriving_in_pieces_within_the_timeout_is_served(rs: ReplicaSet) -> None:
    assert rs.primary is not None
    conn = RawConnection(rs.primary)
    message = _op_msg({"ping": 1, "$db": "admin"}) + _op_msg({"ping": 2, "$db": "admin"}, 2)
    for i in range(0, len(message), 7):
        conn.sock.sendall(message[i : i + 7])
        time.sleep(0.01)
    assert conn.reply()["ok"] == 1.0
    assert conn.reply()["ok"] == 1.0
    conn.close()


# -- many connections ------------------------------------------------------------------------------


def _server_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("sim-"))


def test_idle_connections_cost_no_thread_and_closing_them_together_is_cheap(
    rs: ReplicaSet,
) -> None:
    assert rs.primary is not None
    before = _server_threads()
    conns = [RawConnection(rs.primary) for _ in range(300)]
    for conn in conns:
        conn.sock.settimeout(BOUND)
        conn.command({"ping": 1, "$db": "admin"})
    assert _server(rs).connection_count >= 300
    assert _server_threads() - before < 20, "threads grow with idle connections"
    for conn in conns:
        conn.close()
    _ping(rs.primary)
    deadline = time.monotonic() + BOUND
    while _server(rs).connection_count > 0:
        assert time.monotonic() < deadline, "closed connections were never dropped"
        time.sleep(0.05)


_EMFILE_SERVER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
from changestream.testing.cli import main
sys.exit(main(["serve", "--port", "0"]))
"""


def test_running_out_of_descriptors_pauses_accepting_and_it_resumes() -> None:
    """More clients than descriptors: the server logs it once, and accepts again after."""
    limit = 128
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4 * limit:
        pytest.skip(f"this test process may open only {soft} descriptors")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_SERVER.format(limit=limit)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip().removeprefix("mongodb://").split("/")[0]
        host, port = address.rsplit(":", 1)
        for _ in range(limit + 50):
            socks.append(socket.create_connection((host, int(port)), timeout=BOUND))
        time.sleep(1.0)  # the server accepts all it can, then runs out
        for sock in socks:
            sock.close()
        socks.clear()
        _ping(address)
        assert proc.poll() is None
    finally:
        for sock in socks:
            sock.close()
        proc.terminate()
        _out, err = proc.communicate(timeout=BOUND)
    assert err.count("cannot accept connections") == 1, err
    assert err.count("accepts connections again") == 1, err


class _FailingThreads:
    """``threading`` for the transport module, where starting a worker can be made to fail."""

    def __init__(self) -> None:
        self.fail = False
        outer = self

        class Thread(threading.Thread):
            def start(self) -> None:
                if outer.fail and "-worker-" in self.name:
                    raise RuntimeError("can't start new thread")
                super().start()

        self.module = types.SimpleNamespace(**{**vars(threading), "Thread": Thread})


def test_requests_wait_while_no_thread_can_be_started(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    threads = _FailingThreads()
    monkeypatch.setattr(workers, "threading", threads.module)
    with ReplicaSet("8.0", noop_interval=0) as rs:
        assert rs.primary is not None
        threads.fail = True
        with caplog.at_level(logging.WARNING, logger=workers.__name__):
            conns = [RawConnection(rs.primary) for _ in range(3)]
            for conn in conns:
                conn.send({"ping": 1, "$db": "admin"})
            time.sleep(0.5)
            for conn in conns:
                conn.assert_waiting()
            threads.fail = False
            for conn in conns:
                conn.sock.settimeout(BOUND)
                assert conn.reply()["ok"] == 1.0
                conn.close()
        failures = [r for r in caplog.records if "cannot start a thread" in r.getMessage()]
        assert len(failures) == 1


# -- nesting ----------------------------------------------------------------------------------------


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def _nested_bson(levels: int) -> bytes:
    """``{"a": {"a": ... 1}}`` with ``levels`` objects, built without recursion."""
    doc = b"\x10a\x00" + struct.pack("<i", 1)
    doc = struct.pack("<i", len(doc) + 5) + doc + b"\x00"
    for _ in range(levels - 1):
        element = b"\x03a\x00" + doc
        doc = struct.pack("<i", len(element) + 5) + element + b"\x00"
    return doc


def _command_with(deep: bytes) -> bytes:
    """``{ping: 1, $db: "admin", x: <deep>}`` as raw BSON."""
    head = bson.encode({"ping": 1, "$db": "admin"})[4:-1]
    element = b"\x03x\x00" + deep
    return struct.pack("<i", len(head) + len(element) + 5) + head + element + b"\x00"


@pytest.mark.parametrize("levels", [200, 201, 900, 5000])
def test_a_message_nested_deeper_than_200_levels_gets_overflow(
    rs: ReplicaSet, levels: int
) -> None:
    """``x`` sits one level below the root: ``levels`` objects under it make levels + 1."""
    assert rs.primary is not None
    conn = RawConnection(rs.primary)
    conn.sock.settimeout(BOUND)
    conn.sock.sendall(_op_msg(_command_with(_nested_bson(levels))))
    reply = conn.reply()
    if levels == 200:  # the root and 200 levels below it: mongod's maxBSONDepth
        assert reply["ok"] == 1.0
    else:
        assert (reply["ok"], reply["code"], reply["codeName"]) == (0.0, 15, "Overflow")
        assert reply["errmsg"].startswith("BSONObj exceeds maximum nested object depth")
    conn.command({"ping": 1, "$db": "admin"})  # the connection is still served
    conn.close()


def test_overflow_names_the_path_and_the_id(rs: ReplicaSet) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
    try:
        with pytest.raises(OperationFailure) as caught:
            client.db.coll.insert_one({"_id": 7, "a": _nested(201)})
        assert caught.value.code == 15
        path = ".".join(["a"] * 201)
        assert str(caught.value.details["errmsg"]) == (
            "BSONObj exceeds maximum nested object depth in element with field name "
            f"'{path}' in object with _id: 7"
        )
    finally:
        client.close()


def test_documents_nested_deeper_than_180_levels_are_not_stored(rs: ReplicaSet) -> None:
    client: MongoClient[dict[str, Any]] = MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
    try:
        coll = client.db.coll
        coll.insert_one({"_id": 1, "a": _nested(179)})  # 180 levels with the root
        with pytest.raises(WriteError) as caught:
            coll.insert_one({"_id": 2, "a": _nested(180)})
        assert caught.value.code == 15
        assert caught.value.details["errmsg"] == (
            "cannot insert document because it exceeds 180 levels of nesting"
        )
        assert coll.count_documents({}) == 1
    finally:
        client.close()


def test_a_pool_that_grew_for_a_burst_shrinks_while_light_traffic_goes_on() -> None:
    """After a burst of waiting operations, the surplus workers exit although quick
    requests keep coming: each goes to the worker idle the shortest time. (A FIFO hand-out
    gave every idle worker a task now and then, and a pool kept hundreds of threads
    for as long as any client polled.)"""
    pool = workers.WorkerPool("test-pool", idle_seconds=0.5)
    release = threading.Event()
    try:
        for _ in range(40):  # forty operations that wait, as getMores do
            pool.submit(lambda: release.wait(BOUND) and None)
        deadline = time.monotonic() + BOUND
        while pool.busy < 40:
            pool.retry()
            assert time.monotonic() < deadline, f"{pool.busy} of 40 waiting operations started"
            time.sleep(0.005)
        release.set()
        done = threading.Semaphore(0)
        trickle_until = time.monotonic() + 2.0  # four idle periods of light traffic
        while time.monotonic() < trickle_until:
            pool.submit(done.release)
            assert done.acquire(timeout=BOUND), "a quick request was not served"
            time.sleep(0.01)
        assert pool.threads <= 4, f"{pool.threads} workers kept for one request at a time"
    finally:
        release.set()
        assert pool.stop(time.monotonic() + BOUND) == []
