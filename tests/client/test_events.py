"""Typed change events: every operationType, forward compatibility, losslessness, immutability."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any

import bson
import pytest
from bson.binary import Binary, UuidRepresentation
from bson.codec_options import CodecOptions, DatetimeConversion
from bson.datetime_ms import DatetimeMS
from bson.int64 import Int64
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp

from changestream.events import (
    ChangeEvent,
    CreateEvent,
    CreateIndexesEvent,
    DeleteEvent,
    DropDatabaseEvent,
    DropEvent,
    DropIndexesEvent,
    InsertEvent,
    InvalidateEvent,
    ModifyEvent,
    Namespace,
    OperationType,
    RefineCollectionShardKeyEvent,
    RenameEvent,
    ReplaceEvent,
    ReshardCollectionEvent,
    ShardCollectionEvent,
    SplitEvent,
    TruncatedArray,
    UnknownEvent,
    UpdateDescription,
    UpdateEvent,
    event_namespace,
    parse_event,
)

TS = Timestamp(1_700_000_000, 3)
WALL = datetime(2024, 5, 1, 12, 0, 0)
COLL_UUID = Binary(uuid.UUID("a1b2c3d4-e5f6-0718-293a-4b5c6d7e8f90").bytes, 4)
DROPPED_UUID = Binary(uuid.UUID("0f0e0d0c-0b0a-0908-0706-050403020100").bytes, 4)
NS = {"db": "shop", "coll": "orders"}


def token(n: int = 1) -> dict[str, Any]:
    return {"_data": f"8265F1A2B3{n:08X}2B042C0100296E5A1004A1B2C3D4E5F6071829"}


def event(op: str, *, n: int = 1, expanded: bool = False, **fields: Any) -> dict[str, Any]:
    """A document in the server's field order (server-notes §2.1)."""
    doc: dict[str, Any] = {"_id": token(n), "operationType": op, "clusterTime": TS}
    if expanded:
        doc["collectionUUID"] = COLL_UUID
    doc["wallTime"] = WALL
    doc.update(fields)
    return doc


def parsed(doc: Mapping[str, Any]) -> ChangeEvent:
    ev = parse_event(doc)
    assert isinstance(ev, ChangeEvent), ev
    return ev


# --------------------------------------------------------------------------- every type

