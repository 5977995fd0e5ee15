"""KeyString V1: mongod's memcmp-ordered encoding of BSON values (``key_string.cpp``).

Resume tokens are KeyStrings (``_data`` is their hex, ``_typeBits`` the type
information the ordering-preserving bytes lose), so drivers can compare and
parse them only if the simulator produces the exact bytes mongod does. The
encoder is on the hot path (one token per change event) and the decoder checks
untrusted client tokens, raising mongod's error codes for malformed input.

Python value mapping (as pymongo decodes BSON): int -> int32 (int64 when it
does not fit), :class:`~bson.int64.Int64`, float, str, bytes (BinData 0),
:class:`~bson.binary.Binary`, :class:`uuid.UUID` (BinData 4), ObjectId,
datetime, Timestamp, Mapping, list/tuple, None, bool, MinKey, MaxKey,
:data:`UNDEFINED`, Regex/re.Pattern, Code, DBRef (an object), Decimal128 (every
value except non-zero magnitudes below the smallest normal double, ~2.2E-308,
which need mongod's scaled-decimal "tiny" encoding and fail clearly). Only
ascending ordering (as in resume tokens) is implemented.
"""

from __future__ import annotations

import calendar
import datetime
import decimal
import math
import re
import struct
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from bson.binary import Binary
from bson.code import Code
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

# CType bytes (key_string.cpp, namespace CType).
MIN_KEY = 0x0A
UNDEFINED_TYPE = 0x0F
NULLISH = 0x14
NUMERIC = 0x1E  # generic numeric type byte; also NaN
NEGATIVE_LARGE = 0x1F
NEGATIVE_8_BYTE_INT = 0x20
NEGATIVE_1_BYTE_INT = 0x27
NEGATIVE_SMALL = 0x28
ZERO = 0x29
POSITIVE_SMALL = 0x2A
POSITIVE_1_BYTE_INT = 0x2B
POSITIVE_8_BYTE_INT = 0x32
POSITIVE_LARGE = 0x33
STRING_LIKE = 0x3C
OBJECT = 0x46
ARRAY = 0x50
BINDATA = 0x5A
OID = 0x64
BOOL_FALSE = 0x6E
BOOL_TRUE = 0x6F
DATE = 0x78
TIMESTAMP = 0x82
REGEX = 0x8C
DBPOINTER = 0x96
CODE = 0xA0
CODE_W_SCOPE = 0xAA
MAX_KEY = 0xF0
END = 0x04
LESS = 0x01
GREATER = 0xFE

# TypeBits codes (key_string.h, class TypeBits).
_INT, _LONG, _DOUBLE, _DECIMAL = 0, 1, 2, 3
_SPECIAL_ZERO_PREFIX = 3
_V1_NEGATIVE_DOUBLE_ZERO = 0x18
_MAX_SHORT_TYPE_BITS = 127

_MASK64 = (1 << 64) - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MIN_LARGE_DOUBLE = 2.0**63
_TINIEST_2BIT_DCM = 2.0**-255
_TINY_UP = 2.0**256
_TINY_DOWN = 2.0**-256
_POW256 = tuple(float(256**i) for i in range(8))
_MAX_DEPTH = 200  # BSONDepth::kDefaultMaxAllowableDepth
_NOT_IMPLEMENTED = 238

# NumberDecimal (key_string.h DecimalContinuationMarker, decimal128.h).
_DCM_EQUAL = 0  # the decimal equals the double
_DCM_LESS = 1  # a continuation follows; the decimal is below the double rounded to 15 digits
_DCM_EQUAL_15 = 2  # the decimal is the double rounded (away from zero) to 15 digits
_DCM_LARGER = 3  # a continuation follows; the decimal is above it
_DEC_BIAS = 6176
_DEC_MAX_BIASED = 12287
_DEC_EXPONENT_BITS = 6  # TypeBits::kStoredDecimalExponentBits
_DEC_ZERO_FIRST = 0x1A  # TypeBits::kDecimalZero0xxx; 12 more exponent bits follow
_DBL_MIN = sys.float_info.min
_DBL_MAX = sys.float_info.max
_MAX_INT_FOR_DOUBLE = 2**53
_EXACT = decimal.Context(
    prec=400, Emax=10**6, Emin=-(10**6), traps=[decimal.Inexact, decimal.InvalidOperation]
)
"""Decimal arithmetic that must not round (it raises instead)."""

_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")
_TS = struct.Struct(">BII")
_EPOCH = datetime.datetime(1970, 1, 1)
_REGEX_FLAGS = (
    ("i", re.IGNORECASE),
    ("l", re.LOCALE),
    ("m", re.MULTILINE),
    ("s", re.DOTALL),
    ("u", re.UNICODE),
    ("x", re.VERBOSE),
)


