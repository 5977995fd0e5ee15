"""MongoDB wire-protocol framing: OP_MSG, the legacy OP_QUERY handshake, OP_COMPRESSED.

Parses one request from a socket into a :class:`Request` and encodes replies
(OP_MSG, or OP_REPLY for OP_QUERY, compressed again when the request was).
Anything malformed raises :class:`ProtocolError`; the server answers that by
closing just that connection, as mongod does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import bson
from bson.errors import BSONError

from ..core.codec import DECODE_OPTIONS, ENCODE_OPTIONS, MAX_MESSAGE_SIZE
from ..core.compression import CompressionError
from ..core.nesting import MAX_BSON_DEPTH, could_exceed, message_depth_error

if TYPE_CHECKING:
    from ..core.compression import Codec, CompressorSet

OP_REPLY = 1
OP_QUERY = 2004
OP_COMPRESSED = 2012
OP_MSG = 2013

CHECKSUM_PRESENT = 1
MORE_TO_COME = 1 << 1
EXHAUST_ALLOWED = 1 << 16
_KNOWN_FLAGS = CHECKSUM_PRESENT | MORE_TO_COME | EXHAUST_ALLOWED
_REQUIRED_FLAG_BITS = 0xFFFF
"""Bits 0-15 are "required": an unknown one there must fail the message."""

OP_QUERY_SECONDARY_OK = 1 << 2
OP_REPLY_AWAIT_CAPABLE = 8

_HEADER = struct.Struct("<iiii")
_INT32 = struct.Struct("<i")
_UINT32 = struct.Struct("<I")
_OP_REPLY_PREFIX = struct.Struct("<iqii")
_COMPRESSION_HEADER = struct.Struct("<iiB")
"""OP_COMPRESSED: originalOpcode, uncompressedSize, compressorId."""



class ProtocolError(Exception):
    """The peer sent something that is not a valid message: drop the connection."""


class InvalidRequest(Exception):
    """A message mongod answers with an error reply instead of closing the connection.

    ``request`` carries what the reply needs (id, opcode, compressor, flags);
    its body is empty.
    """

    def __init__(self, request: Request, code: int, errmsg: str) -> None:
        super().__init__(errmsg)
        self.request = request
        self.code = code
        self.errmsg = errmsg


class _TooDeep(Exception):
    """A document is nested deeper than ``maxBSONDepth`` (mongod: Overflow, 15)."""


@dataclass(slots=True)
class Request:
    """One decoded request."""

    request_id: int
    op_code: int
    body: dict[str, Any]
    """The command document; OP_MSG document sequences are merged in as arrays."""
    db: str | None
    """OP_QUERY: the database of ``<db>.$cmd``; OP_MSG: None (it is ``body["$db"]``)."""
    flags: int = 0
    """OP_MSG flag bits, or the OP_QUERY flags."""
    compressor_id: int | None = None
    """The compressor of an OP_COMPRESSED request (its reply uses the same one)."""
    wire_size: int = 0
    """Bytes read from the socket (compressed size for OP_COMPRESSED)."""
    size: int = 0
    """Length of the (decompressed) message."""

    @property
    def checksum(self) -> bool:
        return self.op_code == OP_MSG and bool(self.flags & CHECKSUM_PRESENT)

    @property
    def more_to_come(self) -> bool:
        """The client wants no reply (OP_MSG moreToCome)."""
        return self.op_code == OP_MSG and bool(self.flags & MORE_TO_COME)

    @property
    def exhaust_allowed(self) -> bool:
        return self.op_code == OP_MSG and bool(self.flags & EXHAUST_ALLOWED)


# -- CRC-32C (Castagnoli), for OP_MSG checksums --------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC-32C of ``data`` (continuing from ``crc``)."""
    table = _CRC32C_TABLE
    crc ^= 0xFFFFFFFF
    for byte in bytes(data):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# -- reading -------------------------------------------------------------------------------


def check_header(header: bytes) -> int:
    """The total length a message header announces (raises :class:`ProtocolError`).

    Checked before any of the body is read, so a header announcing a message
    that is too large, or an opcode the server does not speak, closes the
    connection at once.
    """
    length, _request_id, _response_to, op_code = _HEADER.unpack_from(header)
    if length < 21 or length > MAX_MESSAGE_SIZE:
        raise ProtocolError(f"invalid message length {length}")
    if op_code not in (OP_MSG, OP_QUERY, OP_COMPRESSED):
        raise ProtocolError(f"unsupported opcode {op_code}")
    return int(length)


