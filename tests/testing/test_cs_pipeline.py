"""User stages after ``$changeStream``: $match, $project, $addFields/$set, $unset,
$replaceRoot/$replaceWith, $redact, and mongod's refusal of events whose ``_id`` changed."""

from __future__ import annotations

import copy
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp

from changestream.testing.changestreams.pipeline import Pipeline
from changestream.testing.commands import CommandContext, ConnectionInfo
from changestream.testing.commands.aggregate import aggregate
from changestream.testing.core.errors import CommandError
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment

TOKEN = {"_data": "826553F10000000003"}
EVENT: dict[str, Any] = {
    "_id": TOKEN,
    "operationType": "insert",
    "clusterTime": Timestamp(1_700_000_000, 3),
    "wallTime": datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc),
    "fullDocument": {"_id": 1, "a": 1, "tags": ["x", "y"], "sub": {"p": 1, "q": 2}},
    "ns": {"db": "db", "coll": "c"},
    "documentKey": {"_id": 1},
}


def apply(*stages: dict[str, Any], event: dict[str, Any] | None = None) -> dict[str, Any] | None:
    doc = event if event is not None else EVENT
    before = copy.deepcopy(doc)
    result = Pipeline(stages).apply(doc)
    assert doc == before  # stages never mutate their input (events share the oplog's documents)
    return result


# -- $match ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("query", "matches"),
    [
        ({"operationType": "insert"}, True),
        ({"operationType": "delete"}, False),
        ({"ns.coll": "c", "ns.db": "db"}, True),
        ({"fullDocument.tags": "y"}, True),  # an array along the path: mongomock's semantics
        ({"fullDocument.missing": "x"}, False),
        ({"operationType": {"$ne": "create"}}, True),
        ({"operationType": {"$in": ["update", "replace"]}}, False),
        ({"fullDocument.a": {"$gte": 1}, "documentKey._id": 1}, True),
        ({"$or": [{"fullDocument.z": 3}, {"ns.coll": "c"}]}, True),
        ({"clusterTime": {"$gt": Timestamp(1_700_000_000, 2)}}, True),
    ],
)
def test_match(query: dict[str, Any], matches: bool) -> None:
    assert (apply({"$match": query}) is EVENT) is matches
    assert (apply({"$match": query}) is None) is not matches


def test_match_on_dates() -> None:
    after = datetime(2023, 1, 1, tzinfo=timezone.utc)
    assert apply({"$match": {"wallTime": {"$gt": after}}}) is EVENT


# -- $project --------------------------------------------------------------------------------------
def test_inclusion_keeps_input_order_then_appends_computed_fields() -> None:
    out = apply({"$project": {"optype": "$operationType", "ns": 1, "newField": "value"}})
    assert out == {
        "_id": TOKEN,
        "ns": {"db": "db", "coll": "c"},
        "optype": "insert",
        "newField": "value",
    }
    assert list(out or {}) == ["_id", "ns", "optype", "newField"]


def test_projection_with_literal_and_dotted_computed_field() -> None:
    out = apply({"$project": {"operationType": "addedInFutureMongoDBVersion", "ns": 1}})
    assert out == {"_id": TOKEN, "operationType": "addedInFutureMongoDBVersion", "ns": EVENT["ns"]}
    out = apply({"$project": {"operationType": "insert", "ns.viewOn": "db.coll"}})
    assert out == {"_id": TOKEN, "ns": {"viewOn": "db.coll"}, "operationType": "insert"}


def test_projection_of_a_computed_sub_document() -> None:
    spec = {
        "operationType": "insert",
        "ns": {"db": "$ns.db", "coll": "$ns.coll", "viewOn": "db.coll"},
    }
    out = apply({"$project": spec})
    assert out == {
        "_id": TOKEN,
        "operationType": "insert",
        "ns": {"db": "db", "coll": "c", "viewOn": "db.coll"},
    }


def test_nested_inclusion_and_expressions() -> None:
    out = apply({"$project": {"fullDocument": {"sub": {"q": 1}}, "_id": 0, "n": {"$literal": 1}}})
    assert out == {"fullDocument": {"sub": {"q": 2}}, "n": 1}
    out = apply(
        {"$project": {"fullDocument.tags": 1, "name": {"$concat": ["$ns.db", ".", "$ns.coll"]}}}
    )
    assert out == {"_id": TOKEN, "fullDocument": {"tags": ["x", "y"]}, "name": "db.c"}


def test_missing_computed_values_are_left_out() -> None:
    assert apply({"$project": {"x": "$nope"}}) == {"_id": TOKEN}


def test_exclusion() -> None:
    out = apply({"$project": {"fullDocument": 0, "ns.coll": 0, "wallTime": False}})
    assert out == {
        "_id": TOKEN,
        "operationType": "insert",
        "clusterTime": EVENT["clusterTime"],
        "ns": {"db": "db"},
        "documentKey": {"_id": 1},
    }
    assert apply({"$project": {"_id": 0, "fullDocument": 0}}) == {
        k: v for k, v in EVENT.items() if k not in ("_id", "fullDocument")
    }


