"""Resume tokens and KeyStrings: server-notes §1 examples, round trips, ordering, errors."""

from __future__ import annotations

import datetime
import functools
import itertools
import math
import random
import re
import struct
import uuid
from fractions import Fraction
from typing import Any

import bson
import pytest
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
from bson.raw_bson import RawBSONDocument
from bson.regex import Regex
from bson.son import SON
from bson.timestamp import Timestamp

from changestream.testing.changestreams import keystring
from changestream.testing.changestreams.resume_token import (
    EVENT_TOKEN,
    HIGH_WATER_MARK_TOKEN,
    ResumeTokenData,
    compare_tokens,
    decode_token,
    encode_token,
    event_identifier,
    high_water_mark,
    is_high_water_mark,
)
from changestream.testing.core.errors import CommandError

UUID = uuid.UUID("a5093abb-38fe-4b9e-a67f-01bb1a96d812")
U = "5A1004A5093ABB38FE4B9EA67F01BB1A96D812"  # the uuid's KeyString
T = 1700000000
PREFIX_T = "826553F1000000000"  # Timestamp(T, i) is PREFIX_T + hex digit of i (i < 16)
OP_TYPE = "463C6F7065726174696F6E54797065003C"  # {operationType: "...
DOC_KEY = "0046646F63756D656E744B657900"  # ", documentKey: ...
_STANDARD: CodecOptions[Any] = CodecOptions(uuid_representation=bson.STANDARD)


def data(i: int, version: int = 2, **kwargs: Any) -> ResumeTokenData:
    return ResumeTokenData(Timestamp(T, i), version, **kwargs)


def crud(i: int, op: str, key: dict[str, Any], version: int = 2, **kwargs: Any) -> ResumeTokenData:
    kwargs.setdefault("uuid", UUID)
    return data(i, version, event_identifier=event_identifier(version, op, key, None), **kwargs)


def ddl(
    i: int, op: str, desc: dict[str, Any] | None, version: int = 2, **kwargs: Any
) -> ResumeTokenData:
    return data(i, version, event_identifier=event_identifier(version, op, None, desc), **kwargs)


# ------------------------------------------------------------------ §1.5 worked examples

WORKED_EXAMPLES: list[tuple[str, ResumeTokenData, str]] = [
    (
        "README v1 token (4.4/5.0 server)",
        ResumeTokenData(Timestamp(1630438675, 1), 1, uuid=UUID, event_identifier={"_id": "___x"}),
        "82612E8513000000012B022C0100296E5A1004A5093ABB38FE4B9EA67F01BB1A96D812"
        "463C5F6964003C5F5F5F78000004",
    ),
    (
        "v2 insert ObjectId",
        crud(3, "insert", {"_id": ObjectId("6553f1000000000000000001")}),
        "826553F100000000032B042C0100296E5A1004A5093ABB38FE4B9EA67F01BB1A96D812"
        "463C6F7065726174696F6E54797065003C696E736572740046646F63756D656E744B6579"
        "0046645F696400646553F1000000000000000001000004",
    ),
    (
        "v2 insert {_id: 1}",
        crud(3, "insert", {"_id": 1}),
        "826553F100000000032B042C0100296E5A1004A5093ABB38FE4B9EA67F01BB1A96D812"
        "463C6F7065726174696F6E54797065003C696E736572740046646F63756D656E744B6579"
        "00461E5F6964002B02000004",
    ),
    ("v2 HWM", high_water_mark(Timestamp(T, 4), 2), "826553F100000000042B0429296E1404"),
    ("v1 HWM", high_water_mark(Timestamp(T, 4), 1), "826553F100000000042B0229296E04"),
    (
        "v2 drop",
        ddl(5, "drop", None, uuid=UUID),
        PREFIX_T + "52B042C0100296E" + U + OP_TYPE + "64726F70000004",
    ),
    (
        "v2 invalidate after the drop",
        ddl(5, "drop", None, uuid=UUID, from_invalidate=True),
        PREFIX_T + "52B042C0100296F" + U + OP_TYPE + "64726F70000004",
    ),
    (
        "v2 dropDatabase",
        ddl(6, "dropDatabase", None),
        "826553F100000000062B042C0100296E14463C6F7065726174696F6E54797065003C"
        "64726F704461746162617365000004",
    ),
    (
        "v2 rename to test.b",
        ddl(7, "rename", {"to": {"db": "test", "coll": "b"}}, uuid=UUID),
        PREFIX_T
        + "72B042C0100296E"
        + U
        + OP_TYPE
        + "72656E616D6500466F7065726174696F6E4465736372697074696F6E004646746F00463C6462003C"
        "74657374003C636F6C6C003C620000000004",
    ),
    (
        "v2 transaction op #2, _id -5",
        crud(7, "insert", {"_id": -5}, txn_op_index=2),
        PREFIX_T
        + "72B042C01002B046E"
        + U
        + OP_TYPE
        + "696E7365727400"
        + DOC_KEY[2:]
        + "461E5F69640027F5000004",
    ),
    (
        "v2 split fragment 1 of an update of _id 300",
        crud(8, "update", {"_id": 300}, fragment_num=1),
        PREFIX_T
        + "82B042C0100296E"
        + U
        + OP_TYPE
        + "75706461746500"
        + DOC_KEY[2:]
        + "461E5F6964002C025800002B0204",
    ),
    (
        "v1 insert {_id: 1}",
        crud(3, "insert", {"_id": 1}, version=1),
        PREFIX_T + "32B022C0100296E" + U + "461E5F6964002B020004",
    ),
    (
        "v1 drop",
        ddl(5, "drop", None, version=1, uuid=UUID),
        PREFIX_T + "52B022C0100296E" + U + "04",
    ),
    ("v1 dropDatabase", ddl(6, "dropDatabase", None, version=1), PREFIX_T + "62B022C0100296E04"),
]