ID_INDEX = {"v": 2, "key": {"_id": 1}, "name": "_id_"}
CASES: list[tuple[dict[str, Any], type[ChangeEvent], dict[str, Any]]] = [
    (
        event("insert", fullDocument={"_id": 1, "a": 1}, ns=NS, documentKey={"_id": 1}),
        InsertEvent,
        {"full_document": {"_id": 1, "a": 1}, "document_key": {"_id": 1}},
    ),
    (
        event(
            "update",
            fullDocument={"_id": 1, "a": 2},
            ns=NS,
            documentKey={"_id": 1},
            updateDescription={
                "updatedFields": {"a": 2},
                "removedFields": [],
                "truncatedArrays": [],
            },
            fullDocumentBeforeChange={"_id": 1, "a": 1},
        ),
        UpdateEvent,
        {
            "full_document": {"_id": 1, "a": 2},
            "full_document_before_change": {"_id": 1, "a": 1},
            "update_description": UpdateDescription(
                updated_fields={"a": 2}, removed_fields=(), truncated_arrays=()
            ),
        },
    ),
    (
        event(
            "replace",
            fullDocument={"_id": 1, "b": 1},
            ns=NS,
            documentKey={"_id": 1},
            fullDocumentBeforeChange=None,  # whenAvailable without a pre-image
        ),
        ReplaceEvent,
        {"full_document": {"_id": 1, "b": 1}, "full_document_before_change": None},
    ),
    (
        event("delete", ns=NS, documentKey={"_id": 1}, fullDocumentBeforeChange={"_id": 1}),
        DeleteEvent,
        {"document_key": {"_id": 1}, "full_document_before_change": {"_id": 1}},
    ),
    (event("drop", ns=NS), DropEvent, {}),
    (
        {
            "to": {"db": "shop", "coll": "archive"},
            **event(
                "rename",
                expanded=True,
                ns=NS,
                operationDescription={
                    "to": {"db": "shop", "coll": "archive"},
                    "dropTarget": DROPPED_UUID,
                },
            ),
        },
        RenameEvent,
        {
            "to": Namespace(db="shop", coll="archive"),
            "collection_uuid": COLL_UUID,
            "operation_description": {
                "to": {"db": "shop", "coll": "archive"},
                "dropTarget": DROPPED_UUID,
            },
        },
    ),
    (event("dropDatabase", ns={"db": "shop"}), DropDatabaseEvent, {"ns": Namespace(db="shop")}),
    (event("invalidate"), InvalidateEvent, {"ns": None}),
    (
        event(
            "create",
            expanded=True,
            ns=NS,
            operationDescription={"idIndex": ID_INDEX},
            nsType="collection",
        ),
        CreateEvent,
        {"operation_description": {"idIndex": ID_INDEX}, "ns_type": "collection"},
    ),
    (
        event(
            "createIndexes",
            expanded=True,
            ns=NS,
            operationDescription={"indexes": [{"v": 2, "key": {"x": 1}, "name": "x_1"}]},
        ),
        CreateIndexesEvent,
        {"operation_description": {"indexes": [{"v": 2, "key": {"x": 1}, "name": "x_1"}]}},
    ),
    (
        event(
            "dropIndexes",
            expanded=True,
            ns=NS,
            operationDescription={"indexes": [{"v": 2, "key": {"x": 1}, "name": "x_1"}]},
        ),
        DropIndexesEvent,
        {"operation_description": {"indexes": [{"v": 2, "key": {"x": 1}, "name": "x_1"}]}},
    ),
    (
        event(
            "modify",
            expanded=True,
            ns=NS,
            operationDescription={"index": {"name": "x_1", "hidden": True}},
            stateBeforeChange={
                "collectionOptions": {"uuid": COLL_UUID},
                "indexOptions": {"hidden": False},
            },
        ),
        ModifyEvent,
        {
            "operation_description": {"index": {"name": "x_1", "hidden": True}},
            "state_before_change": {
                "collectionOptions": {"uuid": COLL_UUID},
                "indexOptions": {"hidden": False},
            },
        },
    ),
    (
        event(
            "shardCollection",
            expanded=True,
            ns=NS,
            operationDescription={"shardKey": {"sk": 1}, "unique": False},
        ),
        ShardCollectionEvent,
        {"operation_description": {"shardKey": {"sk": 1}, "unique": False}},
    ),
    (
        event(
            "reshardCollection",
            expanded=True,
            ns=NS,
            operationDescription={"reshardUUID": DROPPED_UUID, "shardKey": {"sk2": 1}},
        ),
        ReshardCollectionEvent,
        {"operation_description": {"reshardUUID": DROPPED_UUID, "shardKey": {"sk2": 1}}},
    ),
    (
        event(
            "refineCollectionShardKey",
            expanded=True,
            ns=NS,
            operationDescription={"shardKey": {"sk": 1, "t": 1}, "oldShardKey": {"sk": 1}},
        ),
        RefineCollectionShardKeyEvent,
        {"operation_description": {"shardKey": {"sk": 1, "t": 1}, "oldShardKey": {"sk": 1}}},
    ),
]


@pytest.mark.parametrize(("doc", "cls", "expected"), CASES, ids=[c[1].__name__ for c in CASES])
def test_each_operation_type_parses_to_its_class(
    doc: dict[str, Any], cls: type[ChangeEvent], expected: dict[str, Any]
) -> None:
    ev = parsed(doc)
    assert type(ev) is cls
    assert ev.operation_type == doc["operationType"]
    assert ev.operation_type is OperationType(doc["operationType"])
    assert ev.resume_token is doc["_id"]
    assert ev.cluster_time == TS
    assert ev.wall_time == WALL
    assert ev.extra == {}, "every field of a well-formed event is modelled"
    assert ev.raw is doc
    assert ev.ns == expected.get("ns", Namespace(db="shop", coll="orders"))
    for attr, value in expected.items():
        assert getattr(ev, attr) == value, attr


