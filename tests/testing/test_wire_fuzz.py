"""Property-based fuzzing of the simulator's wire parser and command layer.

Random, truncated and oversized frames and deeply nested BSON go to one
connection; that connection may be closed (or get an error reply), and a
bystander connection keeps getting fast answers. The default suite runs a
small derandomized budget per target (``WIRE_FUZZ_EXAMPLES``); set
``CHANGESTREAM_FUZZ_EXAMPLES`` for a longer campaign.
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
import time
from collections.abc import Iterator
from typing import Any

import bson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changestream.testing import ReplicaSet
from changestream.testing.server import wire

HEADER = struct.Struct("<iiii")
WIRE_FUZZ_EXAMPLES = int(os.environ.get("CHANGESTREAM_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=WIRE_FUZZ_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)


def op_msg(body: bytes, request_id: int = 1, flags: int = 0) -> bytes:
    sections = b"\x00" + body
    return HEADER.pack(16 + 4 + len(sections), request_id, 0, wire.OP_MSG) + struct.pack(
        "<I", flags
    ) + sections


def nested(depth: int) -> bytes:
    """``{ping: 1, $db: "admin", x: {x: {... depth levels ...}}}`` built as bytes (no recursion)."""
    inner = b"\x05\x00\x00\x00\x00"  # {}
    for _ in range(depth):
        element = b"\x03x\x00" + inner
        inner = struct.pack("<i", 4 + len(element) + 1) + element + b"\x00"
    head = bson.encode({"ping": 1, "$db": "admin"})[4:-1]
    body = head + b"\x03x\x00" + inner
    return struct.pack("<i", 4 + len(body) + 1) + body + b"\x00"


def recv_reply(sock: socket.socket) -> bytes | None:
    """One whole reply, or ``None`` once the server closed the connection."""
    try:
        header = _recv(sock, 16)
        if header is None:
            return None
        length = HEADER.unpack(header)[0]
        return _recv(sock, length - 16)
    except OSError as exc:
        if isinstance(exc, TimeoutError):
            raise
        return None  # reset / not connected: closed


def _recv(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class Bystander:
    """A connection that pings between fuzz cases and records how long each ping took."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=30)
        self.latencies: list[float] = []
        self.request_id = 1000

    def ping(self) -> float:
        self.request_id += 1
        started = time.monotonic()
        self.sock.sendall(op_msg(bson.encode({"ping": 1, "$db": "admin"}), self.request_id))
        reply = recv_reply(self.sock)
        elapsed = time.monotonic() - started
        assert reply is not None, "the bystander's connection was closed"
        self.latencies.append(elapsed)
        return elapsed


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replset:
        yield replset


@pytest.fixture(scope="module")
def address(rs: ReplicaSet) -> tuple[str, int]:
    host, port = rs.members[0].rsplit(":", 1)
    return host, int(port)


@pytest.fixture(scope="module")
def bystander(address: tuple[str, int]) -> Iterator[Bystander]:
    watcher = Bystander(address)
    baseline = [watcher.ping() for _ in range(20)]
    watcher.latencies.clear()
    yield watcher
    # No latency jump for the bystander over everything the victims sent.
    if watcher.latencies:
        print(f"\nbystander pings: {len(watcher.latencies)}, median "
              f"{statistics.median(watcher.latencies) * 1000:.1f} ms (baseline "
              f"{statistics.median(baseline) * 1000:.1f} ms), max "
              f"{max(watcher.latencies) * 1000:.1f} ms")
        assert max(watcher.latencies) < 2.0
        assert statistics.median(watcher.latencies) < statistics.median(baseline) * 10 + 0.05
    watcher.sock.close()


def send_as_victim(address: tuple[str, int], frame: bytes, *, half_close: bool) -> None:
    """Send ``frame`` on a fresh connection; the server must answer or close, never hang."""
    victim = socket.create_connection(address, timeout=10)
    try:
        try:
            victim.sendall(frame)
            if half_close:
                victim.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN: the server already closed it
            return
        for _ in range(4):  # an error reply keeps the connection; garbage closes it
            reply = recv_reply(victim)
            if reply is None or not half_close:
                return
    except TimeoutError:
        pytest.fail(f"the server neither answered nor closed after {frame[:40]!r}...")
    finally:
        victim.close()