@pytest.mark.parametrize(
    ("token_data", "hex_data"),
    [example[1:] for example in WORKED_EXAMPLES],
    ids=[example[0] for example in WORKED_EXAMPLES],
)
def test_worked_examples_encode(token_data: ResumeTokenData, hex_data: str) -> None:
    assert encode_token(token_data) == {"_data": hex_data}


@pytest.mark.parametrize(
    ("token_data", "hex_data"),
    [example[1:] for example in WORKED_EXAMPLES],
    ids=[example[0] for example in WORKED_EXAMPLES],
)
def test_worked_examples_decode(token_data: ResumeTokenData, hex_data: str) -> None:
    assert decode_token({"_data": hex_data}) == token_data
    assert decode_token({"_data": hex_data.lower()}) == token_data


def test_v0_token_decodes() -> None:
    """4.0 layout: clusterTime, 0, txnOpIndex, uuid, documentKey."""
    hex_data = "826553F10000000003" + "29" + "2B02" + U + "461E5F6964002B020004"
    decoded = decode_token({"_data": hex_data})
    assert decoded == ResumeTokenData(Timestamp(T, 3), 0, EVENT_TOKEN, 1, False, UUID, {"_id": 1})
    assert encode_token(decoded) == {"_data": hex_data}


def test_encoded_key_order() -> None:
    token = encode_token(crud(3, "insert", {"_id": Int64(1)}))
    assert list(token) == ["_data", "_typeBits"]


# ------------------------------------------------------------------ §1.4 type bits


@pytest.mark.parametrize(
    ("key", "type_bits"),
    [
        ({"_id": Int64(1)}, b"\x82\x00\x01"),
        ({"_id": 2.0}, b"\x82\x80\x00"),
        ({"_id": 1}, None),
        ({"_id": "x"}, None),
        ({"_id": ObjectId("6553f1000000000000000001")}, None),
    ],
    ids=["Int64", "double", "int32", "string", "ObjectId"],
)
def test_v2_insert_type_bits(key: dict[str, Any], type_bits: bytes | None) -> None:
    token = encode_token(crud(3, "insert", key))
    assert (bytes(token["_typeBits"]) if "_typeBits" in token else None) == type_bits
    if type_bits is not None:
        assert isinstance(token["_typeBits"], Binary)
        assert token["_typeBits"].subtype == 0
    decoded = decode_token(token)
    assert type(decoded.event_identifier["documentKey"]["_id"]) is type(key["_id"])


def test_type_bits_short_form() -> None:
    """One data byte below 0x80 is sent as that byte alone."""
    # v0: version(2 bits) + txnOpIndex(2) then the Int64 _id's 0,1 -> bit 5 -> 0x20.
    token = encode_token(
        ResumeTokenData(Timestamp(T, 1), 0, uuid=UUID, event_identifier={"_id": Int64(7)})
    )
    assert bytes(token["_typeBits"]) == b"\x20"
    assert decode_token(token).event_identifier == {"_id": Int64(7)}