def test_every_known_operation_type_has_a_case() -> None:
    assert {c[1] for c in CASES} == {type(parsed(c[0])) for c in CASES}
    assert {c[0]["operationType"] for c in CASES} == {op.value for op in OperationType}


def test_update_description_from_spec_shapes() -> None:
    ev = parsed(
        event(
            "update",
            ns=NS,
            documentKey={"_id": 1},
            updateDescription={
                "updatedFields": {"a.0.1": "x", "array.1": 2},
                "removedFields": ["gone", "also.gone"],
                "truncatedArrays": [{"field": "array", "newSize": 2}],
                "disambiguatedPaths": {"a.0.1": ["a", 0, "1"]},
            },
        )
    )
    assert isinstance(ev, UpdateEvent)
    ud = ev.update_description
    assert ud == UpdateDescription(
        updated_fields={"a.0.1": "x", "array.1": 2},
        removed_fields=("gone", "also.gone"),
        truncated_arrays=(TruncatedArray(field="array", new_size=2),),
        disambiguated_paths={"a.0.1": ["a", 0, "1"]},
    )
    assert ev.full_document is None and ev.full_document_before_change is None


def test_update_description_of_a_4x_server_has_no_truncated_arrays() -> None:
    ev = parsed(
        event(
            "update",
            ns=NS,
            documentKey={"_id": 1},
            updateDescription={"updatedFields": {"a": 1}, "removedFields": []},
        )
    )
    assert isinstance(ev, UpdateEvent) and ev.update_description is not None
    assert ev.update_description.truncated_arrays is None
    assert ev.update_description.disambiguated_paths is None
    assert ev.update_description.extra == {}


def test_transaction_fields_lead_the_document() -> None:
    lsid = {"id": Binary(uuid.uuid4().bytes, 4), "uid": Binary(b"\x01" * 32, 0)}
    doc = {"txnNumber": Int64(7), "lsid": lsid, **event("insert", ns=NS, documentKey={"_id": 1})}
    ev = parsed(doc)
    assert ev.txn_number == 7 and isinstance(ev.txn_number, int)
    assert ev.lsid is lsid
    assert ev.extra == {}


def test_collection_uuid_decoded_as_uuid_or_binary() -> None:
    doc = event("drop", expanded=True, ns=NS)
    as_binary = parsed(bson.decode(bson.encode(doc)))
    standard: CodecOptions[Mapping[str, Any]] = CodecOptions(
        uuid_representation=UuidRepresentation.STANDARD
    )
    as_uuid = parsed(bson.decode(bson.encode(doc), codec_options=standard))
    assert as_binary.collection_uuid == COLL_UUID
    assert as_uuid.collection_uuid == uuid.UUID(bytes=COLL_UUID)
    assert as_binary.extra == {} and as_uuid.extra == {}


def test_wall_time_follows_the_codec() -> None:
    encoded = bson.encode(event("drop", ns=NS))
    aware: CodecOptions[Mapping[str, Any]] = CodecOptions(tz_aware=True)
    ev = parsed(bson.decode(encoded, codec_options=aware))
    assert ev.wall_time == WALL.replace(tzinfo=timezone.utc)
    as_ms: CodecOptions[Mapping[str, Any]] = CodecOptions(
        datetime_conversion=DatetimeConversion.DATETIME_MS
    )
    ev_ms = parsed(bson.decode(encoded, codec_options=as_ms))
    assert ev_ms.wall_time == DatetimeMS(WALL) and ev_ms.extra == {}


def test_split_event_fragments() -> None:
    first = event("update", ns=NS, documentKey={"_id": 1}, splitEvent={"fragment": 1, "of": 2})
    ev = parsed(first)
    assert ev.split_event == SplitEvent(fragment=1, of=2)
    assert ev.extra == {}
    # Later fragments carry only the big fields: no operationType, so they stay raw.
    second = {"_id": token(2), "splitEvent": {"fragment": 2, "of": 2}, "fullDocument": {"x": 1}}
    assert parse_event(second) is second


# --------------------------------------------------------------------------- forward compatibility