class _Undefined:
    """BSON ``undefined`` (deprecated): pymongo has no class for it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNDEFINED"


UNDEFINED = _Undefined()
"""The value a KeyString ``undefined`` decodes to (and encodes from)."""


def _decimal_unsupported(value: object) -> CommandError:
    return CommandError(
        _NOT_IMPLEMENTED,
        f"NumberDecimal {value} in a resume token: magnitudes below 2.2250738585072014E-308 "
        '(mongod\'s scaled "tiny decimal" KeyString encoding) are not supported by the '
        "simulator",
        code_name="NotImplemented",
    )


def _format_error(code: int, message: str) -> CommandError:
    return CommandError(code, f"KeyString format error: {message}")


class TypeBits:
    """Growing TypeBits bit stream: bit *i* of ``value`` is the *i*-th bit appended."""

    __slots__ = ("count", "value")

    def __init__(self, value: int = 0, count: int = 0) -> None:
        self.value = value
        self.count = count

    def append_msb_first(self, value: int, width: int) -> None:
        """Append the ``width`` low bits of ``value``, most significant first."""
        for pos in range(width - 1, -1, -1):
            if (value >> pos) & 1:
                self.value |= 1 << self.count
            self.count += 1

    def serialize(self) -> bytes:
        """mongod's wire form: empty when all zero, 1 byte, ``0x80|N`` + N, or ``0x80`` + LE32 + N."""
        if not self.value:
            return b""
        size = (self.count + 7) >> 3
        data = self.value.to_bytes(size, "little")
        if size == 1 and data[0] < 0x80:
            return data
        if size <= _MAX_SHORT_TYPE_BITS:
            return bytes((0x80 | size,)) + data
        return b"\x80" + size.to_bytes(4, "little") + data


class TypeBitsReader:
    """Reads a serialized TypeBits buffer the way ``TypeBits::resetFromBuffer`` does."""

    __slots__ = ("_all_zeros", "_cur", "_data")

    def __init__(self, raw: bytes) -> None:
        self._cur = 0
        self._data = b""
        self._all_zeros = True
        if not raw:
            return
        first = raw[0]
        if 0 < first < 0x80:
            start, size = 0, 1
        elif first > 0x80:
            start, size = 1, first & 0x7F
        elif first == 0x80:
            _check_available(raw, 1, 4)
            size = int.from_bytes(raw[1:5], "little")
            if size <= _MAX_SHORT_TYPE_BITS:
                raise _format_error(50910, "Invalid overlong encoding.")
            start = 5
        else:
            return
        _check_available(raw, start, size)
        self._data = raw[start : start + size]
        self._all_zeros = size == 0

    def bit(self) -> int:
        if self._all_zeros:
            return 0
        byte, offset = self._cur >> 3, self._cur & 7
        self._cur += 1
        if byte >= len(self._data):
            raise _format_error(50615, "Invalid size byte(s).")
        return (self._data[byte] >> offset) & 1

    def numeric(self) -> int:
        high = self.bit()
        return (high << 1) | self.bit()

    def zero(self) -> int:
        kind = self.numeric()
        if kind == _SPECIAL_ZERO_PREFIX:
            for _ in range(3):
                kind = (kind << 1) | self.bit()
        return kind

    def bits(self, width: int) -> int:
        """``width`` bits, most significant first (decimal exponents and zeros)."""
        value = 0
        for _ in range(width):
            value = (value << 1) | self.bit()
        return value


def _check_available(data: bytes, pos: int, size: int) -> None:
    if pos + size > len(data):
        raise CommandError(
            15,
            f"Invalid advance ({size}) past end of buffer[{len(data) - pos}] at offset: {pos}",
            code_name="Overflow",
        )


# ---------------------------------------------------------------------------- encoding

_Encoder = Callable[[bytearray, TypeBits, Any], None]


def _append_preshifted(out: bytearray, shifted: int, negative: bool) -> None:
    """``_appendPreshiftedIntegerPortion``: ctype by byte count, bytes inverted if negative."""
    size = (shifted.bit_length() + 7) >> 3
    if negative:
        out.append(NEGATIVE_1_BYTE_INT + 1 - size)
        out += (shifted ^ ((1 << (size << 3)) - 1)).to_bytes(size, "big")
    else:
        out.append(POSITIVE_1_BYTE_INT - 1 + size)
        out += shifted.to_bytes(size, "big")


def _append_u64(out: bytearray, value: int, negative: bool) -> None:
    out += (value ^ _MASK64 if negative else value).to_bytes(8, "big")


def _append_large_double(out: bytearray, x: float, dcm: int = _DCM_EQUAL) -> None:
    """``_appendLargeDouble``: magnitudes of 2**63 and more (one DCM bit: continuation or not)."""
    bits = _U64.unpack(_F64.pack(x))[0]
    marker = dcm != _DCM_EQUAL
    encoded = _MASK64 if math.isinf(x) else ((bits << 1) & (_MASK64 >> 1)) | marker
    out.append(POSITIVE_LARGE if x > 0 else NEGATIVE_LARGE)
    _append_u64(out, encoded, x < 0)