def test_type_bits_long_form() -> None:
    """More than 127 data bytes: 0x80, a little-endian int32 size, then the data."""
    key = {"_id": [1.5] * 600}  # 6 + 1 + 1200 bits -> 151 bytes
    token = encode_token(crud(3, "insert", key))
    raw = bytes(token["_typeBits"])
    assert raw[:5] == b"\x80" + (151).to_bytes(4, "little")
    assert len(raw) == 5 + 151
    assert decode_token(token).event_identifier["documentKey"] == key


def test_type_bits_accept_plain_bytes() -> None:
    """pymongo decodes BinData subtype 0 as bytes; that is what clients send back."""
    token = encode_token(crud(3, "insert", {"_id": Int64(5)}))
    as_received = {"_data": token["_data"], "_typeBits": bytes(token["_typeBits"])}
    assert decode_token(as_received).event_identifier["documentKey"]["_id"] == Int64(5)


@pytest.mark.parametrize(
    ("value", "bits"),
    [
        (0, [0, 0]),
        (Int64(0), [0, 1]),
        (0.0, [1, 0]),
        (-0.0, [1, 1, 0, 0, 0]),
        ("s", [0]),
        (5, [0, 0]),
        (Int64(5), [0, 1]),
        (5.5, [1, 0]),
        (True, []),
        (None, []),
        ({"a": 1.0, "b": [Int64(2), "x"]}, [1, 0, 0, 1, 0]),
    ],
    ids=repr,
)
def test_type_bits_per_value(value: Any, bits: list[int]) -> None:
    tb = keystring.TypeBits()
    keystring.append_value(bytearray(), tb, value)
    assert tb.count == len(bits)
    assert [(tb.value >> i) & 1 for i in range(tb.count)] == bits


# ------------------------------------------------------------------ KeyString values


@pytest.mark.parametrize(
    ("value", "hex_value"),
    [
        (1, "2B02"),
        (2, "2B04"),
        (128, "2C0100"),
        (300, "2C0258"),
        (-5, "27F5"),
        (0, "29"),
        (2.0, "2B04"),
        (1.5, "2B0380000000000000"),
        (-2.25, "27FABFFFFFFFFFFFFF"),
        (0.5, "2AFF80000000000000"),
        (1234.125, "2C09A5200000000000"),
        (None, "14"),
        (False, "6E"),
        (True, "6F"),
        (MinKey(), "0A"),
        (MaxKey(), "F0"),
        (keystring.UNDEFINED, "0F"),
        ("a\x00b", "3C6100FF6200"),
        (b"\x01\x02", "5A02000102"),
        (Binary(b"\xff", 5), "5A0105FF"),
        (Timestamp(1, 2), "820000000100000002"),
        (datetime.datetime(1970, 1, 1), "788000000000000000"),
        ([1, "a"], "502B023C610000"),
        ({}, "4600"),
    ],
    ids=repr,
)
def test_value_bytes(value: Any, hex_value: str) -> None:
    key, _ = keystring.encode_key([value])
    assert key.hex().upper() == hex_value + "04"


def test_long_bindata_length() -> None:
    key, _ = keystring.encode_key([b"x" * 300])
    assert key[:7] == bytes([0x5A, 0xFF]) + (300).to_bytes(4, "big") + b"\x00"
    assert keystring.decode_key(key) == [b"x" * 300]


ROUND_TRIP_VALUES: list[Any] = [
    MinKey(),
    MaxKey(),
    None,
    True,
    False,
    0,
    1,
    -1,
    2**31 - 1,
    -(2**31),
    2**31,  # becomes an int64, as pymongo encodes it
    Int64(0),
    Int64(-1),
    Int64(2**40),
    Int64(2**63 - 1),
    Int64(-(2**63)),
    0.0,
    -0.0,
    1.0,
    -1.0,
    1.5,
    -2.25,
    0.1,
    -0.1,
    1e-300,
    5e-324,
    2.0**-256,
    2.0**-255,
    1e300,
    -1e300,
    2.0**63,
    -(2.0**63),
    2.0**53 - 0.5,
    4503599627370495.5,
    123456789.0123,
    math.inf,
    -math.inf,
    "",
    "plain",
    "nul\x00inside\x00",
    "unicode é😀",
    ObjectId("6553f1000000000000000001"),
    b"",
    b"\x00" * 16,
    b"y" * 254,
    b"y" * 255,
    Binary(b"\x00" * 16, 3),
    Binary(b"abc", 4),
    Binary(b"abc", 0x80),
    UUID,
    datetime.datetime(2024, 2, 29, 12, 30, 45, 123000),
    datetime.datetime(1900, 1, 1),
    DatetimeMS(2**62),
    Timestamp(0, 0),
    Timestamp(2**32 - 1, 2**32 - 1),
    {"a": 1, "b": {"c": [1, "x", {"d": None}]}, "": 0},
    [],
    [[], [[]], {}],
    Regex("^a.*b$", "im"),
    Code("function () {}"),
    Code("x + y", {"y": 2}),
    DBRef("coll", 5, "db"),
]


