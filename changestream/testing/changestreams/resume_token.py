"""Resume tokens exactly as mongod builds and parses them (``resume_token.cpp``).

A token is ``{_data: <hex KeyString>[, _typeBits: BinData(0)]}`` over the
values clusterTime, version, [tokenType], txnOpIndex, [fromInvalidate],
[uuid | null], [eventIdentifier], [fragmentNum] (server-notes §1). Drivers
compare ``_data`` strings and resume from them, so bytes, ordering and the
errors for malformed tokens must match the server. Encoding runs once per
change event: :func:`encode_event_token` encodes the common shape (documentKey
``{_id: <ObjectId | string | int32>}``) from a template the general encoder
made, so only clusterTime and the ``_id`` are encoded per event.
"""

from __future__ import annotations

import functools
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bson.binary import Binary
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ..core.errors import CommandError
from . import keystring

EVENT_TOKEN = 128
HIGH_WATER_MARK_TOKEN = 0
SUPPORTED_VERSIONS = (0, 1, 2)

CLASSIC_OPERATION_TYPES = frozenset(
    {"insert", "update", "replace", "delete", "drop", "rename", "dropDatabase", "invalidate"}
)
"""Events whose v0/v1 eventIdentifier is the bare documentKey (``kClassicOperationTypes``)."""

_TIMESTAMP_PREFIX = struct.Struct(">BII")
_UUID_PREFIX = bytes((keystring.BINDATA, 16, 4))
_APPEND_NUMBER_INT_LIMIT = 1 << 30
_MISSING: Any = object()
_TIME = struct.Struct(">II")
_OID_HEX = f"{keystring.OID:02X}"
_STRING_HEX = f"{keystring.STRING_LIKE:02X}"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True, slots=True)
class ResumeTokenData:
    """The decoded contents of a resume token (``ResumeTokenData``)."""

    cluster_time: Timestamp
    version: int = 2
    token_type: int = EVENT_TOKEN
    txn_op_index: int = 0
    from_invalidate: bool = False
    uuid: uuid.UUID | None = None
    event_identifier: Any = None
    """None = missing. v0/v1 classic events: the documentKey; otherwise
    ``{"operationType": ..., "documentKey" | "operationDescription": ...}``."""
    fragment_num: int | None = None


def _append_number(n: int) -> int:
    """``BSONObjBuilder::appendNumber(long long)``: int32 when |n| < 2^30, else int64."""
    return n if -_APPEND_NUMBER_INT_LIMIT < n < _APPEND_NUMBER_INT_LIMIT else Int64(n)


@functools.lru_cache(maxsize=1024)
def _middle(
    version: int, token_type: int, txn_op_index: int, from_invalidate: bool
) -> tuple[bytes, int, int]:
    """KeyString bytes and type bits (value, count) of the fields between clusterTime and uuid."""
    values: list[Any] = [version]
    if version >= 1:
        values.append(token_type)
    values.append(_append_number(txn_op_index))
    if version >= 1:
        values.append(from_invalidate)
    out = bytearray()
    bits = keystring.TypeBits()
    for value in values:
        keystring.append_value(out, bits, value)
    return bytes(out), bits.value, bits.count


def _check_encodable(data: ResumeTokenData) -> None:
    """The uasserts of ``ResumeToken::ResumeToken(const ResumeTokenData&)``."""
    if data.token_type == HIGH_WATER_MARK_TOKEN and (
        data.txn_op_index > 0
        or data.from_invalidate
        or data.uuid is not None
        or data.event_identifier is not None
    ):
        raise CommandError(6189505, "Invalid high water mark token")
    if data.uuid is None and data.event_identifier is not None and data.version < 2:
        raise CommandError(50788, "Unexpected resume token with a eventIdentifier but no UUID")
    if data.token_type == EVENT_TOKEN and data.event_identifier is None and data.version >= 2:
        raise CommandError(6189502, "Expected an eventIdentifier for an event resume token")
    if data.fragment_num is not None and data.version < 2:
        raise CommandError(7182504, f"Tokens of version {data.version} cannot have a fragmentNum")


