"""Wire framing of the simulator: OP_MSG sections and flags, checksums, OP_QUERY, bad input.

These talk to a running member over a raw socket, so they see exactly what a
driver sees, including connections being dropped.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import bson
import pytest
from bson.int64 import Int64

from changestream.testing import ReplicaSet, wire

HEADER = struct.Struct("<iiii")


# -- a minimal raw client ------------------------------------------------------------------------


def op_msg(
    body: dict[str, Any],
    *,
    request_id: int = 1,
    flags: int = 0,
    sequences: dict[str, list[dict[str, Any]]] | None = None,
) -> bytes:
    sections = b"\x00" + bson.encode(body)
    for ident, docs in (sequences or {}).items():
        payload = ident.encode() + b"\x00" + b"".join(bson.encode(d) for d in docs)
        sections += b"\x01" + struct.pack("<i", 4 + len(payload)) + payload
    checksum = bool(flags & wire.CHECKSUM_PRESENT)
    length = 16 + 4 + len(sections) + (4 if checksum else 0)
    msg = HEADER.pack(length, request_id, 0, wire.OP_MSG) + struct.pack("<I", flags) + sections
    if checksum:
        msg += struct.pack("<I", wire.crc32c(msg))
    return msg


def op_query(query: dict[str, Any], collection: str = "admin.$cmd", request_id: int = 1) -> bytes:
    rest = struct.pack("<i", 0) + collection.encode() + b"\x00" + struct.pack("<ii", 0, -1)
    rest += bson.encode(query)
    return HEADER.pack(16 + len(rest), request_id, 0, wire.OP_QUERY) + rest


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


class Reply(NamedTuple):
    response_to: int
    opcode: int
    flags: int
    doc: dict[str, Any]
    request_id: int


def recv_reply(sock: socket.socket) -> Reply:
    """The next message from the server."""
    length, rid, response_to, opcode = HEADER.unpack(recv_exactly(sock, 16))
    rest = recv_exactly(sock, length - 16)
    if opcode == wire.OP_MSG:
        (flags,) = struct.unpack_from("<I", rest)
        end = len(rest) - 4 if flags & wire.CHECKSUM_PRESENT else len(rest)
        if flags & wire.CHECKSUM_PRESENT:
            header = struct.pack("<iiii", length, rid, response_to, opcode)
            assert wire.crc32c(header + rest[:end]) == struct.unpack_from("<I", rest, end)[0]
        assert rest[4] == 0
        return Reply(response_to, opcode, flags, bson.decode(rest[5:end]), rid)
    assert opcode == wire.OP_REPLY
    response_flags, cursor_id, _start, number = struct.unpack_from("<iqii", rest)
    assert (cursor_id, number) == (0, 1)
    return Reply(response_to, opcode, response_flags, bson.decode(rest[20:]), rid)


def is_closed(sock: socket.socket, timeout: float = 3.0) -> bool:
    """True once the server has closed ``sock`` (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replset:
        yield replset


@pytest.fixture
def connect(rs: ReplicaSet) -> Iterator[Any]:
    socks: list[socket.socket] = []

    def _connect(member: str | None = None) -> socket.socket:
        host, port = (member or rs.members[0]).rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
        socks.append(sock)
        return sock

    yield _connect
    for sock in socks:
        sock.close()


def ping_ok(sock: socket.socket, request_id: int = 7) -> bool:
    sock.sendall(op_msg({"ping": 1, "$db": "admin"}, request_id=request_id))
    reply = recv_reply(sock)
    return reply.response_to == request_id and reply.doc["ok"] == 1.0


# -- CRC-32C -------------------------------------------------------------------------------------


def test_crc32c_matches_the_castagnoli_check_value() -> None:
    assert wire.crc32c(b"123456789") == 0xE3069283
    assert wire.crc32c(b"") == 0
    assert wire.crc32c(b"6789", wire.crc32c(b"12345")) == 0xE3069283


# -- OP_MSG ----------------------------------------------------------------------------------------


def test_op_msg_reply_answers_the_request_id(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_msg({"ping": 1, "$db": "admin"}, request_id=42))
    response_to, opcode, flags, doc, _ = recv_reply(sock)
    assert (response_to, opcode, flags) == (42, wire.OP_MSG, 0)
    assert doc["ok"] == 1.0
    assert list(doc) == ["ok", "$clusterTime", "operationTime"]


def test_document_sequences_are_merged_into_the_body(rs: ReplicaSet, connect: Any) -> None:
    sock = connect()
    lsids = [{"id": bson.Binary(bytes(16), 4)}]
    sock.sendall(op_msg({"endSessions": [], "$db": "admin"}, sequences={"ids": lsids}))
    assert recv_reply(sock).doc["ok"] == 1.0
    # a field both in the body and in a sequence is malformed: the connection is dropped
    sock.sendall(op_msg({"endSessions": [], "$db": "admin"}, sequences={"endSessions": lsids}))
    assert is_closed(sock)


def test_checksummed_request_gets_a_checksummed_reply(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_msg({"ping": 1, "$db": "admin"}, flags=wire.CHECKSUM_PRESENT, request_id=3))
    response_to, _, flags, doc, _ = recv_reply(sock)  # recv_reply verifies the CRC
    assert response_to == 3 and flags == wire.CHECKSUM_PRESENT and doc["ok"] == 1.0


def test_wrong_checksum_closes_only_that_connection(connect: Any) -> None:
    bystander, victim = connect(), connect()
    msg = bytearray(op_msg({"ping": 1, "$db": "admin"}, flags=wire.CHECKSUM_PRESENT))
    msg[-1] ^= 0xFF
    victim.sendall(bytes(msg))
    assert is_closed(victim)
    assert ping_ok(bystander)


def test_more_to_come_request_gets_no_reply(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_msg({"ping": 1, "$db": "admin"}, flags=wire.MORE_TO_COME, request_id=1))
    sock.sendall(op_msg({"ping": 1, "$db": "admin"}, request_id=2))
    assert recv_reply(sock).response_to == 2


def test_missing_db_is_an_error_reply(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_msg({"ping": 1}))
    doc = recv_reply(sock).doc
    assert (doc["ok"], doc["code"]) == (0.0, 40571)
    assert ping_ok(sock)


def test_unknown_command_reply(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_msg({"frobnicate": 1, "$db": "test"}))
    doc = recv_reply(sock).doc
    assert doc["code"] == 59 and doc["codeName"] == "CommandNotFound"
    assert doc["errmsg"] == "no such command: 'frobnicate'"


def test_exhaust_getmore_streams_until_the_cursor_is_exhausted(
    rs: ReplicaSet, connect: Any
) -> None:
    from changestream.testing.cursors import CursorBatch

    class Counting:
        ns = "db.c"
        lsid_id = None
        tailable_await = False

        def __init__(self) -> None:
            self.left = 3

        def get_more(
            self, ctx: Any, batch_size: int | None, max_time_ms: int | None
        ) -> CursorBatch:
            self.left -= 1
            return CursorBatch([{"n": self.left}], exhausted=self.left == 0)

        def close(self) -> None:
            pass

    cid = rs.deployment.cursors.register(Counting(), rs.members[0])
    sock = connect()
    cmd = {"getMore": Int64(cid), "collection": "c", "$db": "db"}
    sock.sendall(op_msg(cmd, flags=wire.EXHAUST_ALLOWED, request_id=9))
    replies = [recv_reply(sock) for _ in range(3)]
    assert [r.doc["cursor"]["nextBatch"] for r in replies] == [[{"n": 2}], [{"n": 1}], [{"n": 0}]]
    assert [bool(r.flags & wire.MORE_TO_COME) for r in replies] == [True, True, False]
    # the first reply answers the request, each later one the previous reply
    assert [r.response_to for r in replies] == [9, replies[0].request_id, replies[1].request_id]
    assert ping_ok(sock)


# -- OP_QUERY ----------------------------------------------------------------------------------------


def test_legacy_op_query_handshake(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_query({"isMaster": 1, "helloOk": True}, request_id=5))
    response_to, opcode, flags, doc, _ = recv_reply(sock)
    assert (response_to, opcode, flags) == (5, wire.OP_REPLY, wire.OP_REPLY_AWAIT_CAPABLE)
    assert doc["helloOk"] is True and doc["ismaster"] is True and doc["ok"] == 1.0


def test_op_query_commands_other_than_hello_are_rejected_on_5_1_plus(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_query({"ping": 1}))
    doc = recv_reply(sock).doc
    assert doc["code"] == 352 and doc["codeName"] == "UnsupportedOpQueryCommand"


def test_op_query_commands_still_run_on_5_0() -> None:
    with ReplicaSet("5.0") as old:
        host, port = old.members[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(op_query({"$query": {"ping": 1}, "$readPreference": {"mode": "primary"}}))
            assert recv_reply(sock).doc["ok"] == 1.0


def test_op_query_outside_cmd_namespace_closes_the_connection(connect: Any) -> None:
    sock = connect()
    sock.sendall(op_query({"x": 1}, collection="test.coll"))
    assert is_closed(sock)


# -- malformed input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 16, id="http"),
        pytest.param(HEADER.pack(100_000_000, 1, 0, wire.OP_MSG), id="huge-length"),
        pytest.param(HEADER.pack(10, 1, 0, wire.OP_MSG), id="short-length"),
        pytest.param(HEADER.pack(26, 1, 0, 2001) + b"\x00" * 10, id="unknown-opcode"),
        pytest.param(
            HEADER.pack(30, 1, 0, wire.OP_MSG)
            + b"\x00\x00\x00\x00\x00"
            + b"\x09\x00\x00\x00\xff\x00\x00\x00\x00",
            id="bad-bson",
        ),
        pytest.param(
            HEADER.pack(26, 1, 0, wire.OP_MSG) + b"\x00\x00\x00\x00\x07" + b"\x05\x00\x00\x00\x00",
            id="bad-section-kind",
        ),
        pytest.param(
            HEADER.pack(26, 1, 0, wire.OP_MSG)
            + struct.pack("<I", 1 << 5)
            + b"\x00\x05\x00\x00\x00\x00",
            id="unknown-required-flag",
        ),
    ],
)
def test_malformed_messages_close_only_that_connection(connect: Any, garbage: bytes) -> None:
    bystander, victim = connect(), connect()
    victim.sendall(garbage)
    assert is_closed(victim)
    assert ping_ok(bystander)
    assert ping_ok(connect())