def _binary_form(value: Any) -> bytes:
    return bson.encode({"v": value}, codec_options=_STANDARD)


@pytest.mark.parametrize("value", ROUND_TRIP_VALUES, ids=repr)
def test_value_round_trip(value: Any) -> None:
    key, type_bits = keystring.encode_key([value])
    (decoded,) = keystring.decode_key(key, type_bits)
    assert _binary_form(decoded) == _binary_form(value)


def test_undefined_and_nan_round_trip() -> None:
    key, type_bits = keystring.encode_key([keystring.UNDEFINED, math.nan])
    undefined, nan = keystring.decode_key(key, type_bits)
    assert undefined is keystring.UNDEFINED
    assert isinstance(nan, float) and math.isnan(nan)


def test_mapping_subclasses_encode_as_objects() -> None:
    son = SON([("b", 1), ("a", 2)])
    assert keystring.encode_key([son]) == keystring.encode_key([{"b": 1, "a": 2}])
    raw = RawBSONDocument(bson.encode({"b": 1, "a": 2}))
    assert keystring.encode_key([raw]) == keystring.encode_key([{"b": 1, "a": 2}])


def test_token_round_trip_with_many_types() -> None:
    key = {"_id": {f"f{i}": value for i, value in enumerate(ROUND_TRIP_VALUES)}}
    original = crud(9, "update", key)
    decoded = decode_token(encode_token(original))
    assert _binary_form(decoded.event_identifier) == _binary_form(original.event_identifier)


def _random_number(rng: random.Random) -> Any:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randint(-(2**31), 2**31 - 1)
    if kind == 1:
        return Int64(rng.randint(-(2**63), 2**63 - 1))
    if kind == 2:
        return rng.uniform(-1e6, 1e6)
    if kind == 3:
        return rng.choice([-1.0, 1.0]) * 2.0 ** rng.uniform(-1070, 1020)
    if kind == 4:
        return float(rng.randint(-(2**60), 2**60)) + rng.choice([0.0, 0.5, 0.25])
    return rng.choice([0, Int64(0), 0.0, -0.0, 1, -1, 2**53, -(2**53), math.inf, -math.inf])


def test_random_numbers_round_trip_and_sort_numerically() -> None:
    rng = random.Random(20240229)
    numbers = [_random_number(rng) for _ in range(3000)]
    encoded = []
    for number in numbers:
        key, type_bits = keystring.encode_key([number])
        (decoded,) = keystring.decode_key(key, type_bits)
        assert _binary_form(decoded) == _binary_form(number)  # same BSON type and value
        encoded.append(key)
    by_bytes = sorted(range(len(numbers)), key=lambda i: encoded[i])
    values = [float(numbers[i]) if isinstance(numbers[i], float) else numbers[i] for i in by_bytes]
    assert all(a <= b for a, b in itertools.pairwise(values))
    # equal numbers of different types encode to equal bytes
    assert keystring.encode_key([1])[0] == keystring.encode_key([Int64(1)])[0]
    assert keystring.encode_key([1])[0] == keystring.encode_key([1.0])[0]


def test_bson_type_order_is_preserved() -> None:
    """MinKey < null < numbers < strings < objects < arrays < BinData < ObjectId < bool < date < ts < MaxKey."""
    ordered = [
        MinKey(),
        None,
        -math.inf,
        -1,
        0,
        0.5,
        1,
        math.inf,
        "",
        "a",
        "a\x00",
        "ab",
        "b",
        {},
        {"a": 1},
        {"a": 2},
        {"a": 2, "b": 0},
        {"b": 0},  # fields compare by BSON type first, then name, then value
        {"a": "x"},
        [],
        [1],
        [1, 1],
        [2],
        b"",
        b"\xff",
        b"\x00\x00",
        ObjectId("000000000000000000000000"),
        ObjectId("ffffffffffffffffffffffff"),
        False,
        True,
        datetime.datetime(1960, 1, 1),
        datetime.datetime(2020, 1, 1),
        Timestamp(1, 2),
        Timestamp(2, 1),
        MaxKey(),
    ]
    keys = [keystring.encode_key([value])[0] for value in ordered]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)


# ------------------------------------------------------------------ NumberDecimal