def valid_frame(body: dict[str, Any]) -> bytes:
    return op_msg(bson.encode(body))


PING = valid_frame({"ping": 1, "$db": "admin"})


@FUZZ
@given(st.binary(min_size=1, max_size=300))
def test_random_bytes_close_only_that_connection(address: tuple[str, int],
                                                 bystander: Bystander, garbage: bytes) -> None:
    send_as_victim(address, garbage, half_close=True)
    bystander.ping()


@FUZZ
@given(
    cut=st.integers(1, len(PING) - 1),
    length=st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
    flip=st.one_of(st.none(), st.tuples(st.integers(0, len(PING) - 1), st.integers(0, 255))),
)
def test_truncated_lying_and_corrupted_frames_close_only_that_connection(
    address: tuple[str, int], bystander: Bystander, cut: int, length: int | None,
    flip: tuple[int, int] | None,
) -> None:
    frame = bytearray(PING)
    if length is not None:
        frame[0:4] = struct.pack("<i", length)
    if flip is not None:
        frame[flip[0]] = flip[1]
    send_as_victim(address, bytes(frame[:cut]), half_close=True)
    send_as_victim(address, bytes(frame), half_close=True)
    bystander.ping()


@FUZZ
@given(st.integers(1, 48_000_000 * 2))
def test_oversized_frames_are_refused_without_reading_them(address: tuple[str, int],
                                                           bystander: Bystander,
                                                           claimed: int) -> None:
    # The header claims a large message; only a little follows before the victim hangs up.
    frame = HEADER.pack(min(claimed, 2**31 - 1), 1, 0, wire.OP_MSG) + b"\x00" * 64
    send_as_victim(address, frame, half_close=True)
    bystander.ping()


@FUZZ
@given(st.integers(1, 5000))
def test_deeply_nested_bson_gets_an_answer_or_a_close(address: tuple[str, int],
                                                      bystander: Bystander, depth: int) -> None:
    send_as_victim(address, op_msg(nested(depth)), half_close=True)
    bystander.ping()


SAFE_COMMANDS = ["find", "aggregate", "getMore", "insert", "update", "delete", "killCursors",
                 "hello", "isMaster", "ping", "listCollections", "listIndexes", "count",
                 "distinct", "create", "drop", "createIndexes", "endSessions", "buildInfo",
                 "findAndModify", "bulkWrite", "nonsense"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
                    st.floats(allow_nan=True), st.text(max_size=10), st.binary(max_size=6))
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.sampled_from(["$match", "$changeStream", "x", "_id", "q", "u",
                                         "pipeline", "cursor", "filter", "$set"]),
                        children, max_size=3),
    ),
    max_leaves=10,
)


@FUZZ
@given(
    name=st.sampled_from(SAFE_COMMANDS),
    value=values,
    extra=st.dictionaries(st.sampled_from(["pipeline", "cursor", "filter", "documents",
                                           "updates", "deletes", "batchSize", "collection",
                                           "lsid", "txnNumber", "maxTimeMS", "comment"]),
                          values, max_size=3),
)
def test_random_commands_get_an_error_reply_not_a_crash(
    address: tuple[str, int], bystander: Bystander, name: str, value: Any,
    extra: dict[str, Any],
) -> None:
    try:
        frame = valid_frame({name: value, **extra, "$db": "fuzz_db"})
    except (bson.errors.InvalidDocument, OverflowError):
        return
    victim = socket.create_connection(address, timeout=10)
    try:
        victim.sendall(frame)
        reply = recv_reply(victim)  # an answer (ok: 0 mostly) or a close, never a hang
        if reply is not None:
            victim.sendall(PING)
            assert recv_reply(victim) is not None, "a command error must not close the connection"
    finally:
        victim.close()
    bystander.ping()