def test_unknown_operation_type_keeps_raw_string_and_fields() -> None:
    doc = event("futureOp", expanded=True, ns=NS, documentKey={"_id": 1}, newThing=[1, 2])
    ev = parsed(doc)
    assert type(ev) is UnknownEvent
    assert ev.operation_type == "futureOp" and type(ev.operation_type) is str
    assert ev.ns == Namespace(db="shop", coll="orders")
    assert ev.collection_uuid == COLL_UUID
    assert ev.extra == {"documentKey": {"_id": 1}, "newThing": [1, 2]}


def test_extra_fields_are_kept_read_only() -> None:
    doc = event(
        "insert",
        ns=NS,
        documentKey={"_id": 1},
        fullDocument={"_id": 1},
        futureField=TS,  # a field this version does not model
        updateDescription={"updatedFields": {}},  # modelled elsewhere, not on inserts
    )
    ev = parsed(doc)
    assert dict(ev.extra) == {"futureField": TS, "updateDescription": {"updatedFields": {}}}
    assert ev.extra["updateDescription"] is doc["updateDescription"]
    with pytest.raises(TypeError):
        ev.extra["x"] = 1  # type: ignore[index]


def test_missing_fields_are_none() -> None:
    ev = parsed({"_id": token(), "operationType": "update"})
    assert isinstance(ev, UpdateEvent)
    assert (ev.cluster_time, ev.wall_time, ev.ns, ev.document_key) == (None, None, None, None)
    assert ev.update_description is None and ev.full_document is None
    assert (ev.txn_number, ev.lsid, ev.collection_uuid, ev.split_event) == (None,) * 4
    assert ev.extra == {}
    no_token = parsed({"operationType": "insert"})
    assert no_token.resume_token is None


def test_null_full_document_is_none_not_extra() -> None:
    doc = event("update", ns=NS, documentKey={"_id": 1}, fullDocument=None)
    ev = parsed(doc)
    assert isinstance(ev, UpdateEvent) and ev.full_document is None
    assert ev.extra == {}


@pytest.mark.parametrize(
    ("key", "value", "attr"),
    [
        ("ns", "shop.orders", "ns"),  # $project turned ns into a string
        ("ns", {"coll": "orders"}, "ns"),  # no db
        ("ns", {"db": 5, "coll": "x"}, "ns"),
        ("_id", "not-a-token", "resume_token"),
        ("clusterTime", 12, "cluster_time"),
        ("wallTime", "2024-05-01", "wall_time"),
        ("txnNumber", True, "txn_number"),
        ("lsid", [1], "lsid"),
        ("collectionUUID", "uuid", "collection_uuid"),
        ("commitTimestamp", 12, "commit_timestamp"),
        ("splitEvent", {"fragment": "1", "of": 2}, "split_event"),
        ("splitEvent", 3, "split_event"),
        ("documentKey", 1, "document_key"),
        ("fullDocument", "doc", "full_document"),
        ("updateDescription", [], "update_description"),
        ("fullDocumentBeforeChange", 0, "full_document_before_change"),
    ],
)
def test_wrong_typed_field_goes_to_extra(key: str, value: Any, attr: str) -> None:
    doc = event("update", ns=NS, documentKey={"_id": 1})
    doc[key] = value
    ev = parsed(doc)
    assert getattr(ev, attr) is None
    assert ev.extra == {key: value}
    assert ev.raw[key] is value


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("to", ["shop", "x"]),
        ("operationDescription", "renamed"),
        ("nsType", 3),
        ("stateBeforeChange", 1.5),
    ],
)
def test_wrong_typed_ddl_field_goes_to_extra(key: str, value: Any) -> None:
    op = {"to": "rename", "nsType": "create", "stateBeforeChange": "modify"}.get(key, "create")
    ev = parsed(event(op, ns=NS, **{key: value}))
    assert ev.extra == {key: value}