def test_decimals_share_the_key_bytes_of_equal_numbers() -> None:
    """A decimal equal to a double or an integer encodes like it; only TypeBits differ:
    ``1, 1`` (kDecimal) then the biased exponent's 6 low bits, most significant first."""
    assert keystring.encode_key([Decimal128("1")]) == (bytes.fromhex("2B0204"), b"\x07")
    assert keystring.encode_key([Decimal128("1.0")])[0] == keystring.encode_key([1])[0]
    assert keystring.encode_key([Decimal128("1.5")])[0] == keystring.encode_key([1.5])[0]
    # 6176 - 1 = 6175 = 0b...011111: bits 1,1 then 0,1,1,1,1,1 -> 0xFB with a size byte
    assert keystring.encode_key([Decimal128("1.5")])[1] == b"\x81\xfb"
    # 0.1 is no double: the double below it, then DCM 2 ("the double rounded up to 15 digits")
    key = keystring.encode_key([Decimal128("0.1")])[0]
    below = math.nextafter(0.1, 0.0)
    assert key[1:9] == ((struct.unpack("<Q", struct.pack("<d", below))[0] << 2) | 2).to_bytes(
        8, "big"
    )
    zero_key, zero_bits = keystring.encode_key([Decimal128("-0E+3")])
    assert zero_key == bytes.fromhex("2904") and keystring.decode_key(zero_key, zero_bits) == [
        Decimal128("-0E+3")
    ]


DECIMAL_SAMPLES = [
    "1", "1.0", "1.50", "-1.5", "0.1", "19.99", "-19.99", "0", "-0", "0E+3", "-0.000", "100",
    "1E+2", "Infinity", "-Infinity", "123456789012345678", "9007199254740993",
    "9007199254740993.5", "-9007199254740993.25", "1E+400", "-1.2345E+500", "1E+30",
    "1.234567890123456789012345678901234", "-3.141592653589793238462643383279502",
    "1E-300", "1.5E-250", "1E-307", "12345678901234567890123.5", "1.00000000000000000001",
    "9.999999999999999999999999999999999E+6144",
]  # fmt: skip


@pytest.mark.parametrize("text", DECIMAL_SAMPLES)
def test_decimals_round_trip_with_their_exponent(text: str) -> None:
    value = Decimal128(text)
    token = encode_token(crud(3, "insert", {"_id": value}))
    decoded = decode_token(token).event_identifier["documentKey"]["_id"]
    assert decoded.bid == value.bid  # same value and same exponent (1.50 stays 1.50)


def test_decimal_keys_sort_with_doubles_and_integers() -> None:
    rng = random.Random(11)
    values: list[Any] = []
    for _ in range(1500):
        digits = rng.randint(1, 34)
        exponent = rng.choice(
            [rng.randint(-40, 40), rng.randint(-300, 300), rng.randint(300, 6111)]
        )
        text = f"{'-' if rng.random() < 0.4 else ''}{rng.randint(1, 10**digits - 1)}E{exponent}"
        values.append(Decimal128(text))
        values.append(rng.uniform(-1e6, 1e6))
        values.append(Int64(rng.randint(-(2**62), 2**62)))
    values += [Decimal128("0.1"), 0.1, Decimal128("1"), 1.0, 1, Decimal128("-0"), 0]

    def exact(value: Any) -> Fraction:
        return Fraction(value.to_decimal() if isinstance(value, Decimal128) else value)

    keyed = sorted(
        ((exact(v), keystring.encode_key([v])[0], v) for v in values), key=lambda t: t[0]
    )
    for (a, key_a, va), (b, key_b, vb) in itertools.pairwise(keyed):
        assert (key_a == key_b) if a == b else (key_a < key_b), (va, vb)
    for value in values:
        if isinstance(value, Decimal128):
            key, bits = keystring.encode_key([value])
            assert keystring.decode_key(key, bits)[0].bid == value.bid


def test_decimals_below_the_double_range_fail_clearly() -> None:
    with pytest.raises(CommandError) as info:
        encode_token(crud(3, "insert", {"_id": Decimal128("1E-320")}))
    assert (info.value.code, info.value.code_name) == (238, "NotImplemented")
    assert "NumberDecimal 1E-320 in a resume token" in info.value.errmsg


def test_unsupported_python_type() -> None:
    with pytest.raises(TypeError, match="cannot encode"):
        keystring.encode_key([object()])


# ------------------------------------------------------------------ ordering


