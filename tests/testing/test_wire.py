"""Wire framing of the simulator: OP_MSG sections and flags, checksums, OP_QUERY, bad input.

These talk to a running member over a raw socket, so they see exactly what a
driver sees, including connections being dropped.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import bson
import pytest
from bson.int64 import Int64

from changestream.testing import ReplicaSet
from changestream.testing.server import wire

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
    compressor_id: int | None = None
    """Set when the reply came as OP_COMPRESSED (``opcode`` is then the original one)."""


COMPRESSION = struct.Struct("<iiB")
INFLATE = {0: lambda data: data, 2: zlib.decompress}


def compressed(message: bytes, compressor_id: int = 2, payload: bytes | None = None) -> bytes:
    """``message`` wrapped in OP_COMPRESSED (zlib, or noop with id 0; or a given payload)."""
    _length, rid, response_to, opcode = HEADER.unpack_from(message)
    body = message[16:]
    if payload is None:
        payload = zlib.compress(body) if compressor_id == 2 else body
    rest = COMPRESSION.pack(opcode, len(body), compressor_id) + payload
    return HEADER.pack(16 + len(rest), rid, response_to, wire.OP_COMPRESSED) + rest


def recv_reply(sock: socket.socket) -> Reply:
    """The next message from the server (decompressed if it came compressed)."""
    length, rid, response_to, opcode = HEADER.unpack(recv_exactly(sock, 16))
    rest = recv_exactly(sock, length - 16)
    compressor_id = None
    if opcode == wire.OP_COMPRESSED:
        opcode, size, compressor_id = COMPRESSION.unpack_from(rest)
        rest = INFLATE[compressor_id](rest[COMPRESSION.size :])
        assert len(rest) == size
        length = size + 16
    if opcode == wire.OP_MSG:
        (flags,) = struct.unpack_from("<I", rest)
        end = len(rest) - 4 if flags & wire.CHECKSUM_PRESENT else len(rest)
        if flags & wire.CHECKSUM_PRESENT:
            header = struct.pack("<iiii", length, rid, response_to, opcode)
            assert wire.crc32c(header + rest[:end]) == struct.unpack_from("<I", rest, end)[0]
        assert rest[4] == 0
        return Reply(response_to, opcode, flags, bson.decode(rest[5:end]), rid, compressor_id)
    assert opcode == wire.OP_REPLY
    response_flags, cursor_id, _start, number = struct.unpack_from("<iqii", rest)
    assert (cursor_id, number) == (0, 1)
    return Reply(response_to, opcode, response_flags, bson.decode(rest[20:]), rid, compressor_id)


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
    response_to, opcode, flags, doc, *_ = recv_reply(sock)
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
    response_to, _, flags, doc, *_ = recv_reply(sock)  # recv_reply verifies the CRC
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
    from changestream.testing.core.cursors import CursorBatch

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
    response_to, opcode, flags, doc, *_ = recv_reply(sock)
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


# -- OP_COMPRESSED ---------------------------------------------------------------------------------


def hello(sock: socket.socket, **fields: Any) -> dict[str, Any]:
    sock.sendall(op_msg({"hello": 1, **fields, "$db": "admin"}, request_id=3))
    return recv_reply(sock).doc


def test_hello_negotiates_compressors_in_the_clients_order(connect: Any) -> None:
    sock = connect()
    assert "compression" not in hello(sock)  # no offer: no field
    # snappy/zstd need modules this Python lacks; noop is not enabled by default (as mongod)
    assert hello(sock, compression=["snappy", "noop", "zlib"])["compression"] == ["zlib"]
    assert hello(sock)["compression"] == ["zlib"]  # later hellos report the negotiated list
    assert "compression" not in hello(sock, compression=["zstd"])  # renegotiated: none
    assert "compression" not in hello(sock)
    err = hello(sock, compression="zlib")
    assert (err["code"], err["errmsg"]) == (
        14,
        "BSON field 'hello.compression' is the wrong type 'string', expected type 'array'",
    )


def test_compressed_request_gets_a_reply_compressed_the_same_way(connect: Any) -> None:
    sock = connect()
    sock.sendall(compressed(op_msg({"ping": 1, "$db": "admin"}, request_id=11)))
    reply = recv_reply(sock)
    assert (reply.response_to, reply.opcode, reply.compressor_id) == (11, wire.OP_MSG, 2)
    assert reply.doc["ok"] == 1.0
    sock.sendall(op_msg({"ping": 1, "$db": "admin"}, request_id=12))
    assert recv_reply(sock).compressor_id is None  # an uncompressed request: plain reply
    flags = wire.CHECKSUM_PRESENT
    sock.sendall(compressed(op_msg({"ping": 1, "$db": "admin"}, request_id=13, flags=flags)))
    reply = recv_reply(sock)  # the CRC inside covers the decompressed message
    assert (reply.compressor_id, reply.flags & flags) == (2, flags)


def test_compressed_legacy_op_query_gets_a_compressed_op_reply(connect: Any) -> None:
    sock = connect()
    sock.sendall(compressed(op_query({"isMaster": 1}, request_id=21)))
    reply = recv_reply(sock)
    assert (reply.response_to, reply.opcode, reply.compressor_id) == (21, wire.OP_REPLY, 2)
    assert reply.doc["ismaster"] is True


def test_exhaust_replies_stay_compressed(rs: ReplicaSet, connect: Any) -> None:
    sock = connect()
    sock.sendall(compressed(op_msg({"insert": "exz", "documents": [{"i": i} for i in range(3)],
                                    "$db": "db"})))  # fmt: skip
    assert recv_reply(sock).doc["n"] == 3
    sock.sendall(compressed(op_msg({"find": "exz", "batchSize": 1, "$db": "db"})))
    cid = recv_reply(sock).doc["cursor"]["id"]
    get_more = {"getMore": cid, "collection": "exz", "batchSize": 1, "$db": "db"}
    sock.sendall(compressed(op_msg(get_more, flags=wire.EXHAUST_ALLOWED)))
    # the last document fills its batch, so (as mongod's find) the cursor ends with one
    # more, empty batch
    replies = [recv_reply(sock), recv_reply(sock), recv_reply(sock)]
    assert [r.compressor_id for r in replies] == [2, 2, 2]
    assert [bool(r.flags & wire.MORE_TO_COME) for r in replies] == [True, True, False]


def test_noop_compression_when_enabled() -> None:
    with ReplicaSet("8.0", compressors="noop,zlib") as replset:
        host, port = replset.members[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            offer = ["zlib", "noop"]
            assert hello(sock, compression=offer)["compression"] == offer
            sock.sendall(compressed(op_msg({"ping": 1, "$db": "admin"}, request_id=31), 0))
            reply = recv_reply(sock)
            assert (reply.response_to, reply.compressor_id, reply.doc["ok"]) == (31, 0, 1.0)


def test_compression_can_be_disabled_and_unknown_compressors_are_refused() -> None:
    with ReplicaSet("8.0", compressors="disabled") as replset:
        host, port = replset.members[0].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            assert "compression" not in hello(sock, compression=["zlib"])
            sock.sendall(compressed(op_msg({"ping": 1, "$db": "admin"})))
            assert is_closed(sock)
    with pytest.raises(ValueError, match=r"Invalid network message compressor .*: lz4"):
        ReplicaSet("8.0", compressors=["zlib", "lz4"])


PING = op_msg({"ping": 1, "$db": "admin"})


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(compressed(PING, payload=b"not zlib at all"), id="corrupt-data"),
        pytest.param(compressed(PING, payload=zlib.compress(PING[16:-1])), id="short-data"),
        pytest.param(compressed(PING, payload=zlib.compress(PING[16:] + b"x")), id="long-data"),
        pytest.param(compressed(PING, payload=zlib.compress(PING[16:])[:-3]), id="truncated"),
        pytest.param(compressed(PING, compressor_id=1), id="snappy-not-enabled"),
        pytest.param(compressed(PING, compressor_id=0), id="noop-not-enabled"),
        pytest.param(compressed(PING, compressor_id=9), id="unknown-id"),
        pytest.param(HEADER.pack(24, 1, 0, wire.OP_COMPRESSED) + b"\x00" * 8, id="short-header"),
        pytest.param(
            HEADER.pack(25, 1, 0, wire.OP_COMPRESSED) + COMPRESSION.pack(wire.OP_MSG, 10**8, 2),
            id="huge-size",
        ),
        pytest.param(compressed(compressed(PING)), id="nested"),
    ],
)
def test_malformed_compressed_messages_close_only_that_connection(
    connect: Any, garbage: bytes
) -> None:
    bystander, victim = connect(), connect()
    victim.sendall(garbage)
    assert is_closed(victim)
    assert ping_ok(bystander)


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