def test_projection_spec_errors() -> None:
    for spec, code in (
        ({}, 51272),
        ({"a": 1, "b": 0}, 31254),
        ({"a": 0, "b": "$x"}, 31252),
        ({"a": {}}, 51270),
        ({"a": 1, "a.b": 1}, 31250),
        ({"$a": 1}, 16410),
        ({"a": {"$unknownOp": 1}}, 168),
    ):
        with pytest.raises(CommandError) as info:
            Pipeline([{"$project": spec}])
        assert info.value.code == code, spec


# -- $addFields / $set / $unset ---------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["$addFields", "$set"])
def test_add_fields(stage: str) -> None:
    out = apply({stage: {"ns.viewOn": "db.coll", "n": 1, "fullDocument": {"b": "$fullDocument.a"}}})
    assert out is not None
    assert list(out) == [*EVENT, "n"]
    assert out["ns"] == {"db": "db", "coll": "c", "viewOn": "db.coll"}
    assert out["fullDocument"] == {**EVENT["fullDocument"], "b": 1}
    assert out["n"] == 1


def test_add_fields_with_a_missing_value_removes_the_field() -> None:
    out = apply({"$set": {"operationType": "$nope", "root": "$$ROOT.ns.db"}})
    assert out is not None and "operationType" not in out
    assert out["root"] == "db"


def test_unset() -> None:
    assert list(apply({"$unset": "fullDocument"}) or {}) == [
        "_id", "operationType", "clusterTime", "wallTime", "ns", "documentKey",
    ]  # fmt: skip
    out = apply({"$unset": ["ns.coll", "wallTime"]})
    assert out is not None and out["ns"] == {"db": "db"} and "wallTime" not in out


# -- $replaceRoot / $replaceWith ---------------------------------------------------------------------
def test_replace_root_and_replace_with() -> None:
    keep_id = {"$mergeObjects": ["$fullDocument", {"_id": "$_id"}]}
    assert apply({"$replaceWith": keep_id}) == {**EVENT["fullDocument"], "_id": TOKEN}
    assert apply({"$replaceRoot": {"newRoot": "$ns"}}) == EVENT["ns"]
    with pytest.raises(CommandError) as info:
        apply({"$replaceRoot": {"newRoot": "$nope"}})
    assert info.value.code == 40228
    assert "Type of resulting value: 'missing'" in info.value.errmsg
    with pytest.raises(CommandError) as info:
        Pipeline([{"$replaceRoot": {"root": "$ns"}}])
    assert info.value.code == 40415


# -- $redact ---------------------------------------------------------------------------------------
def test_redact() -> None:
    prune_deletes = {"$cond": [{"$eq": ["$operationType", "delete"]}, "$$PRUNE", "$$KEEP"]}
    assert apply({"$redact": prune_deletes}) is EVENT
    assert apply({"$redact": prune_deletes}, event={**EVENT, "operationType": "delete"}) is None
    descend = {"$cond": [{"$eq": ["$q", 2]}, "$$PRUNE", "$$DESCEND"]}
    out = apply({"$redact": descend})
    assert out is not None and "sub" not in out["fullDocument"]
    assert out["fullDocument"]["tags"] == ["x", "y"]
    with pytest.raises(CommandError) as info:
        apply({"$redact": "$operationType"})
    assert info.value.code == 17053


# -- the _id check, through a real stream --------------------------------------------------------------
def _first_events(pipeline: list[dict[str, Any]]) -> list[dict[str, Any]] | CommandError:
    d = Deployment(get_profile("8.0"))
    ctx = CommandContext(
        deployment=d,
        member=d.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db="db",
        name="aggregate",
        body={"aggregate": "c", "pipeline": [{"$changeStream": {}}, *pipeline], "cursor": {}},
    )
    with d.lock:
        reply = aggregate(ctx)
    cid = int(reply["cursor"]["id"])
    with d.lock:
        d.log("i", "db.c", {"_id": 1}, ui=uuid.uuid4(), o2={"_id": 1})
    cursor = d.cursors.checkout(cid, d.members[0].name)
    try:
        return cursor.get_more(ctx, None, 0).documents
    except CommandError as err:
        return err


def test_removing_the_id_is_fatal() -> None:
    err = _first_events([{"$project": {"_id": 0}}])
    assert isinstance(err, CommandError)
    assert (err.code, err.code_name) == (280, "ChangeStreamFatalError")
    assert err.errmsg.startswith(
        "Executor error during getMore :: caused by :: Encountered an event whose _id field, "
        "which contains the resume token, was modified by the pipeline. Modifying the _id field "
        "of an event makes it impossible to resume the stream from that point. Only "
        "transformations that retain the unmodified _id field are allowed. Expected: "
        '{ _id: { _data: "'
    )
    assert err.errmsg.endswith("} } but found: {}")


def test_changing_the_id_is_fatal_but_recomputing_it_is_not() -> None:
    err = _first_events([{"$set": {"_id": "x"}}])
    assert isinstance(err, CommandError)
    assert err.code == 280 and err.errmsg.endswith('but found: { _id: "x" }')
    (event,) = _first_events([{"$set": {"_id": "$_id", "x": 1}}])  # type: ignore[misc]
    assert event["x"] == 1


def test_resume_token_type_is_left_alone() -> None:
    out = apply({"$addFields": {"n": Int64(5)}})
    assert out is not None and out["_id"] is TOKEN and isinstance(out["n"], Int64)
