"""A raw change event made into a merge :data:`~changestream._merge.Row` from its bytes.

Why: a sink that mirrors a collection keeps only the last change of each key in a
batch. Where a batch's changes repeat keys (skewed updates on a few thousand hot keys:
~40% of a 10,000-change batch) the superseded ones need no document, yet decoding an
event (~13 µs) and making its document's JSON text (~12-15 µs) cost the same for
each; and every event is read for a handful of fields only. Read from the
server's bytes, an event's top-level fields are found without decoding it (a few
µs), and its ``fullDocument`` stays BSON bytes in the row: only the rows left after
the batch is collapsed are decoded and made into text
(:func:`changestream._delta_rows.json_texts`).

The row is the one :func:`~changestream._merge.as_row` makes of the decoded event,
except for its document (the BSON bytes of ``fullDocument``). Any shape this reader
does not take on trust (a token with more than ``_data``, a field of a type it does
not know, a framing error) gives ``None``: the caller decodes the event as before.
"""

from __future__ import annotations

import re
import struct
from typing import Any

import bson
from bson import json_util
from bson.codec_options import CodecOptions

from ._merge import RELAXED, Row, key_json
from ._snapshot import SNAPSHOT_MARK
from ._token import RAW_ID_PREFIX, raw_token_end

__all__ = ["RAW_CODEC", "raw_row"]

RAW_CODEC: CodecOptions[dict[str, Any]] = CodecOptions(document_class=dict)
"""How a raw event's parts are decoded: the default codec (naive UTC datetimes, binary
UUIDs as ``Binary``), whose documents give the same JSON text as a default client's."""

_ROW_OPERATIONS = frozenset({b"insert", b"update", b"replace", b"delete"})
_FIXED = {0x01: 8, 0x06: 0, 0x07: 12, 0x08: 1, 0x09: 8, 0x0A: 0, 0x10: 4, 0x11: 8, 0x12: 8,
          0x13: 16, 0x7F: 0, 0xFF: 0}
"""Sizes of the values of a fixed size, by BSON type (undefined, null, MinKey, MaxKey: 0)."""
_INT32 = struct.Struct("<I")  # unsigned: a damaged size moves forward, never back
_OID_KEY = b"\x16\x00\x00\x00\x07_id\x00"
"""A ``documentKey`` of only an ObjectId ``_id`` (22 bytes): its text needs no decoding."""
_TOKEN_AT = 4 + len(RAW_ID_PREFIX)  # after the event's size, the _id element's header
_DATA_AT = _TOKEN_AT + 4 + len(b"\x02_data\x00")
_OPERATION = b"\x02operationType\x00"
_CLUSTER_TIME = b"\x11clusterTime\x00"
_WALL_TIME = b"\x09wallTime\x00"
_UUID = b"\x05collectionUUID\x00"
_DOCUMENT = b"\x03fullDocument\x00"
_NO_DOCUMENT = b"\x0afullDocument\x00"
_NS = b"\x03ns\x00"
_KEY = b"\x03documentKey\x00"
_UPDATE = b"\x03updateDescription\x00"
_HEAD = re.compile(
    rb"\x03_id\x00(.{4})\x02_data\x00(.{4})([^\x00]*)\x00\x00"
    rb"\x02operationType\x00(.{4})([^\x00]*)\x00"
    rb"\x11clusterTime\x00.{8}(?:\x09wallTime\x00.{8})?", re.DOTALL)
"""An event's head as servers write it (a token of only ``_data``, ``operationType``,
``clusterTime``, ``wallTime``): one match instead of a check of each field's header, and
``updateDescription`` stepped over by its header: 6.6-6.8 µs a row instead of 7.8-8.0 on
the benchmark machine (a seventh). Any other head is read field by field."""


def raw_row(raw: bytes | memoryview, json_options: json_util.JSONOptions,
            namespaces: dict[bytes, tuple[Any, Any]]) -> Row | None:
    """``raw``'s row with its document as BSON bytes, or ``None`` (decode it instead).

    ``namespaces``: the caller's cache of ``ns`` sub-documents' bytes to ``(db, coll)``
    (a stream's events share a handful).
    """
    data = raw if type(raw) is bytes else bytes(raw)
    try:
        return _row(data, json_options, namespaces)
    except (IndexError, ValueError, struct.error, bson.InvalidBSON):
        return None  # odd framing: the caller's decoding reports it


