"""Shutdown, crash and restart of simulated members, as mongod does them.

mongod's shutdown (``shutdownTask``) stops accepting, fails the operations in
flight with InterruptedAtShutdown (11600), on 5.0+ after a quiesce mode in
which hello fails with ShutdownInProgress (91), and then closes its sockets.
Drivers resume a change stream after either (the codes are resumable, labelled
``ResumableChangeStreamError`` on 4.4+). A killed member replies nothing; its
sockets just close.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bson.binary import Binary
from bson.int64 import Int64
from pymongo import MongoClient, monitoring
from pymongo.errors import PyMongoError

from changestream.testing import ReplicaSet
from changestream.testing.server.listener import MemberServer
from tests.testing.test_connection_lifecycle import (
    RawConnection,
    awaitable_hello,
    block,
    waiting_get_more,
)

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("MONGODB_URI")),
    reason="simulator-specific: stops and kills simulated members (MONGODB_URI is set)",
)

BOUND = 15.0
ROOT = Path(__file__).resolve().parents[2]


def _read_until_closed(conn: RawConnection) -> list[dict[str, Any]]:
    """Every reply ``conn`` still gets, until the server closes it (within :data:`BOUND`)."""
    replies = []
    conn.sock.settimeout(BOUND)
    try:
        while True:
            replies.append(conn.reply())
    except (ConnectionError, OSError):
        pass
    return replies


def _labels(reply: dict[str, Any]) -> list[str]:
    return list(reply.get("errorLabels", []))


@pytest.mark.parametrize("version", ["4.2", "4.4", "5.0", "8.0"])
def test_stop_fails_a_waiting_change_stream_get_more_with_interrupted_at_shutdown(
    version: str,
) -> None:
    rs = ReplicaSet(version, noop_interval=0).start()
    try:
        assert rs.primary is not None
        conn = RawConnection(rs.primary)
        waiting_get_more(conn)
        time.sleep(0.3)
        conn.assert_waiting()
    finally:
        rs.stop()
    replies = _read_until_closed(conn)
    assert len(replies) == 1, replies
    reply = replies[0]
    assert (reply["ok"], reply["code"], reply["codeName"]) == (
        0.0,
        11600,
        "InterruptedAtShutdown",
    )
    assert reply["errmsg"] == "Executor error during getMore :: caused by :: interrupted at shutdown"
    resumable = [] if version == "4.2" else ["ResumableChangeStreamError"]
    assert _labels(reply) == resumable
    assert ("topologyVersion" in reply) == (version != "4.2")


@pytest.mark.parametrize(("version", "code"), [("4.4", 11600), ("5.0", 91), ("8.0", 91)])
def test_stop_ends_a_waiting_awaitable_hello(version: str, code: int) -> None:
    """5.0+ enters quiesce mode first (hello: ShutdownInProgress); 4.4 just kills it (11600)."""
    rs = ReplicaSet(version, noop_interval=0).start()
    try:
        assert rs.primary is not None
        conn = RawConnection(rs.primary)
        awaitable_hello(conn, exhaust=False)
        time.sleep(0.3)
        conn.assert_waiting()
    finally:
        rs.stop()
    replies = _read_until_closed(conn)
    assert [r.get("code") for r in replies] == [code]
    if code == 91:
        assert replies[0]["errmsg"] == "The server is in quiesce mode and will shut down"
        assert replies[0]["remainingQuiesceTimeMillis"] == 0


def test_stop_fails_blocked_commands_and_labels_retryable_writes() -> None:
    rs = ReplicaSet("8.0", noop_interval=0).start()
    try:
        block(rs, "find", "insert")
        assert rs.primary is not None
        reader, writer = RawConnection(rs.primary), RawConnection(rs.primary)
        reader.send({"find": "coll", "$db": "db"})
        lsid = {"id": Binary.from_uuid(uuid.uuid4())}
        writer.send(
            {
                "insert": "coll",
                "documents": [{"_id": 1}],
                "lsid": lsid,
                "txnNumber": Int64(1),
                "$db": "db",
            }
        )
        time.sleep(0.3)
        reader.assert_waiting()
        writer.assert_waiting()
    finally:
        rs.stop()
    (read,) = _read_until_closed(reader)
    (write,) = _read_until_closed(writer)
    assert read["code"] == write["code"] == 11600
    assert _labels(read) == []
    assert _labels(write) == ["RetryableWriteError"]


def test_stop_closes_idle_connections_without_a_reply() -> None:
    rs = ReplicaSet("8.0", noop_interval=0).start()
    assert rs.primary is not None
    conn = RawConnection(rs.primary)
    conn.command({"ping": 1, "$db": "admin"})
    rs.stop()
    assert _read_until_closed(conn) == []


class _Recorder(monitoring.CommandListener):
    """Command names started, and the failures, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        with self._lock:
            self.events.append(("started", event.command_name, None))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        with self._lock:
            self.events.append(("failed", event.command_name, event.failure))


