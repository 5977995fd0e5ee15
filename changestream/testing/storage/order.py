"""BSON value semantics the engine shares: comparison order, identity, canonical keys,
and mongod-style rendering of values for error messages.

Indexes, ``_id`` uniqueness, sorts and query matching are all defined by them.
"""

from __future__ import annotations

import functools
import math
import re
import uuid
from collections.abc import Hashable, Mapping
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import bson
from bson.binary import Binary
from bson.code import Code
from bson.codec_options import CodecOptions
from bson.datetime_ms import DatetimeMS
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp

from ..core.errors import CommandError

if TYPE_CHECKING:
    pass

# -- BSON value semantics ------------------------------------------------------

_CANONICAL_BY_TYPE: dict[type, int] = {
    type(None): 5,
    int: 10,
    Int64: 10,
    float: 10,
    Decimal128: 10,
    str: 15,
    dict: 20,
    list: 25,
    tuple: 25,
    bytes: 30,
    Binary: 30,
    uuid.UUID: 30,
    ObjectId: 35,
    bool: 40,
    datetime: 45,
    DatetimeMS: 45,
    Timestamp: 47,
    Regex: 50,
    re.Pattern: 50,
    DBRef: 20,
    Code: 60,
    MinKey: -1,
    MaxKey: 127,
}
"""mongod's ``canonicalizeBSONType`` order (MinKey < null < numbers < strings < ...)."""

_CONTAINERS = (dict, list)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_ONE_MS = timedelta(milliseconds=1)
_ENCODE_OPTS: CodecOptions[dict[str, Any]] = CodecOptions(uuid_representation=4)


def canonical_type(value: Any) -> int:
    """The BSON comparison rank of ``value``'s type."""
    rank = _CANONICAL_BY_TYPE.get(type(value))
    if rank is not None:
        return rank
    for typ, typ_rank in _CANONICAL_BY_TYPE.items():
        if isinstance(value, typ):
            return typ_rank
    raise CommandError(2, f"unsupported BSON value of type {type(value).__name__}")