def _row(data: bytes, json_options: json_util.JSONOptions,
         namespaces: dict[bytes, tuple[Any, Any]]) -> Row | None:
    size = int.from_bytes(data[:4], "little")
    if size != len(data) or data[-1] != 0:
        return None
    match = _HEAD.match(data, 4)
    if match is not None:
        id_size, text_size, text, operation_size, operation = match.groups()
        if not (int.from_bytes(text_size, "little") == len(text) + 1
                and int.from_bytes(id_size, "little") == len(text) + 17
                and int.from_bytes(operation_size, "little") == len(operation) + 1):
            match = None  # sizes that disagree with the bytes: read field by field
    if match is not None:
        token, position = text.decode(), match.end()
    else:
        head = _head_by_fields(data)
        if head is None:
            return None  # a token with more than _data: decoded as before
        token, operation, position = head
    if token == SNAPSHOT_MARK:
        return None
    ns = key = document = None
    has_document = False
    end, int32 = size - 1, _INT32.unpack_from
    # the fields in the order servers write them, each one check of its header; the walk
    # below takes whatever else follows (or comes in another order), as a decoder would
    if data.startswith(_UUID, position):
        start = position + len(_UUID)
        position = start + 5 + int32(data, start)[0]
    if data.startswith(_DOCUMENT, position):
        start = position + len(_DOCUMENT)
        position = start + int32(data, start)[0]
        document, has_document = data[start:position], True
    elif data.startswith(_NO_DOCUMENT, position):
        position += len(_NO_DOCUMENT)
        has_document = True
    if data.startswith(_NS, position):
        start = position + len(_NS)
        position = start + int32(data, start)[0]
        ns = data[start:position]
    if data.startswith(_KEY, position):
        start = position + len(_KEY)
        position = start + int32(data, start)[0]
        key = data[start:position]
    if data.startswith(_UPDATE, position):  # not read: the sink takes the whole document
        start = position + len(_UPDATE)
        position = start + int32(data, start)[0]
    if position > end:
        return None
    find = data.index
    while position < end:
        kind = data[position]
        start = find(0, position + 1) + 1
        name = data[position + 1:start - 1]
        name.decode()  # a damaged name (not UTF-8): left to the decoder, which reports it
        width = _FIXED.get(kind)
        if width is not None:
            stop = start + width
        elif kind == 0x03 or kind == 0x04:  # document, array: an int32 size counting itself
            stop = start + int32(data, start)[0]
        elif kind == 0x02 or kind == 0x0D or kind == 0x0E:  # string, code, symbol
            stop = start + 4 + int32(data, start)[0]
        elif kind == 0x05:  # binary: int32 size, subtype, bytes
            stop = start + 5 + int32(data, start)[0]
        else:
            return None  # regex, DBPointer, code with scope ...: decoded as before
        if stop > end:
            return None
        if name == b"fullDocument":
            if kind == 0x03:
                document, has_document = data[start:stop], True
            elif kind == 0x0A:
                document, has_document = None, True
            else:
                return None  # not a document, not null: decoded (and refused) as before
        elif kind == 0x03 and name == b"documentKey":
            key = data[start:stop]
        elif kind == 0x03 and name == b"ns":
            ns = data[start:stop]
        elif kind == 0x02 and name == b"operationType":
            operation = data[start + 4:stop - 1]
        position = stop
    if operation not in _ROW_OPERATIONS or ns is None or key is None:
        return None
    where = namespaces.get(ns)
    if where is None:
        decoded = bson.decode(ns, RAW_CODEC)
        where = (decoded.get("db"), decoded.get("coll"))
        if len(namespaces) < 64:
            namespaces[ns] = where
    if key.startswith(_OID_KEY) and len(key) == 22 and json_options is RELAXED:
        key_text = f'{{"$oid":"{key[9:21].hex()}"}}'
    else:
        fields = bson.decode(key, RAW_CODEC)
        if "_id" not in fields:
            return None
        key_text = key_json(fields["_id"], json_options)
    return (token, operation.decode(), where[0], where[1], key_text, document, has_document)


def _head_by_fields(data: bytes) -> tuple[str, bytes | None, int] | None:
    """The token's text, the ``operationType`` (``None``: not there) and where the fields
    after the head start, field by field; ``None``: not a token of only ``_data``."""
    token_end = raw_token_end(data)  # _id first, a document, well framed (0: not)
    if not token_end or not data.startswith(b"\x02_data\x00", _TOKEN_AT + 4):
        return None
    text_end = _DATA_AT + 4 + int.from_bytes(data[_DATA_AT:_DATA_AT + 4], "little")
    if text_end != token_end - 1 or data[token_end - 1] != 0 or data[text_end - 1] != 0:
        return None
    token = data[_DATA_AT + 4:text_end - 1].decode()
    operation, position = None, token_end
    if data.startswith(_OPERATION, position):
        start = position + len(_OPERATION)
        position = start + 4 + _INT32.unpack_from(data, start)[0]
        operation = data[start + 4:position - 1]
    if data.startswith(_CLUSTER_TIME, position):
        position += len(_CLUSTER_TIME) + 8
    if data.startswith(_WALL_TIME, position):
        position += len(_WALL_TIME) + 8
    return token, operation, position