@pytest.fixture
def three() -> Iterator[ReplicaSet]:
    rs = ReplicaSet("8.0", members=3, noop_interval=0).start()
    yield rs
    rs.stop()


def _client(rs: ReplicaSet, **kwargs: Any) -> MongoClient[dict[str, Any]]:
    return MongoClient(
        rs.uri,
        serverSelectionTimeoutMS=int(BOUND * 1000),
        heartbeatFrequencyMS=500,
        **kwargs,
    )


def test_pymongo_watch_resumes_after_its_member_shuts_down(three: ReplicaSet) -> None:
    """A getMore failed with InterruptedAtShutdown is resumed by PyMongo's own watch()."""
    recorder = _Recorder()
    client = _client(three, event_listeners=[recorder])
    try:
        coll = client.db.coll
        coll.insert_one({"_id": 0})
        with coll.watch(max_await_time_ms=10_000) as stream:
            coll.insert_one({"_id": 1})
            assert stream.next()["documentKey"] == {"_id": 1}
            got: list[Any] = []
            errors: list[BaseException] = []

            def read() -> None:
                try:
                    got.append(stream.next()["documentKey"]["_id"])
                except BaseException as exc:
                    errors.append(exc)

            reader = threading.Thread(target=read)
            reader.start()
            time.sleep(0.5)  # the getMore waits on the primary
            old = three.deployment.primary
            assert old is not None
            three.stop_member(old.index)
            coll.insert_one({"_id": 2})  # on the new primary
            reader.join(BOUND)
            assert not reader.is_alive(), "watch() never resumed"
            assert errors == []
            assert got == [2]
        failures = [f for kind, name, f in recorder.events if kind == "failed" and name == "getMore"]
        assert any(
            isinstance(f, dict) and f.get("code") == 11600 for f in failures
        ), recorder.events
        after = [
            name
            for kind, name, _ in recorder.events[
                next(
                    i
                    for i, (kind, name, f) in enumerate(recorder.events)
                    if kind == "failed" and isinstance(f, dict) and f.get("code") == 11600
                ) :
            ]
            if kind == "started"
        ]
        assert "aggregate" in after, "PyMongo did not resume with a new aggregate"
    finally:
        client.close()


def test_stopped_member_restarts_on_its_port(three: ReplicaSet) -> None:
    name = three.members[1]
    three.stop_member(1)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(name.rsplit(":", 1)[1])), timeout=2).close()
    assert three.restart_member(1) == name
    conn = RawConnection(name)
    hello = conn.command({"hello": 1, "$db": "admin"})
    assert hello["secondary"] is True and hello["me"] == name
    conn.close()