def _ordering_tokens(version: int) -> list[ResumeTokenData]:
    other = uuid.UUID("00000000-0000-4000-8000-000000000000")
    tokens = [
        high_water_mark(Timestamp(T, 1), version),
        crud(1, "insert", {"_id": 1}, version),
        crud(1, "insert", {"_id": 2}, version),
        crud(1, "insert", {"_id": "a"}, version),
        crud(1, "insert", {"_id": ObjectId("6553f1000000000000000001")}, version),
        crud(1, "insert", {"_id": 1}, version, uuid=other),
        crud(1, "insert", {"_id": 1}, version, txn_op_index=1),
        crud(1, "insert", {"_id": 0}, version, txn_op_index=2),
        crud(1, "delete", {"_id": 0}, version, txn_op_index=2),
        ddl(1, "drop", None, version, uuid=UUID),
        ddl(1, "drop", None, version, uuid=UUID, from_invalidate=True),
        ddl(1, "dropDatabase", None, version),
        high_water_mark(Timestamp(T, 2), version),
        crud(2, "insert", {"_id": 1}, version),
        high_water_mark(Timestamp(T + 1, 0), version),
    ]
    if version >= 2:
        tokens += [
            crud(1, "update", {"_id": 9}, version, fragment_num=0),
            crud(1, "update", {"_id": 9}, version, fragment_num=1),
            crud(1, "update", {"_id": 9}, version, fragment_num=12),
            crud(1, "update", {"_id": 9}, version),
            ddl(1, "create", {"idIndex": {"v": 2, "key": {"_id": 1}, "name": "_id_"}}, uuid=UUID),
        ]
    return tokens


def _sign(n: int) -> int:
    return (n > 0) - (n < 0)


@pytest.mark.parametrize("version", [1, 2])
def test_data_string_order_matches_compare_tokens(version: int) -> None:
    tokens = _ordering_tokens(version)
    hex_data = [encode_token(token)["_data"] for token in tokens]
    for a, ha in zip(tokens, hex_data, strict=True):
        for b, hb in zip(tokens, hex_data, strict=True):
            assert compare_tokens(a, b) == _sign((ha > hb) - (ha < hb)), (a, b)
    by_data = [tokens[i] for i in sorted(range(len(tokens)), key=lambda i: hex_data[i])]
    assert sorted(tokens, key=functools.cmp_to_key(compare_tokens)) == by_data


@pytest.mark.parametrize("version", [1, 2])
def test_high_water_mark_sorts_before_events_at_same_time(version: int) -> None:
    hwm = high_water_mark(Timestamp(T, 5), version)
    event = crud(5, "insert", {"_id": MinKey()}, version)
    earlier = crud(4, "insert", {"_id": MaxKey()}, version)
    assert compare_tokens(hwm, event) == -1
    assert compare_tokens(earlier, hwm) == -1
    assert compare_tokens(hwm, hwm) == 0
    assert encode_token(hwm)["_data"] < encode_token(event)["_data"]
    assert is_high_water_mark(hwm)
    assert is_high_water_mark(decode_token(encode_token(hwm)))
    assert not is_high_water_mark(event)
    assert hwm.token_type == HIGH_WATER_MARK_TOKEN


def test_compare_ignores_type_differences_like_bson() -> None:
    assert compare_tokens(crud(1, "insert", {"_id": 1}), crud(1, "insert", {"_id": 1.0})) == 0
    assert compare_tokens(crud(1, "insert", {"_id": 1}), crud(1, "insert", {"_id": 1.5})) == -1


# ------------------------------------------------------------------ event identifiers


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((1, "insert", {"_id": 1}, None), {"_id": 1}),
        ((0, "delete", {"_id": 1}, None), {"_id": 1}),
        ((1, "drop", None, None), None),
        ((1, "rename", None, {"to": {"db": "d", "coll": "c"}}), None),
        ((1, "invalidate", None, None), None),
        ((2, "insert", {"_id": 1}, None), {"operationType": "insert", "documentKey": {"_id": 1}}),
        ((2, "drop", None, None), {"operationType": "drop"}),
        (
            (2, "rename", None, {"to": {"db": "d", "coll": "c"}}),
            {"operationType": "rename", "operationDescription": {"to": {"db": "d", "coll": "c"}}},
        ),
        (
            (1, "createIndexes", None, {"indexes": []}),
            {"operationType": "createIndexes", "operationDescription": {"indexes": []}},
        ),
    ],
    ids=repr,
)
def test_event_identifier(args: tuple[Any, ...], expected: Any) -> None:
    result = event_identifier(*args)
    assert result == expected
    if isinstance(expected, dict):
        assert list(result) == list(expected)