def parse_message(message: bytes, compressors: CompressorSet | None = None) -> Request:
    """Decode one complete message (header included) into a :class:`Request`.

    OP_COMPRESSED is decompressed with the member's ``compressors`` (any
    enabled one: mongod does not require it to have been negotiated). Raises
    :class:`ProtocolError` for anything malformed and :class:`InvalidRequest`
    for a message mongod answers with an error (a document nested too deep).
    """
    length = check_header(message)
    if len(message) != length:
        raise ProtocolError(f"message of {len(message)} bytes announces {length}")
    header = bytearray(message[:16])
    request_id = _HEADER.unpack_from(header)[1]
    op_code = _HEADER.unpack_from(header)[3]
    rest = bytearray(message[16:])
    compressor_id: int | None = None
    if op_code == OP_COMPRESSED:
        compressor_id, header, rest = _decompress(header, rest, compressors)
        op_code = _HEADER.unpack(header)[3]
    try:
        if op_code == OP_MSG:
            request = _parse_op_msg(request_id, header, rest)
        else:
            request = _parse_op_query(request_id, rest)
    except _TooDeep as exc:
        flags = _UINT32.unpack_from(rest, 0)[0] if op_code == OP_MSG else 0
        partial = Request(request_id, op_code, {}, None, flags, compressor_id, length)
        raise InvalidRequest(partial, 15, str(exc)) from None
    request.compressor_id = compressor_id
    request.wire_size = length
    request.size = len(rest) + 16
    return request


def _decompress(
    header: bytearray, rest: bytearray, compressors: CompressorSet | None
) -> tuple[int, bytearray, bytearray]:
    """``decompressMessage``: the compressor id, and the original message's header and body."""
    if len(rest) < _COMPRESSION_HEADER.size:
        raise ProtocolError("Invalid compressed message header")
    original_op, size, ident = _COMPRESSION_HEADER.unpack_from(rest)
    if original_op not in (OP_MSG, OP_QUERY):
        raise ProtocolError(f"unsupported opcode {original_op} inside OP_COMPRESSED")
    if not 5 <= size <= MAX_MESSAGE_SIZE - 16:
        raise ProtocolError("Decompressed message would be larger than maximum message size")
    if compressors is None:
        raise ProtocolError("Compression algorithm specified in message is not available")
    try:
        codec, body = compressors.decompress(ident, bytes(rest[_COMPRESSION_HEADER.size :]), size)
    except CompressionError as exc:
        raise ProtocolError(str(exc)) from None
    _length, request_id, response_to, _op = _HEADER.unpack(header)
    original = bytearray(_HEADER.pack(size + 16, request_id, response_to, original_op))
    return codec.id, original, bytearray(body)