def _append_integer(out: bytearray, n: int) -> None:
    """``_appendInteger``: int32 and int64 share the value encoding."""
    if n == 0:
        out.append(ZERO)
    elif n == _INT64_MIN:
        _append_large_double(out, float(n))
    elif n > 0:
        _append_preshifted(out, n << 1, False)
    else:
        _append_preshifted(out, (-n) << 1, True)


def _enc_int(out: bytearray, tb: TypeBits, value: Any) -> None:
    if _INT32_MIN <= value <= _INT32_MAX:
        tb.count += 2
    else:
        _check_int64(value)
        tb.value |= 1 << (tb.count + 1)
        tb.count += 2
    _append_integer(out, value)


def _enc_int64(out: bytearray, tb: TypeBits, value: Any) -> None:
    _check_int64(value)
    tb.value |= 1 << (tb.count + 1)
    tb.count += 2
    _append_integer(out, int(value))


def _check_int64(value: int) -> None:
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise OverflowError("BSON can only handle up to 8-byte ints")


def _append_double_value(out: bytearray, x: float, dcm: int = _DCM_EQUAL) -> None:
    """``_appendDoubleWithoutTypeBits``: a double, and for decimals the DCM saying how the
    decimal relates to it (0 for plain doubles)."""
    negative = x < 0.0
    mag = -x if negative else x
    if not mag >= 1.0:
        if mag > 0.0:
            if mag >= _TINIEST_2BIT_DCM:
                encoded = ((_U64.unpack(_F64.pack(mag))[0] << 2) & _MASK64) | dcm
            else:
                scaled = _U64.unpack(_F64.pack(mag * _TINY_UP))[0]
                marker = dcm != _DCM_EQUAL
                encoded = ((((scaled << 1) & _MASK64) | marker) + (1 << 62)) & _MASK64
            out.append(NEGATIVE_SMALL if negative else POSITIVE_SMALL)
            _append_u64(out, encoded, negative)
        else:
            out.append(ZERO if x == 0.0 else NUMERIC)  # NaN sorts first
        return
    if mag >= _MIN_LARGE_DOUBLE:
        _append_large_double(out, x, dcm)
        return
    integer = int(mag)
    if float(integer) == mag and dcm == _DCM_EQUAL:
        _append_preshifted(out, integer << 1, negative)
        return
    frac_bytes = (64 - (integer << 1).bit_length()) >> 3
    encoded = int(mag * _POW256[frac_bytes]) + ((integer + 1) << (frac_bytes << 3))
    out.append(NEGATIVE_8_BYTE_INT + frac_bytes if negative else POSITIVE_8_BYTE_INT - frac_bytes)
    _append_u64(out, encoded | dcm, negative)


def _enc_double(out: bytearray, tb: TypeBits, value: Any) -> None:
    if value == 0.0 and math.copysign(1.0, value) < 0:
        tb.value |= 0b11 << tb.count  # 5 bits 1,1,0,0,0 (kV1NegativeDoubleZero)
        tb.count += 5
    else:
        tb.value |= 1 << tb.count  # kDouble: bits 1,0
        tb.count += 2
    _append_double_value(out, value)


def _append_string_like(out: bytearray, raw: bytes) -> None:
    out += raw.replace(b"\x00", b"\x00\xff")
    out.append(0)


def _enc_str(out: bytearray, tb: TypeBits, value: Any) -> None:
    tb.count += 1  # kString
    out.append(STRING_LIKE)
    if "\x00" in value:
        _append_string_like(out, value.encode())
    else:
        out += value.encode()
        out.append(0)


def _enc_bool(out: bytearray, tb: TypeBits, value: Any) -> None:
    out.append(BOOL_TRUE if value else BOOL_FALSE)


def _enc_none(out: bytearray, tb: TypeBits, value: Any) -> None:
    out.append(NULLISH)


def _enc_constant(ctype: int) -> _Encoder:
    def encode(out: bytearray, tb: TypeBits, value: Any) -> None:
        out.append(ctype)

    return encode


def _enc_oid(out: bytearray, tb: TypeBits, value: Any) -> None:
    out.append(OID)
    out += value.binary


def _append_bindata(out: bytearray, data: bytes, subtype: int) -> None:
    out.append(BINDATA)
    size = len(data)
    if size < 0xFF:
        out.append(size)
    else:
        out.append(0xFF)
        out += size.to_bytes(4, "big")
    out.append(subtype)
    out += data


def _enc_bytes(out: bytearray, tb: TypeBits, value: Any) -> None:
    _append_bindata(out, bytes(value), 0)


def _enc_binary(out: bytearray, tb: TypeBits, value: Any) -> None:
    _append_bindata(out, bytes(value), value.subtype)


def _enc_uuid(out: bytearray, tb: TypeBits, value: Any) -> None:
    _append_bindata(out, value.bytes, 4)


def _append_millis(out: bytearray, millis: int) -> None:
    out.append(DATE)
    out += ((millis & _MASK64) ^ (1 << 63)).to_bytes(8, "big")