def test_event_identifier_rejects_both_key_and_description() -> None:
    with pytest.raises(ValueError, match="not both"):
        event_identifier(2, "insert", {"_id": 1}, {"x": 1})


# ------------------------------------------------------------------ errors


def ks(*values: Any) -> dict[str, Any]:
    """A token over arbitrary values (to build malformed tokens)."""
    key, type_bits = keystring.encode_key(values)
    token: dict[str, Any] = {"_data": key.hex().upper()}
    if type_bits:
        token["_typeBits"] = Binary(type_bits, 0)
    return token


TS = Timestamp(T, 1)
GOOD_V2_PREFIX = (TS, 2, EVENT_TOKEN, 0, False)

DECODE_ERRORS: list[tuple[str, dict[str, Any], int]] = [
    ("_data missing", {}, 40647),
    ("_data not a string", {"_data": 12}, 40647),
    ("3.6 BinData _data", {"_data": Binary(b"\x82", 0)}, 40647),
    ("_typeBits a string", {"_data": "00", "_typeBits": "00"}, 40648),
    ("_typeBits null", {"_data": "00", "_typeBits": None}, 40648),
    ("_typeBits wrong subtype", {"_data": "00", "_typeBits": Binary(b"\x01", 5)}, 40648),
    ("not hex", {"_data": "XYZW"}, 9),
    ("odd length", {"_data": "ABC"}, 9),
    ("empty", {"_data": ""}, 40649),
    ("only the end byte", {"_data": "04"}, 40649),
    ("no version", ks(TS), 50796),
    ("version a string", ks(TS, "2"), 50854),
    ("version an Int64", ks(TS, Int64(2)), 50854),
    ("version 3", ks(TS, 3), 50795),
    ("version -1", ks(TS, -1), 50795),
    ("no tokenType", ks(TS, 1), 51055),
    ("tokenType a double", ks(TS, 1, 128.0), 51056),
    ("tokenType 5", ks(TS, 1, 5), 51057),
    ("v0 without txnOpIndex", ks(TS, 0), 50793),
    ("v1 without txnOpIndex", ks(TS, 1, 128), 50793),
    ("txnOpIndex a string", ks(TS, 2, 128, "0"), 50855),
    ("txnOpIndex an Int64", ks(TS, 2, 128, Int64(0)), 50855),
    ("txnOpIndex negative", ks(TS, 2, 128, -1), 50794),
    ("no fromInvalidate", ks(TS, 2, 128, 0), 50872),
    ("fromInvalidate an int", ks(TS, 2, 128, 0, 0), 50870),
    ("v2 without uuid", ks(*GOOD_V2_PREFIX), 6189500),
    ("uuid an int", ks(*GOOD_V2_PREFIX, 5, {"operationType": "drop"}), 207),
    ("uuid legacy subtype 3", ks(*GOOD_V2_PREFIX, Binary(UUID.bytes, 3)), 207),
    ("uuid 4 bytes", ks(*GOOD_V2_PREFIX, Binary(b"abcd", 4)), 207),
    ("v2 event without eventIdentifier", ks(*GOOD_V2_PREFIX, UUID), 6189501),
    ("v2 HWM with eventIdentifier", ks(TS, 2, 0, 0, False, None, {"_id": 1}), 6189504),
    ("eventIdentifier a string", ks(*GOOD_V2_PREFIX, UUID, "x"), 6189503),
    ("v1 documentKey an array", ks(TS, 1, 128, 0, False, UUID, [1]), 6189503),
    ("fragmentNum negative", ks(*GOOD_V2_PREFIX, UUID, {"x": 1}, -1), 7182501),
    ("fragmentNum a string", ks(*GOOD_V2_PREFIX, UUID, {"x": 1}, "1"), 7182501),
    ("trailing value after fragmentNum", ks(*GOOD_V2_PREFIX, UUID, {"x": 1}, 1, 2), 40646),
    ("v1 trailing value", ks(TS, 1, 128, 0, False, UUID, {"_id": 1}, 1), 40646),
    ("unknown KeyString type", {"_data": "8200000001000000012B0405"}, 50811),
    ("truncated timestamp", {"_data": "820000000100"}, 15),
    ("unterminated string", {"_data": "820000000100000001" + "3C41"}, 50816),
    ("string not UTF-8", {"_data": "820000000100000001" + "3CC30004"}, 2),
    ("nested deeper than BSON allows", {"_data": "82" + "00" * 8 + "50" * 201 + "00" * 201}, 15),
    (
        "typeBits shorter than the values need",
        # one byte: version, tokenType, txnOpIndex int32, "a" a double; no bits left for "b"
        {"_data": ks(*GOOD_V2_PREFIX, UUID, {"a": 1, "b": 2})["_data"], "_typeBits": b"\x40"},
        50615,
    ),
    ("typeBits size beyond buffer", {"_data": "00", "_typeBits": b"\x85\x00"}, 15),
    (
        "typeBits overlong size",
        {"_data": "00", "_typeBits": b"\x80\x05\x00\x00\x00" + bytes(5)},
        50910,
    ),
    # a decimal zero's 5-bit prefix, then too few bits for its 12 exponent bits
    ("decimal zero cut short", {"_data": "82000000010000000129", "_typeBits": b"\x1f"}, 50615),
]