def _millis(value: datetime | DatetimeMS) -> int:
    if isinstance(value, DatetimeMS):
        return int(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return (value - _EPOCH) // _ONE_MS


def _number(value: Any) -> int | float | Decimal:
    if isinstance(value, Decimal128):
        return value.to_decimal()
    return value  # type: ignore[no-any-return]


def _is_nan(value: int | float | Decimal) -> bool:
    if isinstance(value, Decimal):
        return value.is_nan()
    return isinstance(value, float) and math.isnan(value)


def _as_doc(value: Any) -> Any:
    return value.as_doc() if isinstance(value, DBRef) else value


def compare_values(a: Any, b: Any) -> int:
    """BSON comparison (``woCompare``): negative, zero or positive."""
    ta, tb = canonical_type(a), canonical_type(b)
    if ta != tb:
        return -1 if ta < tb else 1
    if ta == 10:
        na, nb = _number(a), _number(b)
        nan_a, nan_b = _is_nan(na), _is_nan(nb)
        if nan_a or nan_b:
            return (not nan_a) - (not nan_b)  # NaN sorts before every number
        return (na > nb) - (na < nb)
    if ta in (15, 35, 40):
        return (a > b) - (a < b)  # type: ignore[no-any-return]
    if ta == 20:
        ia, ib = list(_as_doc(a).items()), list(_as_doc(b).items())
        for (ka, va), (kb, vb) in zip(ia, ib, strict=False):
            c = canonical_type(va) - canonical_type(vb)
            if c:
                return -1 if c < 0 else 1
            if ka != kb:
                return -1 if ka < kb else 1
            c = compare_values(va, vb)
            if c:
                return c
        return (len(ia) > len(ib)) - (len(ia) < len(ib))
    if ta == 25:
        for va, vb in zip(a, b, strict=False):
            c = compare_values(va, vb)
            if c:
                return c
        return (len(a) > len(b)) - (len(a) < len(b))
    if ta == 30:
        ka, kb = _binary_parts(a), _binary_parts(b)
        key_a = (len(ka[1]), ka[0], ka[1])
        key_b = (len(kb[1]), kb[0], kb[1])
        return (key_a > key_b) - (key_a < key_b)
    if ta == 45:
        ma, mb = _millis(a), _millis(b)
        return (ma > mb) - (ma < mb)
    if ta == 47:
        return (a > b) - (a < b)  # type: ignore[no-any-return]
    if ta == 50:
        pa, pb = _regex_parts(a), _regex_parts(b)
        return (pa > pb) - (pa < pb)
    if ta == 60:
        sa, sb = str(a), str(b)
        if sa != sb:
            return -1 if sa < sb else 1
        return compare_values(a.scope or {}, b.scope or {})
    return 0  # null, MinKey, MaxKey


sort_key = functools.cmp_to_key(compare_values)
"""``sorted(values, key=sort_key)`` orders values as mongod does."""


def values_equal(a: Any, b: Any) -> bool:
    """BSON equality (``1 == 1.0``; field order of objects matters)."""
    return compare_values(a, b) == 0


def _binary_parts(value: Any) -> tuple[int, bytes]:
    if isinstance(value, Binary):
        return value.subtype, bytes(value)
    if isinstance(value, uuid.UUID):
        return 4, value.bytes
    return 0, bytes(value)


def _regex_parts(value: Any) -> tuple[str, str]:
    return str(value.pattern), _flags_text(value.flags)


def _flags_text(flags: int | str) -> str:
    if isinstance(flags, str):
        return "".join(sorted(flags))
    letters = {re.IGNORECASE: "i", re.MULTILINE: "m", re.DOTALL: "s", re.VERBOSE: "x"}
    return "".join(sorted(ch for bit, ch in letters.items() if flags & bit))


_BOOL = "\x00bool"
_NULL = ("\x00null",)
_NAN = ("\x00nan",)


def id_key(value: Any) -> Hashable:
    """A hashable key equal for exactly the values BSON considers equal.

    Strings, ObjectIds and numbers are their own keys (Python already equates
    ``1``, ``1.0``, ``Int64(1)`` and ``Decimal("1")``); every other type is
    tagged so it can never collide with another type.
    """
    typ = type(value)
    if typ is str or typ is ObjectId or typ is int or typ is Int64:
        return value  # type: ignore[no-any-return]
    if typ is float:
        return value if value == value else _NAN
    if typ is bool:
        return (_BOOL, value)
    if value is None:
        return _NULL
    if typ is Decimal128:
        dec = value.to_decimal()
        return _NAN if dec.is_nan() else dec
    if isinstance(value, (dict, DBRef)):
        return ("\x00obj", tuple((k, id_key(v)) for k, v in _as_doc(value).items()))
    if isinstance(value, (list, tuple)):
        return ("\x00arr", tuple(id_key(v) for v in value))
    if isinstance(value, (bytes, uuid.UUID)):
        return ("\x00bin", *_binary_parts(value))
    if isinstance(value, (datetime, DatetimeMS)):
        return ("\x00date", _millis(value))
    if isinstance(value, Timestamp):
        return ("\x00ts", value.time, value.inc)
    if isinstance(value, (Regex, re.Pattern)):
        return ("\x00re", *_regex_parts(value))
    if isinstance(value, Code):
        return ("\x00code", str(value), id_key(value.scope) if value.scope else None)
    if isinstance(value, MinKey):
        return ("\x00min",)
    if isinstance(value, MaxKey):
        return ("\x00max",)
    return ("\x00other", repr(value))


def copy_value(value: Any) -> Any:
    """A deep copy of documents and arrays (every other BSON value is immutable)."""
    typ = type(value)
    if typ is dict:
        return {k: (copy_value(v) if type(v) in _CONTAINERS else v) for k, v in value.items()}
    if typ is list:
        return [copy_value(v) if type(v) in _CONTAINERS else v for v in value]
    if isinstance(value, dict):
        return {k: copy_value(v) for k, v in value.items()}
    return value


def values_identical(a: Any, b: Any) -> bool:
    """Same BSON type and bytes (mongod's ``binaryEqualValues``): ``1`` is not ``1.0``."""
    ta, tb = type(a), type(b)
    if ta is tb and ta in (str, ObjectId, bool, type(None)):
        return bool(a == b)
    if ta is int and tb is int:
        return bool(a == b)
    if ta is dict and tb is dict:
        if len(a) != len(b):
            return False
        return all(
            ka == kb and values_identical(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=False)
        )
    if ta is list and tb is list:
        return len(a) == len(b) and all(values_identical(x, y) for x, y in zip(a, b, strict=False))
    try:
        return bson.encode({"": a}, codec_options=_ENCODE_OPTS) == bson.encode(
            {"": b}, codec_options=_ENCODE_OPTS
        )
    except (TypeError, ValueError, bson.errors.InvalidDocument):
        return bool(a == b)


def bson_repr(value: Any) -> str:
    """``value`` rendered the way mongod's ``BSONElement::toString`` shows it in messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) else str(int(value))
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, ObjectId):
        return f"ObjectId('{value}')"
    if isinstance(value, (dict, DBRef)):
        doc = _as_doc(value)
        if not doc:
            return "{}"
        return "{ " + ", ".join(f"{k}: {bson_repr(v)}" for k, v in doc.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[ " + ", ".join(bson_repr(v) for v in value) + " ]" if value else "[]"
    if isinstance(value, (datetime, DatetimeMS)):
        return f"new Date({_millis(value)})"
    if isinstance(value, Timestamp):
        return f"Timestamp({value.time}, {value.inc})"
    if isinstance(value, Decimal128):
        return f'NumberDecimal("{value}")'
    if isinstance(value, (bytes, uuid.UUID)):
        subtype, data = _binary_parts(value)
        if subtype == 4 and len(data) == 16:
            return f'UUID("{uuid.UUID(bytes=data)}")'
        return f"BinData({subtype}, {data.hex().upper()})"
    if isinstance(value, (Regex, re.Pattern)):
        pattern, flags = _regex_parts(value)
        return f"/{pattern}/{flags}"
    return str(value)


def type_name(value: Any) -> str:
    """mongod's ``typeName`` of ``value`` (as used in error messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Int64):
        return "long"
    if isinstance(value, int):
        return "int" if -(2**31) <= value < 2**31 else "long"
    names: list[tuple[type | tuple[type, ...], str]] = [
        (float, "double"),
        (Decimal128, "decimal"),
        (str, "string"),
        ((Mapping, DBRef), "object"),
        ((list, tuple), "array"),
        ((bytes, uuid.UUID), "binData"),
        (ObjectId, "objectId"),
        ((datetime, DatetimeMS), "date"),
        (Timestamp, "timestamp"),
        ((Regex, re.Pattern), "regex"),
        (Code, "javascript"),
        (MinKey, "minKey"),
        (MaxKey, "maxKey"),
    ]
    for typ, name in names:
        if isinstance(value, typ):
            return name
    return type(value).__name__