def test_kill_member_sends_nothing_and_elects_the_next(three: ReplicaSet) -> None:
    old = three.deployment.primary
    assert old is not None
    conn = RawConnection(old.name)
    waiting_get_more(conn)
    time.sleep(0.3)
    conn.assert_waiting()
    pid_before = old.process_id
    three.kill_member(old.index)
    assert _read_until_closed(conn) == []  # no reply: the process died
    assert three.primary is not None and three.primary != old.name
    with pytest.raises(RuntimeError, match="not running"):
        three.kill_member(old.index)
    three.restart_member(old.index)
    assert old.process_id != pid_before  # a new process
    with pytest.raises(RuntimeError, match="already running"):
        three.restart_member(old.index)
    with pytest.raises(IndexError):
        three.kill_member(3)


def test_all_members_killed_leave_no_primary_until_one_restarts(three: ReplicaSet) -> None:
    for i in range(3):
        three.kill_member(i)
    assert three.primary is None
    three.restart_member(2)
    assert three.primary == three.members[2]
    conn = RawConnection(three.members[2])
    assert conn.command({"hello": 1, "$db": "admin"})["isWritablePrimary"] is True
    conn.close()


def test_pymongo_watch_loses_nothing_while_members_crash_and_restart(three: ReplicaSet) -> None:
    """Kill the primary twice (restarting it each time) while a writer inserts: the stream
    sees every insert once, in order."""
    client = _client(three, retryWrites=True)
    writer_client = _client(three, retryWrites=True)
    total = 300
    written: list[int] = []
    stop_writing = threading.Event()

    def write() -> None:
        coll = writer_client.db.coll
        for i in range(total):
            deadline = time.monotonic() + BOUND
            while not stop_writing.is_set():
                try:
                    coll.insert_one({"_id": i})
                    break
                except PyMongoError as exc:
                    if "duplicate key" in str(exc):
                        break  # a retried insert that had happened
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            written.append(i)
            time.sleep(0.003)

    try:
        coll = client.db.coll
        with coll.watch(max_await_time_ms=500) as stream:
            writer = threading.Thread(target=write)
            writer.start()
            seen: list[int] = []
            crashes = 0
            deadline = time.monotonic() + 6 * BOUND
            while len(seen) < total:
                assert time.monotonic() < deadline, f"only {len(seen)} of {total} events"
                event = stream.try_next()
                if event is not None:
                    seen.append(event["documentKey"]["_id"])
                if crashes < 2 and len(seen) >= (crashes + 1) * total // 3:
                    primary = three.deployment.primary
                    assert primary is not None
                    three.kill_member(primary.index)
                    three.restart_member(primary.index)
                    crashes += 1
            writer.join(BOUND)
            assert not writer.is_alive()
        assert seen == list(range(total))
        assert written == list(range(total))
    finally:
        stop_writing.set()
        client.close()
        writer_client.close()


def test_ctrl_c_on_serve_interrupts_waiting_streams_then_exits() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "changestream.testing", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        uri = proc.stdout.readline().strip()
        address = uri.removeprefix("mongodb://").split("/")[0]
        conn = RawConnection(address)
        waiting_get_more(conn)
        time.sleep(0.3)
        conn.assert_waiting()
        proc.send_signal(signal.SIGINT)
        replies = _read_until_closed(conn)
        assert [(r["code"], _labels(r)) for r in replies] == [
            (11600, ["ResumableChangeStreamError"])
        ]
        assert proc.wait(BOUND) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_interrupted_connection_gets_the_error_for_new_commands_too() -> None:
    """Between the kill and the close, a command that arrives fails the same way."""
    rs = ReplicaSet("8.0", noop_interval=0).start()
    try:
        assert rs.primary is not None
        server_conn = RawConnection(rs.primary)
        server_conn.command({"ping": 1, "$db": "admin"})
        server = rs.deployment.members[0].server
        assert isinstance(server, MemberServer)
        for conn in server.listener.connections():
            conn.context.interrupt(11600, "interrupted at shutdown")
        server_conn.send({"ping": 1, "$db": "admin"})
        reply = server_conn.reply()
        assert (reply["ok"], reply["code"]) == (0.0, 11600)
    finally:
        rs.stop()
