"""A raw event's merge row, read from its bytes, is the decoded event's row (document aside)."""

from __future__ import annotations

import datetime
import itertools
import random
import uuid
from typing import Any

import bson
import pytest
from bson import json_util
from bson.binary import Binary
from bson.code import Code
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp

from changestream._delta_rows import json_texts, staged_change
from changestream._merge import CANONICAL, RELAXED, merge_columns
from changestream._raw_rows import RAW_CODEC, raw_row
from changestream._snapshot import SNAPSHOT_MARK

KEYS: list[Any] = [ObjectId(), 7, Int64(2**40), "text key", {"k": [1, "x"]}, 2.5,
                   Decimal128("1.10"), uuid.UUID(int=5).bytes, datetime.datetime(2026, 1, 2)]
DOCUMENTS: list[Any] = [
    {"v": 1, "s": "\u00fcber", "when": datetime.datetime(2026, 12, 3, 1, 2, 3, 4000)},
    {"nan": float("nan"), "big": Int64(2**62), "d": Decimal128("3.14"), "b": Binary(b"\x00\x01")},
    {"min": MinKey(), "max": MaxKey(), "code": Code("f()"), "re": Regex("^a", "i")},
    {"nested": {"a": [{"b": None}, []]}, "ts": Timestamp(5, 6), "old": datetime.datetime(1960, 1, 1)},
]


def token(n: int) -> dict[str, Any]:
    return {"_data": f"82{n:016X}2B042C0100296E5A1004"}


def event(n: int, operation: str, key: Any, document: Any = ..., **extra: Any) -> dict[str, Any]:
    change: dict[str, Any] = {"_id": token(n), "operationType": operation,
                              "clusterTime": Timestamp(1_800_000_000, n),
                              "wallTime": datetime.datetime(2026, 12, 3),
                              "collectionUUID": Binary(uuid.UUID(int=n).bytes, 4)}
    if document is not ...:
        change["fullDocument"] = document
    change["ns"] = {"db": "shop", "coll": "orders"}
    change["documentKey"] = {"_id": key}
    if operation == "update":
        change["updateDescription"] = {"updatedFields": {"v": n}, "removedFields": [],
                                       "truncatedArrays": []}
    change.update(extra)
    return change


def events() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for n, key in enumerate(KEYS):
        document = {"_id": key, **DOCUMENTS[n % len(DOCUMENTS)]}
        found += [event(n, "insert", key, document), event(n, "replace", key, document),
                  event(n, "update", key, document), event(n, "update", key, None),
                  event(n, "update", key), event(n, "delete", key)]
    return found


def as_staged(row: Any, json_options: json_util.JSONOptions) -> Any:
    """``row`` with its BSON document made into the text the table stores."""
    return (*row[:5], json_texts([row[5]], json_options)[0], *row[6:])


@pytest.mark.parametrize("json_options", [RELAXED, CANONICAL], ids=["relaxed", "canonical"])
def test_each_document_change_gives_the_decoded_events_row(json_options: Any) -> None:
    namespaces: dict[bytes, Any] = {}
    for change in events():
        raw = bson.encode(change)
        row = raw_row(raw, json_options, namespaces)
        assert row is not None, change
        assert type(row[5]) in (bytes, type(None))  # not decoded until the batch collapses
        decoded = bson.decode(raw, RAW_CODEC)
        assert as_staged(row, json_options) == staged_change(decoded, json_options), change
        assert raw_row(memoryview(raw), json_options, namespaces) == row  # PyMongo's views
    assert list(namespaces.values()) == [("shop", "orders")]  # one ns, decoded once


def test_a_batch_of_raw_rows_collapses_to_what_decoded_events_give() -> None:
    """The merge's rows, in order, with only each key's last document ever decoded."""
    rng = random.Random(3)
    changes = [event(n, rng.choice(["insert", "update", "replace", "delete"]),
                     rng.choice(KEYS[:4]), {"_id": 0, "v": n}) for n in range(200)]
    for change in changes:
        if change["operationType"] == "delete":
            change.pop("fullDocument")
    raws = [bson.encode(change) for change in changes]
    namespaces: dict[bytes, Any] = {}
    from_raw = merge_columns([raw_row(raw, RELAXED, namespaces) for raw in raws],
                             full_document="updateLookup")
    decoded = merge_columns([staged_change(bson.decode(raw, RAW_CODEC), RELAXED) for raw in raws],
                            full_document="updateLookup")
    assert from_raw.keys == decoded.keys and from_raw.ops == decoded.ops
    assert len(from_raw.keys) == 4
    assert json_texts(from_raw.documents, RELAXED) == decoded.documents
    assert from_raw.last_token == decoded.last_token == token(199)