def test_truncated_message_then_eof(connect: Any) -> None:
    bystander, victim = connect(), connect()
    whole = op_msg({"ping": 1, "$db": "admin"})
    victim.sendall(whole[: len(whole) // 2])
    victim.shutdown(socket.SHUT_WR)
    assert is_closed(victim)
    assert ping_ok(bystander)


def test_slow_partial_message_does_not_block_others(connect: Any) -> None:
    slow = connect()
    whole = op_msg({"ping": 1, "$db": "admin"}, request_id=11)
    slow.sendall(whole[:10])
    assert ping_ok(connect())
    slow.sendall(whole[10:])
    assert recv_reply(slow).response_to == 11


def test_many_concurrent_connections(connect: Any) -> None:
    socks = [connect() for _ in range(20)]
    results: list[bool] = []

    def worker(sock: socket.socket, rid: int) -> None:
        results.append(all(ping_ok(sock, rid) for _ in range(20)))

    threads = [threading.Thread(target=worker, args=(s, i + 1)) for i, s in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [True] * 20


def test_stop_closes_connections_and_frees_the_port() -> None:
    replset = ReplicaSet("8.0").start()
    host, port = replset.members[0].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    assert ping_ok(sock)
    started = time.monotonic()
    replset.stop()
    assert time.monotonic() - started < 3
    assert is_closed(sock)
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()
    # the port can be bound again at once (SO_REUSEADDR)
    with ReplicaSet("8.0", port=int(port)) as again:
        assert again.members == [f"{host}:{port}"]
