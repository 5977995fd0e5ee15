"""The storage engine: BSON value semantics, collections, and the CRUD commands' oplog entries."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from changestream.testing.commands import REGISTRY, CommandContext, ConnectionInfo
from changestream.testing.core.errors import CommandError
from changestream.testing.core.oplog import OplogEntry
from changestream.testing.core.versions import get_profile
from changestream.testing.storage import (
    DuplicateKey,
    bson_repr,
    compare_values,
    id_key,
    sort_key,
    values_identical,
)
from changestream.testing.storage.deployment import Deployment


@pytest.fixture
def dep() -> Deployment:
    return Deployment(get_profile("8.0"))


def run(dep: Deployment, db: str, body: dict[str, Any]) -> dict[str, Any]:
    """Call a command handler the way the dispatcher does."""
    ctx = CommandContext(
        deployment=dep,
        member=dep.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db=db,
        name=next(iter(body)),
        body=body,
    )
    return REGISTRY[ctx.name].handler(ctx)


def new_entries(dep: Deployment, since: int) -> list[OplogEntry]:
    return dep.oplog.read(since)


# -- BSON value semantics ---------------------------------------------------------------


def test_id_key_collides_exactly_for_bson_equal_values() -> None:
    assert id_key(1) == id_key(1.0) == id_key(Int64(1)) == id_key(Decimal128("1"))
    assert id_key(True) != id_key(1)
    assert id_key("1") != id_key(1)
    assert id_key({"a": 1, "b": 2}) == id_key({"a": 1.0, "b": Int64(2)})
    assert id_key({"a": 1, "b": 2}) != id_key({"b": 2, "a": 1})  # field order matters
    assert id_key(float("nan")) == id_key(Decimal128("NaN"))
    assert id_key(None) != id_key(0)


def test_compare_values_follows_bson_type_order() -> None:
    ordered = [MinKey(), None, -1, 2.5, Int64(3), "a", "b", {"a": 1}, [1], b"x", ObjectId(),
               False, True, Timestamp(1, 1), MaxKey()]  # fmt: skip
    assert sorted(reversed(ordered), key=sort_key) == ordered
    assert compare_values(1, 1.0) == 0
    assert compare_values(float("nan"), -1e308) < 0
    assert compare_values({"a": 1}, {"a": 1, "b": 0}) < 0


def test_values_identical_is_binary_equality() -> None:
    assert values_identical({"a": [1, "x"]}, {"a": [1, "x"]})
    assert not values_identical(1, 1.0)
    assert not values_identical(1, Int64(1))
    assert not values_identical({"a": 1, "b": 2}, {"b": 2, "a": 1})


def test_bson_repr_matches_mongod_messages() -> None:
    assert bson_repr({"_id": 1, "s": "x", "l": [1, 2.5], "e": {}}) == (
        '{ _id: 1, s: "x", l: [ 1, 2.5 ], e: {} }'
    )
    oid = ObjectId("65d62aceb4e93c2aa6ab6ea5")
    assert bson_repr(oid) == "ObjectId('65d62aceb4e93c2aa6ab6ea5')"


# -- collections ----------------------------------------------------------------------------


def test_collection_keeps_natural_order_and_hands_out_copies(dep: Deployment) -> None:
    run(dep, "db", {"insert": "c", "documents": [{"_id": 3}, {"_id": 1}, {"_id": 2, "a": [1]}]})
    state = dep.catalog.get("db", "c")
    assert state is not None
    assert [d["_id"] for d in state.documents()] == [3, 1, 2]
    copy = state.find_by_id(2.0)
    assert copy == {"_id": 2, "a": [1]}
    copy["a"].append(99)
    assert state.find_by_id(2) == {"_id": 2, "a": [1]}
    assert state.find_by_id(42) is None
    assert dep.catalog.database_names() == ["db"]
    assert dep.catalog.collection_names("db") == ["c"]
    assert state.indexes == [{"v": 2, "key": {"_id": 1}, "name": "_id_"}]
    assert not state.is_view and not state.pre_post_images


def test_update_keeps_the_document_position(dep: Deployment) -> None:
    run(dep, "db", {"insert": "c", "documents": [{"_id": 1}, {"_id": 2}]})
    run(dep, "db", {"update": "c", "updates": [{"q": {"_id": 1}, "u": {"x": 1}}]})
    state = dep.catalog.get("db", "c")
    assert state is not None
    assert list(state.documents()) == [{"_id": 1, "x": 1}, {"_id": 2}]


def test_unique_index_is_enforced_and_rolled_back_on_update(dep: Deployment) -> None:
    run(dep, "db", {"insert": "c", "documents": [{"_id": 1, "u": 1}, {"_id": 2, "u": 2}]})
    run(
        dep,
        "db",
        {"createIndexes": "c", "indexes": [{"key": {"u": 1}, "name": "u_1", "unique": True}]},
    )
    state = dep.catalog.get("db", "c")
    assert state is not None
    with pytest.raises(DuplicateKey) as info:
        state.insert({"_id": 3, "u": 1.0})
    assert info.value.key_value == {"u": 1.0}
    reply = run(dep, "db", {"update": "c", "updates": [{"q": {"_id": 2}, "u": {"$set": {"u": 1}}}]})
    assert reply["writeErrors"][0]["code"] == 11000
    assert reply["writeErrors"][0]["keyPattern"] == {"u": 1}
    assert state.find_by_id(2) == {"_id": 2, "u": 2}
    state.insert({"_id": 3, "u": 3})  # the failed update left the index consistent


# -- insert ---------------------------------------------------------------------------------------


def test_first_insert_logs_the_implicit_create_first(dep: Deployment) -> None:
    since = dep.oplog.end_seq
    reply = run(dep, "db", {"insert": "c", "documents": [{"a": 1, "_id": 7}, {"b": 2}]})
    assert reply["n"] == 2
    assert reply["electionId"] == ObjectId("7fffffff0000000000000001")
    entries = new_entries(dep, since)
    state = dep.catalog.get("db", "c")
    assert state is not None
    assert [(e.op, e.ns) for e in entries] == [("c", "db.$cmd"), ("i", "db.c"), ("i", "db.c")]
    assert entries[0].o == {"create": "c", "idIndex": {"v": 2, "key": {"_id": 1}, "name": "_id_"}}
    assert all(e.ui == state.uuid for e in entries)
    assert entries[1].o == {"_id": 7, "a": 1}  # _id moved first
    assert list(entries[1].o) == ["_id", "a"]
    assert entries[1].o2 == {"_id": 7}
    generated = entries[2].o["_id"]
    assert isinstance(generated, ObjectId) and list(entries[2].o) == ["_id", "b"]
    assert reply["opTime"] == {"ts": entries[2].ts, "t": 1}


def test_ordered_insert_stops_at_the_first_error_unordered_continues(dep: Deployment) -> None:
    docs = [{"_id": 1}, {"_id": 1.0}, {"_id": Int64(2)}]
    ordered = run(dep, "db", {"insert": "a", "documents": docs})
    assert ordered["n"] == 1
    assert ordered["writeErrors"] == [
        {
            "index": 1,
            "code": 11000,
            "keyPattern": {"_id": 1},
            "keyValue": {"_id": 1.0},
            "errmsg": "E11000 duplicate key error collection: db.a index: _id_ dup key: { _id: 1.0 }",
        }
    ]
    unordered = run(dep, "db", {"insert": "b", "documents": docs, "ordered": False})
    assert unordered["n"] == 2
    assert [e["index"] for e in unordered["writeErrors"]] == [1]


def test_insert_rejections(dep: Deployment) -> None:
    reply = run(dep, "db", {"insert": "c", "documents": [{"_id": [1]}, {"$bad": 1}]})
    assert reply["writeErrors"][0]["errmsg"] == "can't use an array for _id"
    with pytest.raises(CommandError) as info:
        run(dep, "db", {"insert": "system.foo", "documents": [{}]})
    assert info.value.code == 73
    with pytest.raises(CommandError) as info:
        run(dep, "db", {"insert": "c", "documents": []})
    assert info.value.code == 16


def test_writes_to_local_are_not_replicated(dep: Deployment) -> None:
    since = dep.oplog.end_seq
    run(dep, "local", {"insert": "c", "documents": [{"_id": 1}]})
    assert new_entries(dep, since) == []
    assert dep.catalog.get("local", "c") is not None


def test_validator_rejects_documents(dep: Deployment) -> None:
    run(dep, "db", {"create": "v", "validator": {"a": {"$gt": 0}}})
    reply = run(dep, "db", {"insert": "v", "documents": [{"_id": 1, "a": 1}, {"_id": 2, "a": 0}]})
    assert reply["n"] == 1
    assert reply["writeErrors"][0]["code"] == 121
    reply = run(dep, "db", {"insert": "v", "documents": [{"_id": 2, "a": 0}],
                            "bypassDocumentValidation": True})  # fmt: skip
    assert reply["n"] == 1


# -- delete -------------------------------------------------------------------------------------


def test_delete_logs_document_keys_and_pre_images(dep: Deployment) -> None:
    run(dep, "db", {"create": "c", "changeStreamPreAndPostImages": {"enabled": True}})
    run(
        dep,
        "db",
        {"insert": "c", "documents": [{"_id": 1, "k": 1}, {"_id": 2, "k": 1}, {"_id": 3}]},
    )
    since = dep.oplog.end_seq
    reply = run(dep, "db", {"delete": "c", "deletes": [{"q": {"k": 1}, "limit": 0}]})
    assert reply["n"] == 2
    entries = new_entries(dep, since)
    assert [(e.op, e.ns, e.o, e.o2) for e in entries] == [
        ("d", "db.c", {"_id": 1}, None),
        ("d", "db.c", {"_id": 2}, None),
    ]
    assert [e.pre_image for e in entries] == [{"_id": 1, "k": 1}, {"_id": 2, "k": 1}]
    assert run(dep, "db", {"delete": "c", "deletes": [{"q": {}, "limit": 1}]})["n"] == 1
    with pytest.raises(CommandError) as info:
        run(dep, "db", {"delete": "c", "deletes": [{"q": {}}]})
    assert info.value.code == 40414
    with pytest.raises(CommandError) as info:
        run(dep, "db", {"delete": "c", "deletes": [{"q": {}, "limit": 2}]})
    assert info.value.code == 9


def test_delete_on_a_missing_collection_creates_nothing(dep: Deployment) -> None:
    since = dep.oplog.end_seq
    assert run(dep, "db", {"delete": "none", "deletes": [{"q": {}, "limit": 0}]})["n"] == 0
    assert new_entries(dep, since) == []
    assert dep.catalog.get("db", "none") is None


# -- reads ----------------------------------------------------------------------------------------


def test_find_filter_sort_projection_and_batches(dep: Deployment) -> None:
    docs = [{"_id": i, "g": i % 2, "v": [i, -i], "s": {"t": i}} for i in range(5)]
    run(dep, "db", {"insert": "c", "documents": docs})
    reply = run(dep, "db", {"find": "c", "filter": {"g": 0}, "sort": {"_id": -1},
                            "projection": {"s.t": 1}, "batchSize": 2})  # fmt: skip
    cursor = reply["cursor"]
    assert cursor["firstBatch"] == [{"_id": 4, "s": {"t": 4}}, {"_id": 2, "s": {"t": 2}}]
    assert cursor["ns"] == "db.c" and cursor["id"] != 0
    live = dep.cursors.checkout(int(cursor["id"]), dep.members[0].name)
    rest = live.get_more(None, None, None)  # type: ignore[arg-type]
    assert rest.documents == [{"_id": 0, "s": {"t": 0}}] and rest.exhausted
    single = run(
        dep, "db", {"find": "c", "skip": 1, "limit": 2, "projection": {"v": {"$slice": 1}}}
    )
    assert single["cursor"]["firstBatch"] == [
        {"_id": 1, "g": 1, "v": [1], "s": {"t": 1}},
        {"_id": 2, "g": 0, "v": [2], "s": {"t": 2}},
    ]
    assert single["cursor"]["id"] == 0
    assert run(dep, "db", {"find": "missing"})["cursor"] == {
        "firstBatch": [],
        "id": 0,
        "ns": "db.missing",
    }


def test_find_sorts_arrays_by_their_extreme_element(dep: Deployment) -> None:
    run(dep, "db", {"insert": "c", "documents": [{"_id": 1, "a": [5, 0]}, {"_id": 2, "a": 3}]})
    asc = run(dep, "db", {"find": "c", "sort": {"a": 1}})["cursor"]["firstBatch"]
    desc = run(dep, "db", {"find": "c", "sort": {"a": -1}})["cursor"]["firstBatch"]
    assert [d["_id"] for d in asc] == [1, 2]
    assert [d["_id"] for d in desc] == [1, 2]


def test_count_and_distinct(dep: Deployment) -> None:
    run(dep, "db", {"insert": "c", "documents": [{"x": [1, 2]}, {"x": 2.0}, {"x": "a"}, {}]})
    assert run(dep, "db", {"count": "c"}) == {"n": 4}
    assert run(dep, "db", {"count": "c", "query": {"x": 2}, "limit": 1}) == {"n": 1}
    assert run(dep, "db", {"distinct": "c", "key": "x"}) == {"values": [1, 2, "a"]}


def test_find_on_a_view_runs_its_pipeline(dep: Deployment) -> None:
    run(dep, "db", {"insert": "c", "documents": [{"_id": 1, "a": 1}, {"_id": 2, "a": 2}]})
    run(dep, "db", {"create": "v", "viewOn": "c", "pipeline": [{"$match": {"a": {"$gt": 1}}}]})
    assert run(dep, "db", {"find": "v"})["cursor"]["firstBatch"] == [{"_id": 2, "a": 2}]
    with pytest.raises(CommandError) as info:
        run(dep, "db", {"insert": "v", "documents": [{}]})
    assert info.value.code == 166


def test_uuid_of_a_collection_is_stable_per_collection(dep: Deployment) -> None:
    run(dep, "db", {"insert": "c", "documents": [{}]})
    state = dep.catalog.get("db", "c")
    assert state is not None and isinstance(state.uuid, uuid.UUID)
    run(dep, "db", {"insert": "c", "documents": [{}]})
    assert dep.catalog.get("db", "c") is state