def encode_token(data: ResumeTokenData) -> dict[str, Any]:
    """The ``_id`` of a change event (or a postBatchResumeToken) for ``data``."""
    _check_encodable(data)
    version = data.version
    middle, bits_value, bits_count = _middle(
        version, data.token_type, data.txn_op_index, data.from_invalidate
    )
    out = bytearray(
        _TIMESTAMP_PREFIX.pack(keystring.TIMESTAMP, data.cluster_time.time, data.cluster_time.inc)
    )
    out += middle
    if data.uuid is not None:
        out += _UUID_PREFIX
        out += data.uuid.bytes
    elif version >= 2:
        out.append(keystring.NULLISH)
    bits = keystring.TypeBits(bits_value, bits_count)
    if data.event_identifier is not None:
        keystring.append_value(out, bits, data.event_identifier)
    if data.fragment_num is not None:
        keystring.append_value(out, bits, _append_number(data.fragment_num))
    out.append(keystring.END)
    token: dict[str, Any] = {"_data": out.hex().upper()}
    if bits.value:
        token["_typeBits"] = Binary(bits.serialize(), 0)
    return token


def _render(token: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{key}: {value!r}" for key, value in token.items()) + "}"


def _is_hex(text: str) -> bool:
    return len(text) % 2 == 0 and all(c in "0123456789abcdefABCDEF" for c in text)


def decode_token(token: Mapping[str, Any]) -> ResumeTokenData:
    """Parse a client-supplied token, raising mongod's errors (codes in server-notes §1.1)."""
    hex_data = token.get("_data", _MISSING)
    if not isinstance(hex_data, str):
        raise CommandError(
            40647,
            "Bad resume token: _data of missing or of wrong type. Expected string, got "
            + _render(token),
        )
    raw_bits = token.get("_typeBits", _MISSING)
    if raw_bits is _MISSING:
        raw_bits = b""
    elif not isinstance(raw_bits, bytes) or (isinstance(raw_bits, Binary) and raw_bits.subtype):
        raise CommandError(40648, "Bad resume token: _typeBits of wrong type " + _render(token))
    type_bits = keystring.TypeBitsReader(bytes(raw_bits))
    if not _is_hex(hex_data):
        raise CommandError(9, "resume token string was not a valid hex string")
    values = keystring.decode_key(bytes.fromhex(hex_data), type_bits)
    return _token_data(values)


def _is_int32(value: Any) -> bool:
    return type(value) is int


def _token_data(values: list[Any]) -> ResumeTokenData:
    """``ResumeToken::getData`` after the KeyString was turned into values."""
    if not values:
        raise CommandError(40649, "invalid empty resume token")
    it = iter(values)
    cluster_time = _as_timestamp(next(it))
    version = next(it, _MISSING)
    if version is _MISSING:
        raise CommandError(50796, "Resume Token does not contain version")
    if not _is_int32(version):
        raise CommandError(50854, "Invalid resume token: wrong type for version")
    if version not in SUPPORTED_VERSIONS:
        raise CommandError(50795, "Invalid Resume Token: only supports version 0, 1 and 2")
    token_type = EVENT_TOKEN
    if version >= 1:
        token_type = next(it, _MISSING)
        if token_type is _MISSING:
            raise CommandError(51055, "Resume Token does not contain tokenType")
        if not _is_int32(token_type):
            raise CommandError(51056, "Resume Token tokenType is not an int.")
        if token_type not in (EVENT_TOKEN, HIGH_WATER_MARK_TOKEN):
            raise CommandError(51057, f"Token type {token_type} not recognized")
    txn_op_index = next(it, _MISSING)
    if txn_op_index is _MISSING:
        raise CommandError(50793, "Resume Token does not contain txnOpIndex")
    if not _is_int32(txn_op_index):
        raise CommandError(50855, "Resume Token txnOpIndex is not an integer")
    if txn_op_index < 0:
        raise CommandError(50794, "Invalid Resume Token: txnOpIndex should be non-negative")
    from_invalidate = False
    if version >= 1:
        from_invalidate = next(it, _MISSING)
        if from_invalidate is _MISSING:
            raise CommandError(50872, "Resume Token does not contain fromInvalidate")
        if type(from_invalidate) is not bool:
            raise CommandError(50870, "Resume Token fromInvalidate is not a boolean.")
    fields: dict[str, Any] = {
        "cluster_time": cluster_time,
        "version": version,
        "token_type": token_type,
        "txn_op_index": txn_op_index,
        "from_invalidate": from_invalidate,
    }
    uuid_value = next(it, _MISSING)
    if uuid_value is _MISSING:
        if version >= 2:
            raise CommandError(6189500, "Expected UUID or null")
        return ResumeTokenData(**fields)
    if uuid_value is not None:
        if not isinstance(uuid_value, uuid.UUID):
            raise CommandError(
                207,
                "uuid must be a 16-byte binary field with UUID (4) subtype",
                code_name="InvalidUUID",
            )
        fields["uuid"] = uuid_value
    event_identifier = next(it, _MISSING)
    if event_identifier is not _MISSING and token_type == HIGH_WATER_MARK_TOKEN:
        raise CommandError(6189504, "Invalid high water mark token")
    if event_identifier is _MISSING:
        if token_type == EVENT_TOKEN and version >= 2:
            raise CommandError(6189501, "Expected an eventIdentifier for an event resume token")
        return ResumeTokenData(**fields)
    if not isinstance(event_identifier, dict):
        raise CommandError(6189503, "Resume Token eventIdentifier is not an object")
    fields["event_identifier"] = event_identifier
    fragment_num = next(it, _MISSING)
    if fragment_num is not _MISSING and version >= 2:
        if not _is_int32(fragment_num) or fragment_num < 0:
            raise CommandError(
                7182501, "Resume token 'fragmentNum' must be a non-negative integer."
            )
        fields["fragment_num"] = fragment_num
        fragment_num = next(it, _MISSING)
    if fragment_num is not _MISSING:
        raise CommandError(40646, "invalid oversized resume token")
    return ResumeTokenData(**fields)


