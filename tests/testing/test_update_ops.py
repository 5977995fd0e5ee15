"""Update operators, their ``$v: 2`` diffs, and the oplog entries of update commands."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from changestream.testing.commands import REGISTRY, CommandContext, ConnectionInfo
from changestream.testing.core.errors import CommandError
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment
from changestream.testing.update import Update, UpdateEnv

NOW = datetime(2024, 5, 1, tzinfo=timezone.utc)
ENV = UpdateEnv(now=lambda: NOW, timestamp=lambda: Timestamp(7, 1))


def apply(doc: dict[str, Any], spec: Any, **kw: Any) -> tuple[dict[str, Any], Any]:
    """(new document, diff or None) of an operator update."""
    query = kw.pop("query", None)
    outcome = Update(spec, **kw).apply(doc, ENV, query=query)
    assert not outcome.replacement
    return outcome.doc, None if outcome.oplog_o is None else outcome.oplog_o["diff"]


def error(doc: dict[str, Any], spec: Any, **kw: Any) -> CommandError:
    with pytest.raises(CommandError) as info:
        Update(spec, **{k: v for k, v in kw.items() if k != "query"}).apply(
            doc, ENV, query=kw.get("query")
        )
    return info.value


# -- $set / $unset / created paths ----------------------------------------------------------


def test_set_that_changes_nothing_is_a_noop() -> None:
    doc = {"_id": 1, "a": 1, "o": {"x": [1]}}
    assert apply(doc, {"$set": {"a": 1, "o": {"x": [1]}}}) == (doc, None)
    # 1.0 is not binary-equal to 1: mongod logs it
    assert apply(doc, {"$set": {"a": 1.0}})[1] == {"u": {"a": 1.0}}


def test_diff_sections_and_field_order() -> None:
    doc = {"_id": 1, "z": 1, "a": 1, "gone": 1, "sub": {"k": 1}}
    new, diff = apply(
        doc, {"$set": {"z": 2, "n.b": 1, "n.a": 2, "sub.k": 3}, "$unset": {"gone": ""}}
    )
    assert diff == {
        "d": {"gone": False},
        "u": {"z": 2},
        "i": {"n": {"a": 2, "b": 1}},
        "ssub": {"u": {"k": 3}},
    }
    # existing fields change in place; new ones are appended in field-name order
    assert list(new) == ["_id", "z", "a", "sub", "n"]
    assert list(new["n"]) == ["a", "b"]
    assert doc["z"] == 1  # the input document is untouched


def test_unset_of_an_array_element_sets_null() -> None:
    assert apply({"_id": 1, "a": [1, 2]}, {"$unset": {"a.0": 1}}) == (
        {"_id": 1, "a": [None, 2]},
        {"sa": {"a": True, "u0": None}},
    )
    assert apply({"_id": 1}, {"$unset": {"missing": 1}})[1] is None


def test_set_into_arrays_pads_and_logs_the_index() -> None:
    new, diff = apply({"_id": 1, "a": [1]}, {"$set": {"a.3": "x", "b.0": 1}})
    assert new == {"_id": 1, "a": [1, None, None, "x"], "b": {"0": 1}}
    assert diff == {"i": {"b": {"0": 1}}, "sa": {"a": True, "u3": "x"}}


# -- arithmetic and comparisons -----------------------------------------------------------------


def test_inc_and_mul_promote_types_like_mongod() -> None:
    new, diff = apply(
        {"_id": 1, "i": 2147483647, "l": Int64(1), "d": 1}, {"$inc": {"i": 1, "l": 1, "d": 0.5}}
    )
    assert type(new["i"]) is Int64 and new["i"] == 2147483648
    assert type(new["l"]) is Int64 and new["d"] == 1.5
    assert diff == {"u": {"i": Int64(2147483648), "l": Int64(2), "d": 1.5}}
    assert apply({"_id": 1, "a": 5}, {"$inc": {"a": 0}, "$mul": {"b": Int64(3)}})[1] == {
        "i": {"b": Int64(0)}
    }
    assert error({"_id": 1, "a": "x"}, {"$inc": {"a": 1}}).errmsg == (
        "Cannot apply $inc to a value of non-numeric type. {_id: 1} has the field 'a' of "
        "non-numeric type string"
    )
    assert error({"_id": 1}, {"$inc": {"a": "1"}}).code == 14
    assert error({"_id": 1, "a": Int64(2**63 - 1)}, {"$inc": {"a": 1}}).code == 2


def test_min_max_and_current_date() -> None:
    doc = {"_id": 1, "lo": 5, "hi": 5}
    assert apply(doc, {"$min": {"lo": 5.0}, "$max": {"hi": 4}})[1] is None
    assert apply(doc, {"$min": {"lo": 3}, "$max": {"hi": "s"}})[1] == {"u": {"hi": "s", "lo": 3}}
    diff = apply({"_id": 1}, {"$currentDate": {"d": True, "t": {"$type": "timestamp"}}})[1]
    assert diff == {"i": {"d": NOW, "t": Timestamp(7, 1)}}


def test_bit_and_or_xor() -> None:
    doc = {"_id": 1, "a": 5, "l": Int64(1)}
    assert apply(doc, {"$bit": {"a": {"and": 6, "or": 1}}})[1] is None  # 5 & 6 | 1 == 5
    new, diff = apply(doc, {"$bit": {"a": {"xor": 1}, "l": {"or": 2}, "n": {"or": Int64(4)}}})
    assert diff == {"u": {"a": 4, "l": Int64(3)}, "i": {"n": Int64(4)}}
    assert type(new["n"]) is Int64
    assert error(doc, {"$bit": {"a": {"not": 1}}}).code == 2
    assert error({"_id": 1, "a": 1.5}, {"$bit": {"a": {"and": 1}}}).code == 2


# -- arrays ---------------------------------------------------------------------------------------


def test_push_appends_are_array_diffs() -> None:
    assert apply({"_id": 1, "a": [1]}, {"$push": {"a": {"$each": [2, 3]}}})[1] == {
        "sa": {"a": True, "u1": 2, "u2": 3}
    }
    # creating the array, pushing into an empty one, sorting, slicing or positioning: whole array
    assert apply({"_id": 1}, {"$push": {"a": 1}})[1] == {"i": {"a": [1]}}
    assert apply({"_id": 1, "a": []}, {"$push": {"a": 1}})[1] == {"u": {"a": [1]}}
    assert apply({"_id": 1, "a": [3, 1]}, {"$push": {"a": {"$each": [2], "$sort": 1}}})[1] == {
        "u": {"a": [1, 2, 3]}
    }
    assert apply({"_id": 1, "a": [1, 2]}, {"$push": {"a": {"$each": [3], "$slice": -2}}})[1] == {
        "u": {"a": [2, 3]}
    }
    assert apply({"_id": 1, "a": [1, 2]}, {"$push": {"a": {"$each": [0], "$position": 0}}})[1] == {
        "u": {"a": [0, 1, 2]}
    }
    docs = [{"n": 2, "k": "b"}, {"n": 1, "k": "a"}]
    new, _ = apply({"_id": 1, "a": docs}, {"$push": {"a": {"$each": [], "$sort": {"n": 1}}}})
    assert new["a"] == [{"n": 1, "k": "a"}, {"n": 2, "k": "b"}]
    assert error({"_id": 1, "a": 1}, {"$push": {"a": 2}}).errmsg == (
        "The field 'a' must be an array but is of type int in document {_id: 1}"
    )


def test_add_to_set_appends_only_new_values() -> None:
    doc = {"_id": 1, "a": [1, {"x": 1}]}
    assert apply(doc, {"$addToSet": {"a": 1.0}})[1] is None
    assert apply(doc, {"$addToSet": {"a": {"$each": [{"x": 1}, 2, 2, 3]}}})[1] == {
        "sa": {"a": True, "u2": 2, "u3": 3}
    }
    assert error(doc, {"$addToSet": {"a": {"$each": 1}}}).code == 14


def test_pull_pop_and_pull_all_log_the_whole_array() -> None:
    doc = {"_id": 1, "a": [1, 2, 3, 2], "o": [{"k": 1, "v": 1}, {"k": 2}]}
    assert apply(doc, {"$pull": {"a": 2}})[1] == {"u": {"a": [1, 3]}}
    assert apply(doc, {"$pull": {"a": {"$gte": 3}}})[1] == {"u": {"a": [1, 2, 2]}}
    assert apply(doc, {"$pull": {"o": {"k": 1}}})[1] == {"u": {"o": [{"k": 2}]}}
    assert apply(doc, {"$pull": {"a": 9}})[1] is None
    assert apply(doc, {"$pullAll": {"a": [1, 3]}})[1] == {"u": {"a": [2, 2]}}
    assert apply(doc, {"$pop": {"a": -1}})[1] == {"u": {"a": [2, 3, 2]}}
    assert apply({"_id": 1, "a": []}, {"$pop": {"a": 1}})[1] is None
    assert error(doc, {"$pop": {"a": 2}}).errmsg == "$pop expects 1 or -1, found: 2"


# -- positional and array filters -------------------------------------------------------------------


def test_positional_operators() -> None:
    doc = {"_id": 1, "a": [{"x": 1}, {"x": 2}, {"x": 3}]}
    assert apply(doc, {"$set": {"a.$.x": 9}}, query={"a.x": 2})[1] == {
        "sa": {"a": True, "s1": {"u": {"x": 9}}}
    }
    assert apply(doc, {"$inc": {"a.$[].x": 1}})[0]["a"] == [{"x": 2}, {"x": 3}, {"x": 4}]
    # more than one element changed: the whole array is logged
    assert apply(doc, {"$inc": {"a.$[].x": 1}})[1] == {"u": {"a": [{"x": 2}, {"x": 3}, {"x": 4}]}}
    new, diff = apply(doc, {"$set": {"a.$[e].x": 0}}, array_filters=[{"e.x": {"$gte": 3}}])
    assert new["a"][2] == {"x": 0} and diff == {"sa": {"a": True, "s2": {"u": {"x": 0}}}}
    assert error(doc, {"$set": {"a.$.x": 1}}).errmsg == (
        "The positional operator did not find the match needed from the query."
    )
    assert error(doc, {"$set": {"a.$[q].x": 1}}).code == 2
    assert error(doc, {"$set": {"a": 1}}, array_filters=[{"e": 1}]).code == 9


# -- $rename -------------------------------------------------------------------------------------------


def test_rename_sets_the_target_then_deletes_the_source() -> None:
    new, diff = apply({"_id": 1, "a": 1, "b": {"c": 2}}, {"$rename": {"a": "z", "b.c": "b.d"}})
    assert new == {"_id": 1, "b": {"d": 2}, "z": 1}
    assert diff == {"d": {"a": False}, "i": {"z": 1}, "sb": {"d": {"c": False}, "i": {"d": 2}}}
    assert apply({"_id": 1}, {"$rename": {"a": "b"}})[1] is None
    assert error({"_id": 1, "a": 1}, {"$rename": {"a": "a"}}).code == 2


# -- parse errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "code", "message"),
    [
        ({"$foo": {"a": 1}}, 9, "Unknown modifier: $foo. Expected a valid update modifier or "
         "pipeline-style update specified as an array"),
        ({"$set": 1}, 9, "Modifiers operate on fields but we found type int instead. For "
         "example: {$mod: {<field>: ...}} not {$set: 1}"),
        ({"$set": {"a": 1}, "$inc": {"a": 1}}, 40, "Updating the path 'a' would create a "
         "conflict at 'a'"),
        ({"$set": {"a.b": 1, "a": 1}}, 40, "Updating the path 'a' would create a conflict at 'a'"),
        ({"$set": {"_id": 2}}, 66, "Performing an update on the path '_id' would modify the "
         "immutable field '_id'"),
        ({"$set": {"a..b": 1}}, 56, "The update path 'a..b' contains an empty field name, which "
         "is not allowed."),
        ({"$set": {"$x": 1}}, 52, "The dollar ($) prefixed field '$x' in '$x' is not allowed in "
         "the context of an update's replacement document. Consider using an aggregation "
         "pipeline with $replaceWith."),
        ({"$set": {"n.x": 1}}, 28, "Cannot create field 'x' in element {n: 5}"),
    ],
)  # fmt: skip
def test_mongod_errors(spec: dict[str, Any], code: int, message: str) -> None:
    err = error({"_id": 1, "n": 5}, spec)
    assert (err.code, err.errmsg) == (code, message)


def test_empty_modifier_is_a_noop() -> None:
    assert apply({"_id": 1}, {"$set": {}}) == ({"_id": 1}, None)


# -- replacement and pipeline updates --------------------------------------------------------------------


def test_replacement_keeps_id_first_and_rejects_changing_it() -> None:
    outcome = Update({"b": 2, "_id": 1}).apply({"_id": 1, "a": 1}, ENV)
    assert outcome.replacement and outcome.oplog_o == {"_id": 1, "b": 2}
    assert list(outcome.doc) == ["_id", "b"]
    assert Update({"a": 1}).apply({"_id": 1, "a": 1}, ENV).oplog_o is None
    with pytest.raises(CommandError) as info:
        Update({"_id": 2}).apply({"_id": 1}, ENV)
    assert info.value.code == 66
    with pytest.raises(CommandError) as info:
        Update({"a": 1}, multi=True)
    assert info.value.code == 9


def test_pipeline_update_array_truncation_is_a_resize_diff() -> None:
    # change-streams.yml "Test array truncation"
    doc = {"_id": 1, "a": 1, "array": ["foo", {"a": "bar"}, 1, 2, 3]}
    outcome = Update([{"$set": {"array": ["foo", {"a": "bar"}]}}]).apply(doc, ENV)
    assert outcome.oplog_o == {"$v": 2, "diff": {"sarray": {"a": True, "l": 2}}}


def test_pipeline_stages() -> None:
    doc = {"_id": 1, "a": 1, "o": {"x": 1, "y": 2}, "long": "x" * 100}
    outcome = Update([{"$set": {"o": {"x": 5}, "b": {"$add": ["$a", 1]}}}, {"$unset": "a"}]).apply(
        doc, ENV
    )
    assert outcome.doc == {"_id": 1, "o": {"x": 5, "y": 2}, "long": "x" * 100, "b": 2}
    # the merged sub-document is small, so mongod logs it whole rather than as a sub-diff
    assert outcome.oplog_o == {
        "$v": 2,
        "diff": {"d": {"a": False}, "u": {"o": {"x": 5, "y": 2}}, "i": {"b": 2}},
    }
    same = Update([{"$project": {"a": 1, "o": 1, "long": 1}}]).apply(doc, ENV)
    assert same.oplog_o is None
    replaced = Update([{"$replaceWith": {"n": 1}}]).apply(doc, ENV)
    assert replaced.replacement and replaced.doc == {"_id": 1, "n": 1}
    with pytest.raises(CommandError):
        Update([{"$match": {}}]).apply(doc, ENV)


# -- upsert documents --------------------------------------------------------------------------------------


def test_upsert_document_seeds_from_query_equalities() -> None:
    upd = Update({"$set": {"m": 1}, "$setOnInsert": {"s": 1}})
    doc = upd.upsert_document({"z": 1, "a.b": 2, "r": {"$gt": 1}, "_id": 5}, ENV)
    assert doc == {"_id": 5, "a": {"b": 2}, "z": 1, "m": 1, "s": 1}
    assert list(doc) == ["_id", "a", "z", "m", "s"]
    generated = Update({"x": 1}).upsert_document({"y": 2}, ENV)
    assert isinstance(generated["_id"], ObjectId) and list(generated) == ["_id", "x"]
    # $setOnInsert does nothing on a plain update
    assert apply({"_id": 1}, {"$setOnInsert": {"s": 1}})[1] is None


# -- the update / findAndModify commands ------------------------------------------------------------------------


@pytest.fixture
def dep() -> Deployment:
    deployment = Deployment(get_profile("8.0"))
    run(deployment, {"insert": "c", "documents": [{"_id": 1, "a": [1, 2, 1]}, {"_id": 2, "a": []}]})
    return deployment


def run(dep: Deployment, body: dict[str, Any]) -> dict[str, Any]:
    ctx = CommandContext(
        deployment=dep,
        member=dep.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db="db",
        name=next(iter(body)),
        body=body,
    )
    return REGISTRY[ctx.name].handler(ctx)


def logged(dep: Deployment, since: int) -> list[tuple[Any, ...]]:
    return [(e.op, e.ns, e.o, e.o2) for e in dep.oplog.read(since)]


def test_update_command_oplog_entries(dep: Deployment) -> None:
    since = dep.oplog.end_seq
    reply = run(dep, {"update": "c", "updates": [
        {"q": {"_id": 1}, "u": {"$push": {"a": 3}}},
        {"q": {"_id": 1}, "u": {"$pull": {"a": 1}}},
        {"q": {"_id": 2}, "u": {"$set": {"a": []}}},
        {"q": {"_id": 2}, "u": {"b": 1}},
        {"q": {"k": "new"}, "u": {"$set": {"v": 1}}, "upsert": True},
    ]})  # fmt: skip
    entries = dep.oplog.read(since)
    upserted_id = reply["upserted"][0]["_id"]
    assert reply["n"] == 5 and reply["nModified"] == 3
    assert reply["upserted"] == [{"index": 4, "_id": upserted_id}]
    assert logged(dep, since) == [
        ("u", "db.c", {"$v": 2, "diff": {"sa": {"a": True, "u3": 3}}}, {"_id": 1}),
        ("u", "db.c", {"$v": 2, "diff": {"u": {"a": [2, 3]}}}, {"_id": 1}),
        ("u", "db.c", {"_id": 2, "b": 1}, {"_id": 2}),
        ("i", "db.c", {"_id": upserted_id, "k": "new", "v": 1}, {"_id": upserted_id}),
    ]
    state = dep.catalog.get("db", "c")
    assert state is not None and all(e.ui == state.uuid for e in entries)
    assert all(e.pre_image is None and e.post_image is None for e in entries)
    assert reply["opTime"]["ts"] == entries[-1].ts


def test_update_that_changes_nothing_logs_nothing(dep: Deployment) -> None:
    since = dep.oplog.end_seq
    reply = run(
        dep, {"update": "c", "updates": [{"q": {}, "u": {"$set": {"a": []}}, "multi": True}]}
    )
    assert reply["n"] == 2 and reply["nModified"] == 1
    assert logged(dep, since) == [("u", "db.c", {"$v": 2, "diff": {"u": {"a": []}}}, {"_id": 1})]
    since = dep.oplog.end_seq
    reply = run(
        dep, {"update": "c", "updates": [{"q": {}, "u": {"$set": {"a": []}}, "multi": True}]}
    )
    assert (reply["n"], reply["nModified"], logged(dep, since)) == (2, 0, [])


def test_update_errors_are_write_errors(dep: Deployment) -> None:
    reply = run(dep, {"update": "c", "updates": [
        {"q": {"_id": 1}, "u": {"$inc": {"a": 1}}},
        {"q": {"_id": 2}, "u": {"$set": {"x": 1}}},
    ], "ordered": False})  # fmt: skip
    assert reply["writeErrors"] == [
        {
            "index": 0,
            "code": 14,
            "errmsg": "Cannot apply $inc to a value of non-numeric type. {_id: 1} has the field "
            "'a' of non-numeric type array",
        }
    ]
    assert (reply["n"], reply["nModified"]) == (1, 1)


def test_images_are_attached_when_enabled(dep: Deployment) -> None:
    run(dep, {"collMod": "c", "changeStreamPreAndPostImages": {"enabled": True}})
    since = dep.oplog.end_seq
    run(dep, {"update": "c", "updates": [{"q": {"_id": 2}, "u": {"$set": {"x": 1}}},
                                          {"q": {"_id": 2}, "u": {"y": 1}}]})  # fmt: skip
    diff_entry, replace_entry = dep.oplog.read(since)
    assert diff_entry.pre_image == {"_id": 2, "a": []}
    assert diff_entry.post_image == {"_id": 2, "a": [], "x": 1}
    assert replace_entry.pre_image == {"_id": 2, "a": [], "x": 1}
    assert replace_entry.post_image is None  # a replacement's post-image is its ``o``


def test_4x_updates_keep_the_post_image_for_legacy_descriptions() -> None:
    old = Deployment(get_profile("4.4"))
    run(old, {"insert": "c", "documents": [{"_id": 1, "a": [1, 2, 3]}]})
    since = old.oplog.end_seq
    run(old, {"update": "c", "updates": [{"q": {"_id": 1}, "u": {"$pop": {"a": 1}}}]})
    (entry,) = old.oplog.read(since)
    assert entry.post_image == {"_id": 1, "a": [1, 2]} and entry.pre_image is None


def test_find_and_modify(dep: Deployment) -> None:
    since = dep.oplog.end_seq
    reply = run(dep, {"findAndModify": "c", "query": {"_id": 2}, "update": {"$set": {"x": 1}},
                      "new": True, "fields": {"x": 1}})  # fmt: skip
    assert reply == {
        "lastErrorObject": {"n": 1, "updatedExisting": True},
        "value": {"_id": 2, "x": 1},
    }
    reply = run(dep, {"findAndModify": "c", "query": {"_id": 9}, "update": {"$inc": {"n": 1}},
                      "upsert": True})  # fmt: skip
    assert reply == {
        "lastErrorObject": {"n": 1, "updatedExisting": False, "upserted": 9},
        "value": None,
    }
    reply = run(dep, {"findAndModify": "c", "query": {}, "sort": {"_id": -1}, "remove": True})
    assert reply == {"lastErrorObject": {"n": 1}, "value": {"_id": 9, "n": 1}}
    assert logged(dep, since) == [
        ("u", "db.c", {"$v": 2, "diff": {"i": {"x": 1}}}, {"_id": 2}),
        ("i", "db.c", {"_id": 9, "n": 1}, {"_id": 9}),
        ("d", "db.c", {"_id": 9}, None),
    ]
    with pytest.raises(CommandError) as info:
        run(dep, {"findAndModify": "c", "query": {}, "remove": True, "update": {}})
    assert info.value.code == 9