def test_wrong_typed_update_description_parts_stay_in_its_extra() -> None:
    ud_doc = {
        "updatedFields": "x",
        "removedFields": ["ok", 3],
        "truncatedArrays": [{"field": "a"}],
        "disambiguatedPaths": 1,
        "future": True,
    }
    ev = parsed(event("update", ns=NS, documentKey={"_id": 1}, updateDescription=ud_doc))
    assert isinstance(ev, UpdateEvent) and ev.update_description is not None
    ud = ev.update_description
    assert (ud.updated_fields, ud.removed_fields) == ({}, ())
    assert (ud.truncated_arrays, ud.disambiguated_paths) == (None, None)
    assert ud.extra == ud_doc
    assert ev.extra == {}


def test_reshaped_namespaces_never_fail() -> None:
    # Shapes from the spec's "ns" projection tests.
    with_extra = parsed(event("insert", ns={"db": "d", "coll": "c", "viewOn": "db.coll"}))
    assert with_extra.ns == Namespace(db="d", coll="c", extra={"viewOn": "db.coll"})
    only_extra = parsed(event("insert", ns={"viewOn": "db.coll"}))
    assert only_extra.ns is None and only_extra.extra == {"ns": {"viewOn": "db.coll"}}
    odd_coll = parsed(event("insert", ns={"db": "d", "coll": 7}))
    assert odd_coll.ns == Namespace(db="d", coll=None, extra={"coll": 7})
    # The namespace cache must not mix plain and reshaped namespaces, in either order.
    plain = parsed(event("insert", ns={"db": "d", "coll": "c"}))
    assert plain.ns == Namespace(db="d", coll="c") and plain.ns.extra == {}
    again = parsed(event("insert", ns={"db": "d", "coll": "c", "viewOn": "db.coll"}))
    assert again.ns is not None and again.ns.extra == {"viewOn": "db.coll"}


@pytest.mark.parametrize(
    "doc",
    [
        {"optype": "insert", "ns": NS, "newField": "value"},  # $project renamed operationType
        {"_id": token(), "ns": NS},
        {"_id": token(), "operationType": 1},
        {"_id": token(), "operationType": None},
        {"_id": token(), "operationType": {"$literal": "insert"}},
        {},
    ],
)
def test_projected_shapes_come_back_as_the_same_object(doc: dict[str, Any]) -> None:
    assert parse_event(doc) is doc
    raw = RawBSONDocument(bson.encode(doc))
    assert parse_event(raw) is raw


def test_projection_keeping_a_future_operation_type() -> None:
    doc = {"_id": token(), "operationType": "addedInFutureMongoDBVersion", "ns": NS}
    ev = parsed(doc)
    assert isinstance(ev, UnknownEvent)
    assert ev.operation_type == "addedInFutureMongoDBVersion"
    assert event_namespace(ev) == "shop.orders"


# --------------------------------------------------------------------------- mapping types


def test_raw_bson_input_keeps_raw_sub_documents_and_token_bytes() -> None:
    doc = event(
        "update",
        ns=NS,
        documentKey={"_id": 1},
        updateDescription={"updatedFields": {"a": {"b": 1}}, "removedFields": ["c"]},
        fullDocument={"_id": 1, "a": {"b": 1}},
    )
    raw = RawBSONDocument(bson.encode(doc))
    ev = parsed(raw)
    assert isinstance(ev, UpdateEvent)
    assert ev.raw is raw
    assert isinstance(ev.resume_token, RawBSONDocument)
    assert isinstance(ev.full_document, RawBSONDocument)
    assert isinstance(ev.document_key, RawBSONDocument)
    assert ev.update_description is not None
    assert isinstance(ev.update_description.updated_fields, RawBSONDocument)
    assert ev.update_description.removed_fields == ("c",)
    assert ev.ns == Namespace(db="shop", coll="orders")
    # The token is still usable as a token: byte-identical when sent back.
    assert bson.encode(ev.resume_token) == bson.encode(doc["_id"]) == raw["_id"].raw
    command = bson.decode(bson.encode({"resumeAfter": ev.resume_token}))
    assert command["resumeAfter"] == doc["_id"]