def _as_timestamp(value: Any) -> Timestamp:
    """``BSONElement::timestamp()`` for a first value that is not a Timestamp: Timestamp(0, 0).

    (mongod reinterprets a Date's bytes instead; no token it produced starts with one.)
    """
    return value if isinstance(value, Timestamp) else Timestamp(0, 0)


def high_water_mark(cluster_time: Timestamp, version: int) -> ResumeTokenData:
    """``makeHighWaterMarkTokenData``: sorts before every event at ``cluster_time``."""
    return ResumeTokenData(cluster_time, version, token_type=HIGH_WATER_MARK_TOKEN)


def is_high_water_mark(data: ResumeTokenData) -> bool:
    return data == high_water_mark(data.cluster_time, data.version)


def _sort_key(data: ResumeTokenData) -> tuple[Any, ...]:
    """The order of ``compareAgainstClientResumeToken``; eventIdentifier in BSON order.

    KeyString bytes are memcmp-ordered like BSON ``Value::compare``, so the
    eventIdentifier compares by its encoding (missing sorts first).
    """
    event = b""
    if data.event_identifier is not None:
        event, _ = keystring.encode_key([data.event_identifier])
    return (
        data.cluster_time.time,
        data.cluster_time.inc,
        data.token_type,
        data.txn_op_index,
        data.from_invalidate,
        b"" if data.uuid is None else b"\x01" + data.uuid.bytes,
        event,
        -1 if data.fragment_num is None else data.fragment_num,
    )


def compare_tokens(a: ResumeTokenData, b: ResumeTokenData) -> int:
    """-1, 0 or 1 as mongod orders the two tokens (the version is not compared)."""
    key_a, key_b = _sort_key(a), _sort_key(b)
    return (key_a > key_b) - (key_a < key_b)


def event_identifier(
    version: int,
    operation_type: str,
    document_key: dict[str, Any] | None,
    operation_description: dict[str, Any] | None,
) -> Any:
    """The eventIdentifier ``ResumeTokenData``'s constructor derives (None = missing)."""
    if document_key is not None and operation_description is not None:
        raise ValueError("an event has either a documentKey or an operationDescription, not both")
    if version <= 1 and operation_type in CLASSIC_OPERATION_TYPES:
        return document_key
    identifier: dict[str, Any] = {"operationType": operation_type}
    if document_key is not None:
        identifier["documentKey"] = document_key
    elif operation_description is not None:
        identifier["operationDescription"] = operation_description
    return identifier


# -- the per-event fast path -------------------------------------------------------------------
def _str_hex(value: str) -> str | None:
    if "\x00" in value:
        return None  # NULs are escaped in KeyStrings: the general encoder does that
    return _STRING_HEX + value.encode().hex().upper() + "00"