def _enc_datetime(out: bytearray, tb: TypeBits, value: Any) -> None:
    offset = value.utcoffset()
    if offset is not None:
        value = value - offset
    _append_millis(out, calendar.timegm(value.timetuple()) * 1000 + value.microsecond // 1000)


def _enc_datetime_ms(out: bytearray, tb: TypeBits, value: Any) -> None:
    _append_millis(out, int(value))


def _enc_timestamp(out: bytearray, tb: TypeBits, value: Any) -> None:
    out += _TS.pack(TIMESTAMP, value.time, value.inc)


_FIELD_NAMES: dict[str, bytes] = {}
_FIELD_NAME_CACHE_SIZE = 4096


def _field_name(name: str) -> bytes:
    """``name`` as a NUL-terminated C string, cached while the cache has room (hot path)."""
    if "\x00" in name:
        raise ValueError(f"field name {name!r} contains a NUL byte")
    raw = name.encode() + b"\x00"
    if len(_FIELD_NAMES) < _FIELD_NAME_CACHE_SIZE:
        _FIELD_NAMES[name] = raw
    return raw


def _append_fields(out: bytearray, tb: TypeBits, value: Mapping[str, Any]) -> None:
    """``_appendBson``: per field the generic type byte, the name, the full value; then 0."""
    for name, item in value.items():
        encode, generic = _TABLE.get(type(item)) or _resolve(type(item), item)
        if generic < 0:
            generic = CODE_W_SCOPE if item.scope is not None else CODE
        out.append(generic)
        out += _FIELD_NAMES.get(name) or _field_name(name)
        encode(out, tb, item)
    out.append(0)


def _enc_mapping(out: bytearray, tb: TypeBits, value: Any) -> None:
    out.append(OBJECT)
    _append_fields(out, tb, value)


def _enc_dbref(out: bytearray, tb: TypeBits, value: Any) -> None:
    _enc_mapping(out, tb, value.as_doc())


def _enc_array(out: bytearray, tb: TypeBits, value: Any) -> None:
    out.append(ARRAY)
    for item in value:
        (_TABLE.get(type(item)) or _resolve(type(item), item))[0](out, tb, item)
    out.append(0)


def _regex_flags(flags: int) -> bytes:
    return "".join(letter for letter, bit in _REGEX_FLAGS if flags & bit).encode()


def _enc_regex(out: bytearray, tb: TypeBits, value: Any) -> None:
    pattern = value.pattern
    raw = pattern if isinstance(pattern, bytes) else pattern.encode()
    out.append(REGEX)
    out += raw + b"\x00" + _regex_flags(value.flags) + b"\x00"


def _enc_code(out: bytearray, tb: TypeBits, value: Any) -> None:
    if value.scope is None:
        out.append(CODE)
        _append_string_like(out, str(value).encode())
    else:
        out.append(CODE_W_SCOPE)
        _append_string_like(out, str(value).encode())
        _append_fields(out, tb, value.scope)


# -- NumberDecimal (``_appendNumberDecimal``) ------------------------------------------------


def _rounded(value: decimal.Decimal, digits: int, rounding: str) -> decimal.Decimal:
    """``value`` rounded to ``digits`` significant digits (``Decimal128(double, ...)``)."""
    context = decimal.Context(prec=digits, rounding=rounding, Emax=10**6, Emin=-(10**6))
    return context.plus(value)


def _toward_zero(value: decimal.Decimal) -> tuple[float, bool]:
    """``toDouble(kRoundTowardZero)``: the double and whether it is inexact."""
    approx = float(value)  # correctly rounded to nearest
    if math.isinf(approx):
        approx = math.copysign(_DBL_MAX, approx)
    if decimal.Decimal(approx).copy_abs() > value.copy_abs():
        approx = math.nextafter(approx, 0.0)
    return approx, decimal.Decimal(approx) != value


def _at_34_digits(value: decimal.Decimal) -> int:
    """The exponent of ``value`` normalized to 34 digits (``Decimal128::normalize``)."""
    return max(value.adjusted() - 33, -_DEC_BIAS)


def _append_continuation(
    out: bytearray, value: decimal.Decimal, stored: decimal.Decimal, negative: bool
) -> None:
    """The 8-byte decimal continuation: ``value - stored`` in units of stored's last digit."""
    exponent = _at_34_digits(stored)
    continuation = _EXACT.scaleb(_EXACT.subtract(value, stored).copy_abs(), -exponent)
    _append_u64(out, int(continuation), negative)


def _append_huge_decimal(out: bytearray, magnitude: decimal.Decimal, negative: bool) -> None:
    """``_appendHugeDecimalWithoutTypeBits``: the BID bits of the normalized magnitude."""
    exponent = _at_34_digits(magnitude)
    coefficient = int(_EXACT.scaleb(magnitude, -exponent))
    out.append(NEGATIVE_LARGE if negative else POSITIVE_LARGE)
    high = (1 << 63) | ((exponent + _DEC_BIAS) << 49) | (coefficient >> 64)
    _append_u64(out, high, negative)
    _append_u64(out, coefficient & _MASK64, negative)


def _enc_decimal(out: bytearray, tb: TypeBits, value: Any) -> None:
    number: decimal.Decimal = value.to_decimal()
    if number.is_nan():
        out.append(NUMERIC)
        tb.append_msb_first(_DECIMAL, 2)
        return
    negative = number.is_signed()
    if number.is_infinite():
        out.append(NEGATIVE_LARGE if negative else POSITIVE_LARGE)
        _append_u64(out, _MASK64, negative)
        tb.append_msb_first(_DECIMAL, 2)
        return
    _, digits, exponent = number.as_tuple()
    assert isinstance(exponent, int)
    biased = exponent + _DEC_BIAS
    if number.is_zero():
        which = biased + (_DEC_MAX_BIASED + 1 if negative else 0)
        tb.append_msb_first((which >> 12) + _DEC_ZERO_FIRST, 5)
        tb.append_msb_first(which, 12)
        out.append(ZERO)
        return
    tb.append_msb_first(_DECIMAL, 2)
    tb.append_msb_first(biased, _DEC_EXPONENT_BITS)
    _append_decimal_value(out, number, negative, int("".join(map(str, digits))))


def _append_decimal_value(
    out: bytearray, number: decimal.Decimal, negative: bool, coefficient: int
) -> None:
    """The key bytes of a finite non-zero decimal: its double, a DCM, maybe a continuation."""
    binary, inexact = _toward_zero(number)
    if not inexact:
        _append_double_value(out, binary, _DCM_EQUAL)
        return
    magnitude = abs(binary)
    if magnitude < _DBL_MIN:
        raise _decimal_unsupported(number)
    if magnitude >= _DBL_MAX:
        _append_huge_decimal(out, number.copy_abs(), negative)
        return
    away = decimal.ROUND_FLOOR if negative else decimal.ROUND_CEILING
    if magnitude >= _MIN_LARGE_DOUBLE or magnitude < _TINIEST_2BIT_DCM:
        _append_double_value(out, binary, _DCM_LARGER)  # a single DCM bit there
        stored = _rounded(decimal.Decimal(binary), 34, away)
    elif magnitude >= _MAX_INT_FOR_DOUBLE:
        integer = int(number.copy_abs())  # truncated toward zero
        has_fraction = decimal.Decimal(integer) != number.copy_abs()
        _append_preshifted(out, (integer << 1) | has_fraction, negative)
        if not has_fraction:
            return
        if integer < 2**55:  # the fraction byte holds only the DCM
            out.append(_DCM_LARGER ^ 0xFF if negative else _DCM_LARGER)
        stored = decimal.Decimal(-integer if negative else integer)
    elif coefficient < 10**15:
        _append_double_value(out, binary, _DCM_EQUAL_15)
        return
    else:
        from_binary = _rounded(decimal.Decimal(binary), 15, away)
        if from_binary == number:
            _append_double_value(out, binary, _DCM_EQUAL_15)
            return
        below = (number < from_binary) != negative
        _append_double_value(out, binary, _DCM_LESS if below else _DCM_LARGER)
        stored = _rounded(decimal.Decimal(binary), 34, away)
    _append_continuation(out, number, stored, negative)


_GENERIC_FROM_VALUE = -1
"""Generic type byte that depends on the value (Code with or without scope)."""

_TABLE: dict[type, tuple[_Encoder, int]] = {
    type(None): (_enc_none, NULLISH),
    bool: (_enc_bool, BOOL_FALSE),
    int: (_enc_int, NUMERIC),
    Int64: (_enc_int64, NUMERIC),
    float: (_enc_double, NUMERIC),
    Decimal128: (_enc_decimal, NUMERIC),
    str: (_enc_str, STRING_LIKE),
    ObjectId: (_enc_oid, OID),
    bytes: (_enc_bytes, BINDATA),
    Binary: (_enc_binary, BINDATA),
    uuid.UUID: (_enc_uuid, BINDATA),
    datetime.datetime: (_enc_datetime, DATE),
    DatetimeMS: (_enc_datetime_ms, DATE),
    Timestamp: (_enc_timestamp, TIMESTAMP),
    dict: (_enc_mapping, OBJECT),
    DBRef: (_enc_dbref, OBJECT),
    list: (_enc_array, ARRAY),
    tuple: (_enc_array, ARRAY),
    MinKey: (_enc_constant(MIN_KEY), MIN_KEY),
    MaxKey: (_enc_constant(MAX_KEY), MAX_KEY),
    _Undefined: (_enc_constant(UNDEFINED_TYPE), UNDEFINED_TYPE),
    Regex: (_enc_regex, REGEX),
    re.Pattern: (_enc_regex, REGEX),
    Code: (_enc_code, _GENERIC_FROM_VALUE),
}


def _resolve(kind: type, value: Any) -> tuple[_Encoder, int]:
    """The encoder for a type missing from ``_TABLE``: through the MRO (SON...), then cached."""
    for base in kind.__mro__[1:]:
        entry = _TABLE.get(base)
        if entry is not None:
            break
    else:
        if not isinstance(value, Mapping):
            raise TypeError(f"cannot encode an object of type {kind.__name__} in a KeyString")
        entry = _TABLE[dict]
    _TABLE[kind] = entry
    return entry


def append_value(out: bytearray, type_bits: TypeBits, value: Any) -> None:
    """Append one BSON value's KeyString bytes to ``out`` and its type bits to ``type_bits``."""
    (_TABLE.get(type(value)) or _resolve(type(value), value))[0](out, type_bits, value)


def encode_key(values: Iterable[Any]) -> tuple[bytes, bytes]:
    """KeyString of ``values`` (ascending) ending in kEnd, and the serialized TypeBits."""
    out = bytearray()
    type_bits = TypeBits()
    for value in values:
        append_value(out, type_bits, value)
    out.append(END)
    return bytes(out), type_bits.serialize()


# ---------------------------------------------------------------------------- decoding


def _wrap_int32(n: int) -> int:
    return ((n + 2**31) & 0xFFFFFFFF) - 2**31


def _double_from_bits(bits: int) -> float:
    value: float = _F64.unpack(_U64.pack(bits))[0]
    return value


class _Decoder:
    """``toBsonSafe`` for an ascending KeyString."""

    __slots__ = ("_bits", "_data", "_pos")

    def __init__(self, data: bytes, bits: TypeBitsReader) -> None:
        self._data = data
        self._pos = 0
        self._bits = bits

    def values(self) -> list[Any]:
        result = []
        while self._pos < len(self._data):
            ctype = self._byte()
            if ctype in (LESS, GREATER):
                ctype = self._byte()
            if ctype == END:
                break
            result.append(self._value(ctype, 1))
        return result

    def _take(self, size: int) -> bytes:
        _check_available(self._data, self._pos, size)
        start = self._pos
        self._pos += size
        return self._data[start : self._pos]

    def _byte(self) -> int:
        _check_available(self._data, self._pos, 1)
        self._pos += 1
        return self._data[self._pos - 1]

    def _u64(self, inverted: bool = False) -> int:
        value = int.from_bytes(self._take(8), "big")
        return value ^ _MASK64 if inverted else value

    def _cstring(self) -> bytes:
        end = self._data.find(b"\x00", self._pos)
        if end < 0:
            raise _format_error(50816, "Failed to find null terminator in string.")
        start, self._pos = self._pos, end + 1
        return self._data[start:end]

    def _cstring_with_nuls(self) -> bytes:
        parts = [self._cstring()]
        while self._pos < len(self._data) and self._data[self._pos] == 0xFF:
            self._pos += 1
            parts.append(self._cstring())
        return b"\x00".join(parts)

    def _text(self, raw: bytes) -> str:
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise CommandError(
                2, "resume token contains a string that is not valid UTF-8"
            ) from None

    def _value(self, ctype: int, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise CommandError(
                15,
                "KeyString format error: KeyString encoding exceeded maximum allowable BSON nesting depth",
                code_name="Overflow",
            )
        if NUMERIC <= ctype <= POSITIVE_LARGE:
            return self._number(ctype)
        simple = _SIMPLE_VALUES.get(ctype, _NO_VALUE)
        if simple is not _NO_VALUE:
            return simple
        if ctype == STRING_LIKE:
            self._bits.bit()  # String or Symbol: pymongo decodes both as str
            return self._text(self._cstring_with_nuls())
        if ctype == OBJECT:
            return self._fields(depth)
        if ctype == ARRAY:
            items = []
            while (item_type := self._byte()) != 0:
                items.append(self._value(item_type, depth + 1))
            return items
        if ctype == OID:
            return ObjectId(self._take(12))
        if ctype == BINDATA:
            return self._bindata()
        if ctype == DATE:
            millis = self._u64() ^ (1 << 63)
            return _datetime_from_millis(millis - (1 << 64) if millis >> 63 else millis)
        if ctype == TIMESTAMP:
            raw = self._u64()
            return Timestamp(raw >> 32, raw & 0xFFFFFFFF)
        if ctype == REGEX:
            pattern = self._text(self._cstring())
            return Regex(pattern, self._text(self._cstring()))
        if ctype == DBPOINTER:
            size = int.from_bytes(self._take(4), "big")
            namespace = self._text(self._take(size))
            return DBRef(namespace, ObjectId(self._take(12)))
        if ctype == CODE:
            return Code(self._text(self._cstring_with_nuls()))
        if ctype == CODE_W_SCOPE:
            code = self._text(self._cstring_with_nuls())
            return Code(code, self._fields(depth + 1))
        raise _format_error(50811, f"Unknown type: {ctype}")

    def _fields(self, depth: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        while self._byte() != 0:  # the generic type byte; the value repeats its full ctype
            name = self._text(self._cstring())
            result[name] = self._value(self._byte(), depth + 1)
        return result

    def _bindata(self) -> Any:
        size = self._byte()
        if size == 0xFF:
            size = int.from_bytes(self._take(4), "big")
        subtype = self._byte()
        data = self._take(size)
        if subtype == 0:
            return data
        if subtype == 4 and size == 16:
            return uuid.UUID(bytes=data)
        return Binary(data, subtype)

    def _number(self, ctype: int) -> Any:
        if ctype == NUMERIC:  # NaN
            kind = self._bits.numeric()
            if kind == _DECIMAL:
                return Decimal128("NaN")
            if kind != _DOUBLE:
                raise _format_error(50819, "Invalid type bits for numeric NaN")
            return math.nan
        if ctype == ZERO:
            return self._zero()
        if ctype in (NEGATIVE_LARGE, POSITIVE_LARGE):
            return self._large(ctype == NEGATIVE_LARGE)
        if ctype in (NEGATIVE_SMALL, POSITIVE_SMALL):
            return self._small(ctype == NEGATIVE_SMALL)
        return self._int_like(ctype)

    def _zero(self) -> Any:
        kind = self._bits.zero()
        if kind == _INT:
            return 0
        if kind == _LONG:
            return Int64(0)
        if kind == _DOUBLE:
            return 0.0
        if kind == _V1_NEGATIVE_DOUBLE_ZERO:
            return -0.0
        if kind < _DEC_ZERO_FIRST:
            raise _format_error(50846, "Invalid numeric zero decimal.")
        which = ((kind - _DEC_ZERO_FIRST) << 12) | self._bits.bits(12)
        negative = which > _DEC_MAX_BIASED
        biased = which - (_DEC_MAX_BIASED + 1) if negative else which
        if biased > _DEC_MAX_BIASED:
            raise _format_error(50846, "Invalid numeric zero decimal.")
        return Decimal128(decimal.Decimal((int(negative), (0,), biased - _DEC_BIAS)))

    def _decimal(self, magnitude: decimal.Decimal, negative: bool) -> Decimal128:
        """``adjustDecimalExponent``: the value at the one exponent of its cohort whose low
        bits match the stored exponent bits."""
        stored = self._bits.bits(_DEC_EXPONENT_BITS)
        if not magnitude:
            raise _format_error(50829, "Expected non-zero number for decimal.")
        lowest = _at_34_digits(magnitude)
        highest = min(
            int(_EXACT.normalize(magnitude).as_tuple().exponent), _DEC_MAX_BIASED - _DEC_BIAS
        )
        for exponent in range(lowest, highest + 1):
            if (exponent + _DEC_BIAS) & ((1 << _DEC_EXPONENT_BITS) - 1) == stored:
                coefficient = int(_EXACT.scaleb(magnitude, -exponent))
                digits = tuple(int(c) for c in str(coefficient))
                return Decimal128(decimal.Decimal((int(negative), digits, exponent)))
        raise _format_error(50845, "Unexpected inexact quantize.")

    def _continued(self, stored: decimal.Decimal, negative: bool) -> decimal.Decimal:
        """``readDecimalContinuation``: ``stored`` (a magnitude) plus the 8-byte continuation."""
        continuation = self._u64(negative)
        exponent = _at_34_digits(stored)
        try:
            return _EXACT.add(stored, _EXACT.scaleb(decimal.Decimal(continuation), exponent))
        except decimal.Inexact:
            raise _format_error(
                50815, "Unexpected inexact flag set after Decimal addition."
            ) from None

    def _large(self, negative: bool) -> Any:
        kind = self._bits.numeric()
        encoded = self._u64(negative)
        if kind == _DECIMAL:
            return self._large_decimal(encoded, negative)
        if encoded == _MASK64:
            value = math.inf
        elif encoded >> 63:
            raise _format_error(50818, "Invalid type bits for decimal number.")
        else:
            value = _double_from_bits((encoded >> 1) | (1 << 62))
        if negative:
            value = -value
        if kind == _DOUBLE:
            return value
        if kind == _LONG and value == float(_INT64_MIN):
            return Int64(_INT64_MIN)
        if kind == _LONG:
            raise _format_error(50821, "Unexpected value for large number.")
        raise _format_error(50826, "Unexpected type of large number.")

    def _large_decimal(self, encoded: int, negative: bool) -> Decimal128:
        if encoded == _MASK64:
            return Decimal128("-Infinity" if negative else "Infinity")
        if encoded >> 63:  # a huge decimal: its normalized BID bits
            high = encoded & (_MASK64 >> 1)
            low = self._u64(negative)
            coefficient = ((high & ((1 << 49) - 1)) << 64) | low
            if high >> 61 == 3 or coefficient >= 10**34:
                raise _format_error(50829, "Expected non-zero number for decimal.")
            exponent = (high >> 49) - _DEC_BIAS
            return self._decimal(_EXACT.scaleb(decimal.Decimal(coefficient), exponent), negative)
        binary = _double_from_bits((encoded >> 1) | (1 << 62))
        magnitude = _rounded(decimal.Decimal(binary), 34, decimal.ROUND_CEILING)
        if encoded & 1:
            magnitude = self._continued(magnitude, negative)
        return self._decimal(magnitude, negative)

    def _small(self, negative: bool) -> Any:
        kind = self._bits.numeric()
        encoded = self._u64(negative)
        prefix = encoded >> 62
        if prefix == 3:
            dcm = encoded & 3
            value = _double_from_bits(encoded >> 2)
            if kind == _DOUBLE:
                if dcm:
                    raise _format_error(50824, "Decimal contuation mismatch.")
                return -value if negative else value
            if kind != _DECIMAL:
                raise _format_error(50825, "Unexpected type for small number, expected decimal.")
            return self._decimal(self._from_double(value, dcm, negative), negative)
        if prefix == 0:  # a decimal smaller than any double, stored as its BID bits
            raise _decimal_unsupported("below 4.9E-324")
        continued = encoded & 1
        scaled = _double_from_bits((encoded - (1 << 62)) >> 1)
        if kind == _DOUBLE:
            if continued:
                raise _format_error(50822, "Unexpected decimal continuation.")
            value = scaled * _TINY_DOWN
            return -value if negative else value
        if kind != _DECIMAL or not continued:
            raise _format_error(50823, "Expected decimal continuation.")
        if scaled < _DBL_MIN * _TINY_UP:  # scaled in the decimal domain (a "tiny decimal")
            raise _decimal_unsupported("below 2.2250738585072014E-308")
        stored = _rounded(decimal.Decimal(scaled * _TINY_DOWN), 34, decimal.ROUND_CEILING)
        return self._decimal(self._continued(stored, negative), negative)

    def _from_double(self, binary: float, dcm: int, negative: bool) -> decimal.Decimal:
        """The decimal magnitude a double and its DCM stand for (reading a continuation)."""
        exact = decimal.Decimal(binary)
        if dcm == _DCM_EQUAL_15:
            return _rounded(exact, 15, decimal.ROUND_CEILING)
        stored = _rounded(exact, 34, decimal.ROUND_CEILING)
        return stored if dcm == _DCM_EQUAL else self._continued(stored, negative)

    def _int_like(self, ctype: int) -> Any:
        negative = ctype <= NEGATIVE_1_BYTE_INT
        size = NEGATIVE_1_BYTE_INT - ctype + 1 if negative else ctype - POSITIVE_1_BYTE_INT + 1
        kind = self._bits.numeric()
        encoded = int.from_bytes(self._take(size), "big")
        if negative:
            encoded ^= (1 << (size << 3)) - 1
        integer = encoded >> 1
        if not encoded & 1:
            if kind == _DECIMAL:
                return self._decimal(decimal.Decimal(integer), negative)
            if negative:
                integer = -integer
            if kind == _INT:
                return _wrap_int32(integer)
            if kind == _LONG:
                return Int64(integer)
            if kind == _DOUBLE:
                return float(integer)
            raise _format_error(50831, "Unexpected type for positive int.")
        frac_bytes = 8 - size
        fraction = int.from_bytes(self._take(frac_bytes), "big")
        if negative:
            fraction ^= (1 << (frac_bytes << 3)) - 1
        if kind not in (_DOUBLE, _DECIMAL):
            raise _format_error(50810, "Expected type Decimal.")
        encoded_fraction = (integer << (frac_bytes << 3)) | fraction
        value = float(encoded_fraction & ~3) / _POW256[frac_bytes]
        if kind == _DOUBLE:
            return -value if negative else value
        dcm = encoded_fraction & 3 if frac_bytes else _DCM_LARGER
        if dcm in (_DCM_LESS, _DCM_LARGER) and integer > _MAX_INT_FOR_DOUBLE:
            magnitude = self._continued(decimal.Decimal(integer), negative)
        else:
            magnitude = self._from_double(value, dcm, negative)
        return self._decimal(magnitude, negative)


_NO_VALUE = object()
_SIMPLE_VALUES: dict[int, Any] = {
    MIN_KEY: MinKey(),
    MAX_KEY: MaxKey(),
    NULLISH: None,
    UNDEFINED_TYPE: UNDEFINED,
    BOOL_FALSE: False,
    BOOL_TRUE: True,
}


def _datetime_from_millis(millis: int) -> datetime.datetime | DatetimeMS:
    """A naive UTC datetime like pymongo's default, or DatetimeMS when out of range."""
    try:
        return _EPOCH + datetime.timedelta(milliseconds=millis)
    except OverflowError:
        return DatetimeMS(millis)


def decode_key(key: bytes, type_bits: bytes | TypeBitsReader = b"") -> list[Any]:
    """Values of an ascending KeyString (up to kEnd), typed by ``type_bits``.

    Raises :class:`~changestream.testing.core.errors.CommandError` with mongod's
    codes for malformed input.
    """
    reader = type_bits if isinstance(type_bits, TypeBitsReader) else TypeBitsReader(type_bits)
    return _Decoder(key, reader).values()