def test_son_and_user_mappings() -> None:
    son = SON(event("insert", ns=SON(NS), fullDocument=SON([("_id", 1)])))
    ev = parsed(son)
    assert ev.raw is son and isinstance(ev, InsertEvent)
    assert isinstance(ev.full_document, SON)

    class Frozen(Mapping[str, Any]):
        def __init__(self, data: dict[str, Any]) -> None:
            self._data = data

        def __getitem__(self, key: str) -> Any:
            return self._data[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    user = Frozen(event("delete", ns=Frozen(NS), documentKey=OrderedDict(_id=1), extraKey=1))
    ev2 = parsed(user)
    assert isinstance(ev2, DeleteEvent) and ev2.raw is user
    assert ev2.ns == Namespace(db="shop", coll="orders")
    assert ev2.document_key == {"_id": 1} and ev2.extra == {"extraKey": 1}


def test_parse_event_returns_non_mappings_unchanged() -> None:
    for value in (None, [1, 2], "insert", 5):
        result: object = parse_event(value)  # type: ignore[arg-type]
        assert result is value


# --------------------------------------------------------------------------- value semantics


def test_events_are_immutable() -> None:
    ev = parsed(CASES[1][0])
    assert isinstance(ev, UpdateEvent) and ev.update_description is not None and ev.ns
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.full_document = {}  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del ev.resume_token
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.ns.db = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev.update_description.removed_fields = ()  # type: ignore[misc]
    # Python 3.11's frozen+slots dataclasses raise TypeError here (CPython gh-90562), 3.12+ AttributeError.
    with pytest.raises((AttributeError, TypeError)):
        ev.not_a_field = 1  # type: ignore[attr-defined]
    assert not isinstance(ev, Mapping)
    with pytest.raises(TypeError):
        ev["operationType"]  # type: ignore[index]


def test_parsed_events_are_ordinary_instances() -> None:
    doc = event("insert", ns=NS, documentKey={"_id": 1}, fullDocument={"_id": 1}, other=1)
    ev = parsed(doc)
    assert type(ev) is InsertEvent and type(ev.ns) is Namespace
    built = InsertEvent(
        resume_token=token(),
        operation_type=OperationType.INSERT,
        cluster_time=TS,
        wall_time=WALL,
        ns=Namespace(db="shop", coll="orders"),
        document_key={"_id": 1},
        full_document={"_id": 1},
        extra={"other": 1},
    )
    assert built == ev, "raw is not compared; everything else is"
    assert pickle.loads(pickle.dumps(ev)) == ev
    assert copy.deepcopy(ev) == ev
    assert dataclasses.replace(ev, full_document={"_id": 2}).full_document == {"_id": 2}
    assert dataclasses.asdict(ev)["ns"] == {"db": "shop", "coll": "orders", "extra": {}}
    assert "raw=" not in repr(ev) and "full_document={'_id': 1}" in repr(ev)


def test_operation_type_enum() -> None:
    assert OperationType("dropDatabase") is OperationType.DROP_DATABASE
    assert {"dropDatabase": 1}[OperationType.DROP_DATABASE] == 1  # hashes and compares as str
    assert f"{OperationType.CREATE_INDEXES}" == str(OperationType.CREATE_INDEXES) == "createIndexes"
    assert isinstance(OperationType.INSERT, str)


def test_event_namespace() -> None:
    assert event_namespace(parsed(event("drop", ns=NS))) == "shop.orders"
    assert event_namespace(parsed(event("dropDatabase", ns={"db": "shop"}))) == "shop"
    assert event_namespace(parsed(event("invalidate"))) is None


def describe(ev: ChangeEvent) -> str:
    match ev:
        case InsertEvent(full_document={"_id": doc_id}):
            return f"inserted {doc_id}"
        case UpdateEvent(update_description=UpdateDescription(updated_fields=f, removed_fields=())):
            return f"set {sorted(f)}"
        case UpdateEvent(UpdateDescription(removed_fields=removed)):
            return f"unset {list(removed)}"
        case RenameEvent(Namespace(db, coll), to=Namespace(coll=new)):
            return f"renamed {db}.{coll} to {new}"
        case DropDatabaseEvent(Namespace(db, None)):
            return f"dropped database {db}"
        case UnknownEvent("futureOp"):
            return "future"
        case ChangeEvent(operation_type=OperationType.INVALIDATE):
            return "invalidated"
        case _:
            return "other"


def test_pattern_matching() -> None:
    upd = {"updatedFields": {"b": 1, "a": 2}, "removedFields": []}
    unset = {"updatedFields": {}, "removedFields": ["x"]}
    docs = [
        event("insert", ns=NS, fullDocument={"_id": 42}),
        event("update", ns=NS, updateDescription=upd),
        event("update", ns=NS, updateDescription=unset),
        {"to": {"db": "shop", "coll": "old"}, **event("rename", ns=NS)},
        event("dropDatabase", ns={"db": "shop"}),
        event("futureOp"),
        event("invalidate"),
        event("drop", ns=NS),
    ]
    assert [describe(parsed(d)) for d in docs] == [
        "inserted 42",
        "set ['a', 'b']",
        "unset ['x']",
        "renamed shop.orders to old",
        "dropped database shop",
        "future",
        "invalidated",
        "other",
    ]


# --------------------------------------------------------------------------- never raises

# hypothesis is not installed in this venv; a seeded generator covers the same ground.
KEYS = [
    "_id", "operationType", "clusterTime", "wallTime", "ns", "to", "documentKey",
    "updateDescription", "fullDocument", "fullDocumentBeforeChange", "txnNumber", "lsid",
    "collectionUUID", "splitEvent", "operationDescription", "stateBeforeChange", "nsType",
    "commitTimestamp", "updatedFields", "removedFields", "truncatedArrays", "disambiguatedPaths", "db", "coll",
    "field", "newSize", "fragment", "of", "x",
]  # fmt: skip
OPS = [op.value for op in OperationType] + ["futureOp", ""]


def random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(12 if depth < 3 else 9)
    scalars: list[Any] = [
        None, True, rng.randint(-5, 5), Int64(rng.randint(0, 9)), 1.5, rng.choice(OPS),
        TS, WALL, COLL_UUID,
    ]  # fmt: skip
    if kind < len(scalars):
        return scalars[kind]
    if kind == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return random_doc(rng, depth + 1)


def random_doc(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    doc = {rng.choice(KEYS): random_value(rng, depth) for _ in range(rng.randrange(8))}
    if depth == 0 and rng.random() < 0.8:
        doc["operationType"] = rng.choice(OPS)
    return doc


def check_lossless(doc: Mapping[Any, Any], result: object) -> None:
    """Every entry of ``doc`` is either in ``extra`` (same object) or kept by a modelled field."""
    if not isinstance(result, ChangeEvent):
        assert result is doc
        return
    assert result.raw is doc
    modelled = {f.name for f in dataclasses.fields(result)}
    for key, value in doc.items():
        if key in result.extra:
            assert result.extra[key] is value
            continue
        attr = FIELD_KEYS.get(key)
        assert attr in modelled, (key, type(result).__name__)
        if value is not None:  # null counts as absent
            assert getattr(result, attr) is not None, (key, value)


FIELD_KEYS = {
    "_id": "resume_token", "clusterTime": "cluster_time", "wallTime": "wall_time", "ns": "ns",
    "txnNumber": "txn_number", "lsid": "lsid", "collectionUUID": "collection_uuid",
    "splitEvent": "split_event", "documentKey": "document_key",
    "updateDescription": "update_description", "fullDocument": "full_document",
    "fullDocumentBeforeChange": "full_document_before_change", "to": "to",
    "operationDescription": "operation_description", "stateBeforeChange": "state_before_change",
    "nsType": "ns_type", "operationType": "operation_type", "commitTimestamp": "commit_timestamp",
}  # fmt: skip


def test_random_documents_never_raise_and_lose_nothing() -> None:
    rng = random.Random(20240501)
    for _ in range(3000):
        doc = random_doc(rng)
        check_lossless(doc, parse_event(doc))
        raw = RawBSONDocument(bson.encode(doc))
        check_lossless(raw, parse_event(raw))


HOSTILE: list[Any] = [
    {"operationType": "update", "updateDescription": {"truncatedArrays": [None, 1]}},
    {"operationType": "update", "updateDescription": {"truncatedArrays": "x"}},
    {"operationType": "update", "updateDescription": {"removedFields": "abc"}},
    {"operationType": "insert", "ns": {"db": ["unhashable"], "coll": {"x": 1}}},
    {"operationType": "insert", "ns": {"db": "d", "coll": "c", "db2": None}},
    {"operationType": "insert", "ns": {}},
    {"operationType": "insert", "ns": None, "_id": None},
    {"operationType": "rename", "to": {"db": None}},
    {"operationType": "insert", "splitEvent": {"fragment": True, "of": 1}},
    {"operationType": "insert", 1: "non-string key", None: None},
    {"operationType": "__class__", "extra": 1, "raw": 2},
    {"operationType": "x" * 10_000},
]


@pytest.mark.parametrize("doc", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_shapes(doc: dict[Any, Any]) -> None:
    result = parse_event(doc)
    assert isinstance(result, ChangeEvent)
    check_lossless(doc, result)


# --------------------------------------------------------------------------- 8.3 / 9.0 / 9.1 fields


def test_commit_timestamp_is_a_timestamp_on_any_event() -> None:
    """``commitTimestamp`` (CRUD events of a prepared transaction, 8.2+) is typed, not extra."""
    for raw in (False, True):
        doc = event("insert", ns=NS, documentKey={"_id": 1}, fullDocument={"_id": 1},
                    commitTimestamp=TS, txnNumber=Int64(3))
        ev = parse_event(RawBSONDocument(bson.encode(doc)) if raw else doc)
        assert isinstance(ev, InsertEvent)
        assert ev.commit_timestamp == TS and isinstance(ev.commit_timestamp, Timestamp)
        assert "commitTimestamp" not in ev.extra
    assert parsed(event("insert", ns=NS)).commit_timestamp is None


def test_expanded_fields_of_new_servers_are_typed() -> None:
    """``nsType`` on create, ``collectionUUID``, rename's ``operationDescription`` and
    ``disambiguatedPaths`` (showExpandedEvents on 8.3/9.0/9.1) all land in fields."""
    create = parsed(event("create", ns=NS, collectionUUID=COLL_UUID, nsType="timeseries",
                          operationDescription={"idIndex": ID_INDEX}))
    assert isinstance(create, CreateEvent)
    assert (create.ns_type, create.collection_uuid) == ("timeseries", COLL_UUID)
    assert create.extra == {}
    rename = parsed(event("rename", ns=NS, to={"db": "shop", "coll": "x"},
                          collectionUUID=COLL_UUID,
                          operationDescription={"to": {"db": "shop", "coll": "x"}}))
    assert isinstance(rename, RenameEvent)
    assert rename.operation_description == {"to": {"db": "shop", "coll": "x"}}
    update = parsed(event("update", ns=NS, documentKey={"_id": 1}, collectionUUID=COLL_UUID,
                          updateDescription={"updatedFields": {"a.0": 1}, "removedFields": [],
                                             "truncatedArrays": [],
                                             "disambiguatedPaths": {"a.0": ["a", "0"]}}))
    assert isinstance(update, UpdateEvent) and update.update_description is not None
    assert update.update_description.disambiguated_paths == {"a.0": ["a", "0"]}
    assert update.extra == {}


def test_an_error_event_is_an_unknown_event_with_its_document_and_token() -> None:
    """``operationType: "error"`` (reported for 9.1, not in mongod's source): nothing invented."""
    token = {"_data": "82AB"}
    doc = {"_id": token, "operationType": "error", "clusterTime": TS,
           "error": {"code": 10334, "errmsg": "BSONObjectTooLarge"}}
    for source in (doc, RawBSONDocument(bson.encode(doc))):
        ev = parse_event(source)
        assert type(ev) is UnknownEvent
        assert ev.operation_type == "error"
        assert ev.resume_token is not None and dict(ev.resume_token) == token
        assert ev.raw is source
        assert list(ev.extra) == ["error"]
        assert dict(ev.extra["error"]) == {"code": 10334, "errmsg": "BSONObjectTooLarge"}