def _decode(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """One document of a message, validated for nesting as mongod validates it."""
    try:
        doc: dict[str, Any] = bson.decode(data, DECODE_OPTIONS)
    except (RecursionError, BSONError, ValueError, TypeError, OverflowError) as exc:
        if isinstance(exc, RecursionError) or "recursion" in str(exc):
            # Far deeper than any limit: the decoder itself gave up.
            raise _TooDeep(
                "BSONObj exceeds maximum nested object depth in element with field name "
                "'?' in object with unknown _id"
            ) from None
        raise ProtocolError(f"invalid BSON: {exc}") from None
    if could_exceed(len(data), MAX_BSON_DEPTH + 2):
        error = message_depth_error(doc)
        if error is not None:
            raise _TooDeep(error)
    return doc


def _doc_len(data: bytes | bytearray | memoryview, pos: int, end: int) -> int:
    if pos + 5 > end:
        raise ProtocolError("truncated BSON document")
    (size,) = _INT32.unpack_from(data, pos)
    if size < 5 or pos + size > end:
        raise ProtocolError(f"invalid BSON document length {size}")
    return int(size)


def _parse_op_msg(request_id: int, header: bytearray, rest: bytearray) -> Request:
    (flags,) = _UINT32.unpack_from(rest, 0)
    unknown = flags & ~_KNOWN_FLAGS
    if unknown & _REQUIRED_FLAG_BITS:
        raise ProtocolError(f"OP_MSG contains unknown required flags 0x{flags:x}")
    end = len(rest)
    if flags & CHECKSUM_PRESENT:
        if end < 4 + 4 + 1:
            raise ProtocolError("OP_MSG too short for its checksum")
        end -= 4
        (expected,) = _UINT32.unpack_from(rest, end)
        actual = crc32c(memoryview(rest)[:end], crc32c(header))
        if actual != expected:
            raise ProtocolError("OP_MSG checksum mismatch")
    view = memoryview(rest)
    pos = 4
    body: dict[str, Any] | None = None
    sequences: list[tuple[str, list[dict[str, Any]]]] = []
    while pos < end:
        kind = rest[pos]
        pos += 1
        if kind == 0:
            if body is not None:
                raise ProtocolError("OP_MSG has more than one body section")
            size = _doc_len(rest, pos, end)
            body = _decode(view[pos : pos + size])
            pos += size
        elif kind == 1:
            if pos + 4 > end:
                raise ProtocolError("truncated OP_MSG document sequence")
            (size,) = _INT32.unpack_from(rest, pos)
            seq_end = pos + size
            if size < 5 or seq_end > end:
                raise ProtocolError(f"invalid OP_MSG document sequence length {size}")
            nul = rest.find(b"\x00", pos + 4, seq_end)
            if nul < 0:
                raise ProtocolError("unterminated OP_MSG document sequence identifier")
            try:
                ident = bytes(rest[pos + 4 : nul]).decode()
            except UnicodeDecodeError:
                raise ProtocolError("OP_MSG document sequence identifier is not UTF-8") from None
            docs = []
            p = nul + 1
            while p < seq_end:
                dsize = _doc_len(rest, p, seq_end)
                docs.append(_decode(view[p : p + dsize]))
                p += dsize
            sequences.append((ident, docs))
            pos = seq_end
        else:
            raise ProtocolError(f"unknown OP_MSG section kind {kind}")
    if body is None:
        raise ProtocolError("OP_MSG has no body section")
    for ident, docs in sequences:
        if ident in body:
            raise ProtocolError(f"duplicate field {ident!r} in OP_MSG body and document sequence")
        body[ident] = docs
    return Request(request_id, OP_MSG, body, None, flags)


def _parse_op_query(request_id: int, rest: bytearray) -> Request:
    (flags,) = _INT32.unpack_from(rest, 0)
    nul = rest.find(b"\x00", 4)
    if nul < 0:
        raise ProtocolError("unterminated OP_QUERY collection name")
    try:
        full_name = bytes(rest[4:nul]).decode()
    except UnicodeDecodeError:
        raise ProtocolError("OP_QUERY collection name is not UTF-8") from None
    pos = nul + 1 + 8  # numberToSkip, numberToReturn
    size = _doc_len(rest, pos, len(rest))
    query = _decode(memoryview(rest)[pos : pos + size])
    db, _, coll = full_name.partition(".")
    if coll != "$cmd" or not db:
        raise ProtocolError(f"OP_QUERY is only supported for commands, not on {full_name!r}")
    if "$query" in query:
        wrapped = query["$query"]
        if isinstance(wrapped, dict):
            read_pref = query.get("$readPreference")
            query = dict(wrapped)
            if read_pref is not None:
                query["$readPreference"] = read_pref
    return Request(request_id, OP_QUERY, query, db, flags)


# -- writing -------------------------------------------------------------------------------


def encode_op_msg(
    request_id: int,
    response_to: int,
    payload: bytes,
    *,
    more_to_come: bool = False,
    checksum: bool = False,
) -> bytes:
    """An OP_MSG carrying one already-encoded BSON body."""
    flags = (MORE_TO_COME if more_to_come else 0) | (CHECKSUM_PRESENT if checksum else 0)
    length = 16 + 4 + 1 + len(payload) + (4 if checksum else 0)
    msg = b"".join(
        (
            _HEADER.pack(length, request_id, response_to, OP_MSG),
            _UINT32.pack(flags),
            b"\x00",
            payload,
        )
    )
    if checksum:
        msg += _UINT32.pack(crc32c(msg))
    return msg


def encode_op_reply(request_id: int, response_to: int, payload: bytes) -> bytes:
    """An OP_REPLY (answer to an OP_QUERY command) carrying one BSON document."""
    length = 16 + _OP_REPLY_PREFIX.size + len(payload)
    return b"".join(
        (
            _HEADER.pack(length, request_id, response_to, OP_REPLY),
            _OP_REPLY_PREFIX.pack(OP_REPLY_AWAIT_CAPABLE, 0, 0, 1),
            payload,
        )
    )


def compress_message(message: bytes, codec: Codec, compressors: CompressorSet) -> bytes:
    """``message`` as an OP_COMPRESSED with ``codec`` (unchanged if that would be too big)."""
    _length, request_id, response_to, op_code = _HEADER.unpack_from(message)
    body = message[16:]
    payload = compressors.compress(codec, body)
    length = 16 + _COMPRESSION_HEADER.size + len(payload)
    if length > MAX_MESSAGE_SIZE:
        return message
    return b"".join(
        (
            _HEADER.pack(length, request_id, response_to, OP_COMPRESSED),
            _COMPRESSION_HEADER.pack(op_code, len(body), codec.id),
            payload,
        )
    )


def encode_document(doc: dict[str, Any]) -> bytes:
    """BSON-encode a reply document with :data:`ENCODE_OPTIONS`."""
    return bson.encode(doc, codec_options=ENCODE_OPTIONS)