def _int_hex(value: int) -> str | None:
    if not _INT32_MIN <= value <= _INT32_MAX:
        return None  # an int64 sets type bits
    out = bytearray()
    keystring.append_value(out, keystring.TypeBits(), value)
    return out.hex().upper()


def _oid_hex(value: ObjectId) -> str | None:
    return _OID_HEX + value.binary.hex().upper()


_ID_HEX: dict[type, Any] = {ObjectId: _oid_hex, str: _str_hex, int: _int_hex}
"""``_id`` types with a fast path: the hex of the value's key bytes (None: not this one).
Each adds no type bits, so ``_typeBits`` stays absent as in the template."""
_ID_SAMPLES: dict[type, Any] = {ObjectId: ObjectId(b"\x00" * 12), str: "", int: 0}


@functools.lru_cache(maxsize=4096)
def _event_template(
    version: int,
    txn_op_index: int,
    collection_uuid: uuid.UUID | None,
    operation_type: str,
    id_type: type,
) -> tuple[str, str, str] | None:
    """The hex of ``_data`` around the clusterTime and the ``_id`` value (None: no fast path).

    ``_data`` is ``[0] + clusterTime + [1] + _id + [2]``. Made by the general
    encoder from a sample ``_id`` of ``id_type``: the documentKey
    ``{_id: ...}`` is the last value of the key, closed by the end of the documentKey
    (and of the eventIdentifier around it for non-classic events) and kEnd.
    """
    sample = _ID_SAMPLES[id_type]
    data = ResumeTokenData(
        Timestamp(0, 0),
        version,
        EVENT_TOKEN,
        txn_op_index,
        False,
        collection_uuid,
        event_identifier(version, operation_type, {"_id": sample}, None),
    )
    token = encode_token(data)
    if "_typeBits" in token:
        return None
    classic = version <= 1 and operation_type in CLASSIC_OPERATION_TYPES
    after = "00" * (1 if classic else 2) + f"{keystring.END:02X}"
    tail = _ID_HEX[id_type](sample) + after
    hex_data: str = token["_data"]
    assert hex_data.endswith(tail), (hex_data, tail)
    return hex_data[:2], hex_data[2 + 16 : len(hex_data) - len(tail)], after


def event_token(
    cluster_time: Timestamp,
    version: int,
    txn_op_index: int,
    collection_uuid: uuid.UUID | None,
    operation_type: str,
    document_key: dict[str, Any] | None,
    operation_description: dict[str, Any] | None,
    *,
    from_invalidate: bool = False,
) -> ResumeTokenData:
    """The token data of an event (``ResumeTokenData``'s constructor for change events)."""
    return ResumeTokenData(
        cluster_time,
        version,
        EVENT_TOKEN,
        txn_op_index,
        from_invalidate,
        collection_uuid,
        event_identifier(version, operation_type, document_key, operation_description),
    )


def encode_event_token(
    cluster_time: Timestamp,
    version: int,
    txn_op_index: int,
    collection_uuid: uuid.UUID | None,
    operation_type: str,
    document_key: dict[str, Any] | None,
    operation_description: dict[str, Any] | None,
) -> dict[str, Any]:
    """``encode_token(event_token(...))``, from a template when the documentKey is a plain ``_id``.

    Runs once per change event: building the :class:`ResumeTokenData` and the
    generic KeyString for each would dominate the cost of serving events.
    """
    if document_key is not None and len(document_key) == 1 and operation_description is None:
        value = document_key.get("_id", _MISSING)
        kind: type = type(value)
        if kind is ObjectId:  # the usual _id: no call through the table
            hex_value: str | None = _OID_HEX + value.binary.hex().upper()
        else:
            id_hex = _ID_HEX.get(kind)
            hex_value = None if id_hex is None else id_hex(value)
        if hex_value is not None:
            template = _event_template(version, txn_op_index, collection_uuid, operation_type, kind)
            if template is not None:
                time_hex = _TIME.pack(cluster_time.time, cluster_time.inc).hex().upper()
                return {"_data": template[0] + time_hex + template[1] + hex_value + template[2]}
    return encode_token(
        event_token(
            cluster_time,
            version,
            txn_op_index,
            collection_uuid,
            operation_type,
            document_key,
            operation_description,
        )
    )