@pytest.mark.parametrize("change", [
    {"_id": token(1), "operationType": "drop", "ns": {"db": "shop", "coll": "orders"}},
    {"_id": token(1), "operationType": "createIndexes", "ns": {"db": "shop", "coll": "o"}},
    {"_id": {"_data": SNAPSHOT_MARK}, "operationType": "insert", "fullDocument": {"_id": 1},
     "ns": {"db": "shop", "coll": "orders"}, "documentKey": {"_id": 1}},
    {**event(1, "insert", 1, {"_id": 1}), "_id": {"_data": "82AA", "_typeBits": Binary(b"\x01")}},
    {**event(1, "insert", 1, {"_id": 1}), "_id": {"_data": 5}},
    {**event(1, "insert", 1, {"_id": 1}), "fullDocument": "not a document"},
    {**event(1, "insert", 1, {"_id": 1}), "documentKey": {"shard": 1}},
    {**event(1, "insert", 1, {"_id": 1}), "extra": Regex("x")},
    {"operationType": "insert", "_id": token(1)},
], ids=["drop", "ddl", "snapshot-record", "type-bits", "odd-token", "odd-document",
        "no-key-id", "unknown-type", "token-not-first"])
def test_anything_else_is_left_to_decoding(change: dict[str, Any]) -> None:
    """``None``: the caller decodes the event, so it is staged (or refused) exactly as before."""
    assert raw_row(bson.encode(change), RELAXED, {}) is None


def without(change: dict[str, Any], *names: str) -> dict[str, Any]:
    return {name: value for name, value in change.items() if name not in names}


def reordered(change: dict[str, Any], *names: str) -> dict[str, Any]:
    """``change`` with ``names`` moved to the end, in that order."""
    return {**without(change, *names), **{name: change[name] for name in names}}


@pytest.mark.parametrize("change", [
    without(event(1, "update", 1, {"_id": 1, "v": 2}), "wallTime"),  # servers before 6.0
    without(event(2, "insert", 2, {"_id": 2}), "wallTime", "collectionUUID"),
    reordered(event(3, "update", 3, {"_id": 3}), "operationType"),  # after the rest
    reordered(event(4, "replace", 4, {"_id": 4}), "clusterTime", "wallTime"),
    reordered(event(5, "update", 5, {"_id": 5}), "updateDescription", "fullDocument"),
    {**event(6, "update", 6, {"_id": 6}), "updateDescription": {"updatedFields": {
        "fullDocument": 1, "documentKey": {"_id": 0}}}},  # field names inside, not read
    {**event(7, "delete", 7), "_id": {"_data": "82" + "0" * 200}},  # a long token
], ids=["no-wall-time", "no-wall-time-no-uuid", "operation-last", "times-last",
        "document-last", "names-inside-update", "long-token"])
def test_heads_in_another_shape_give_the_decoded_events_row(change: dict[str, Any]) -> None:
    """The usual head is read in one match; any other shape of it, and any order of the
    fields after it, still gives the decoded event's row."""
    raw = bson.encode(change)
    row = raw_row(raw, RELAXED, {})
    assert row is not None
    assert as_staged(row, RELAXED) == staged_change(bson.decode(raw, RAW_CODEC), RELAXED)


def test_a_sharded_collections_document_key_keeps_its_id_as_the_key() -> None:
    key = ObjectId()
    change = event(1, "update", key, {"_id": key, "region": "eu"})
    change["documentKey"] = {"region": "eu", "_id": key}
    row = raw_row(bson.encode(change), RELAXED, {})
    assert row is not None and row[4] == json_util.dumps(key, separators=(",", ":"))


def test_a_header_at_the_very_end_gives_none() -> None:
    """A field's header with no room left for its size (a size read past the end)."""
    head = bson.encode({"_id": token(1)})[:-1]
    for tail in (b"\x03fullDocument\x00", b"\x02operationType\x00", b"\x03zz\x00"):
        body = head[4:] + tail + b"\x00"
        raw = (len(body) + 4).to_bytes(4, "little") + body
        assert raw_row(raw, RELAXED, {}) is None


def test_damaged_bytes_give_none_never_an_error() -> None:
    """Every truncation and every single-byte change of an event: ``None`` (left to
    decoding, which reports the damage), a row equal to the decoded one, or, where the
    damage lies in a part the row does not read, the undamaged event's row."""
    raw = bson.encode(event(1, "update", ObjectId(), {"_id": 1, "v": [1, 2]}))
    whole = raw_row(raw, RELAXED, {})
    for end in range(len(raw)):
        assert raw_row(raw[:end], RELAXED, {}) is None
    for at, flip in itertools.product(range(len(raw)), (0x5A, 0x80)):  # 0x80: a size's sign
        damaged = bytearray(raw)
        damaged[at] ^= flip
        row = raw_row(bytes(damaged), RELAXED, {})
        if row is None:
            continue
        try:
            decoded = bson.decode(bytes(damaged), RAW_CODEC)
        except bson.InvalidBSON:
            if row != whole:  # then the damage is in the document, refused as it is decoded
                with pytest.raises(bson.InvalidBSON):
                    json_texts([row[5]], RELAXED)
            continue
        assert as_staged(row, RELAXED) == staged_change(decoded, RELAXED), at