@pytest.mark.parametrize(
    ("token", "code"),
    [case[1:] for case in DECODE_ERRORS],
    ids=[case[0] for case in DECODE_ERRORS],
)
def test_decode_errors(token: dict[str, Any], code: int) -> None:
    with pytest.raises(CommandError) as info:
        decode_token(token)
    assert info.value.code == code


def test_decode_error_messages() -> None:
    with pytest.raises(CommandError, match=r"^Bad resume token: _data of missing or of wrong type"):
        decode_token({"_data": 1})
    with pytest.raises(CommandError, match=r"^resume token string was not a valid hex string$"):
        decode_token({"_data": "GG"})
    with pytest.raises(
        CommandError, match=r"^Invalid Resume Token: only supports version 0, 1 and 2$"
    ):
        decode_token(ks(TS, 7))
    with pytest.raises(CommandError, match=r"^Token type 5 not recognized$"):
        decode_token(ks(TS, 1, 5))
    with pytest.raises(CommandError) as info:
        decode_token({"_data": "8200000001000000012B0405"})
    assert info.value.errmsg == "KeyString format error: Unknown type: 5"
    assert info.value.code_name == "Location50811"


def test_type_bits_are_checked_before_hex() -> None:
    """mongod reads _typeBits before validating the hex string."""
    with pytest.raises(CommandError) as info:
        decode_token({"_data": "not hex", "_typeBits": b"\x85"})
    assert info.value.code == 15


ENCODE_ERRORS: list[tuple[str, ResumeTokenData, int]] = [
    ("HWM with txnOpIndex", data(1, token_type=HIGH_WATER_MARK_TOKEN, txn_op_index=1), 6189505),
    (
        "HWM with fromInvalidate",
        data(1, token_type=HIGH_WATER_MARK_TOKEN, from_invalidate=True),
        6189505,
    ),
    ("HWM with uuid", data(1, token_type=HIGH_WATER_MARK_TOKEN, uuid=UUID), 6189505),
    (
        "HWM with eventIdentifier",
        data(1, token_type=HIGH_WATER_MARK_TOKEN, event_identifier={}),
        6189505,
    ),
    ("v1 eventIdentifier without uuid", data(1, 1, event_identifier={"_id": 1}), 50788),
    ("v2 event without eventIdentifier", data(1, 2, uuid=UUID), 6189502),
    ("v1 fragmentNum", data(1, 1, uuid=UUID, event_identifier={"_id": 1}, fragment_num=0), 7182504),
]


@pytest.mark.parametrize(
    ("token_data", "code"),
    [case[1:] for case in ENCODE_ERRORS],
    ids=[case[0] for case in ENCODE_ERRORS],
)
def test_encode_errors(token_data: ResumeTokenData, code: int) -> None:
    with pytest.raises(CommandError) as info:
        encode_token(token_data)
    assert info.value.code == code


def test_large_txn_op_index_is_an_int64_and_rejected_on_decode() -> None:
    """appendNumber(long long) makes txnOpIndex >= 2^30 a NumberLong, which getData rejects."""
    token = encode_token(crud(1, "insert", {"_id": 1}, txn_op_index=2**30))
    assert "_typeBits" in token
    with pytest.raises(CommandError) as info:
        decode_token(token)
    assert info.value.code == 50855


def test_field_names_with_nul_are_rejected() -> None:
    with pytest.raises(ValueError, match="NUL"):
        keystring.encode_key([{"a\x00b": 1}])


def test_regex_flags_round_trip() -> None:
    pattern = re.compile("ab+", re.IGNORECASE | re.MULTILINE)
    key, type_bits = keystring.encode_key([pattern])
    (decoded,) = keystring.decode_key(key, type_bits)
    assert isinstance(decoded, Regex)
    assert decoded.pattern == "ab+"
    assert decoded.flags == re.IGNORECASE | re.MULTILINE | re.UNICODE
