"""The ``aggregate`` command: $changeStream validation with mongod's codes and messages,
namespaces and cursor replies, and the modest plain aggregations."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp

from changestream.testing.changestreams.resume_token import (
    ResumeTokenData,
    encode_token,
    high_water_mark,
)
from changestream.testing.commands import CommandContext, ConnectionInfo
from changestream.testing.commands.aggregate import aggregate
from changestream.testing.core.errors import CommandError
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment

UUID_A = uuid.UUID("a5093abb-38fe-4b9e-a67f-01bb1a96d812")
TS = Timestamp(1_700_000_000, 5)


def run(
    body: dict[str, Any],
    *,
    db: str = "db",
    version: str = "8.0",
    d: Deployment | None = None,
    lsid: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], CommandContext]:
    d = d or Deployment(get_profile(version))
    ctx = CommandContext(
        deployment=d,
        member=d.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db=db,
        name="aggregate",
        body=body,
        lsid=lsid,
    )
    with d.lock:
        return aggregate(ctx), ctx


def stream(
    options: Any = None, *rest: dict[str, Any], target: Any = "c", **kw: Any
) -> dict[str, Any]:
    spec = {} if options is None else options
    body = {"aggregate": target, "pipeline": [{"$changeStream": spec}, *rest], "cursor": {}}
    return run(body, **kw)[0]


def error(call: Any) -> CommandError:
    with pytest.raises(CommandError) as info:
        call()
    return info.value


def event_token(**kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "cluster_time": TS,
        "uuid": UUID_A,
        "event_identifier": {"operationType": "insert", "documentKey": {"_id": 1}},
    }
    fields.update(kw)
    return encode_token(ResumeTokenData(**fields))


# -- replies and namespaces ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("db", "target", "options", "ns"),
    [
        ("db", "c", {}, "db.c"),
        ("db", 1, {}, "db.$cmd.aggregate"),
        ("admin", 1, {"allChangesForCluster": True}, "admin.$cmd.aggregate"),
    ],
)
def test_cursor_reply_namespaces(db: str, target: Any, options: dict[str, Any], ns: str) -> None:
    body = {"aggregate": target, "pipeline": [{"$changeStream": options}], "cursor": {}}
    reply, ctx = run(body, db=db)
    cursor = reply["cursor"]
    assert list(cursor) == ["firstBatch", "postBatchResumeToken", "id", "ns"]
    assert cursor["ns"] == ns
    assert isinstance(cursor["id"], Int64) and cursor["id"] > 0
    assert ctx.is_change_stream


def test_the_cursor_remembers_the_session() -> None:
    d = Deployment(get_profile("8.0"))
    session = uuid.uuid4()
    body = {"aggregate": "c", "pipeline": [{"$changeStream": {}}], "cursor": {}}
    reply, _ = run(body, d=d, lsid={"id": session})
    cid = int(reply["cursor"]["id"])
    cursor = d.cursors.checkout(cid, d.members[0].name)
    assert cursor.lsid_id == session.bytes
    assert cursor.tailable_await


# -- the command's own fields ----------------------------------------------------------------------
def test_cursor_option_is_required() -> None:
    err = error(lambda: run({"aggregate": "c", "pipeline": [{"$changeStream": {}}]}))
    assert (err.code, err.code_name) == (9, "FailedToParse")
    assert err.errmsg == (
        "The 'cursor' option is required, except for aggregate with the explain argument"
    )


def test_pipeline_must_be_an_array_of_objects() -> None:
    assert error(lambda: run({"aggregate": "c", "pipeline": {}, "cursor": {}})).code == 14
    assert error(lambda: run({"aggregate": "c", "pipeline": [1], "cursor": {}})).code == 14
    assert error(lambda: run({"aggregate": "c", "cursor": {}})).code == 40414


@pytest.mark.parametrize(("version", "rejected"), [("4.2", True), ("4.4", False), ("8.0", False)])
def test_document_comments_need_44(version: str, rejected: bool) -> None:
    body = {
        "aggregate": "c",
        "pipeline": [{"$changeStream": {}}],
        "cursor": {},
        "comment": {"name": "test1"},
    }
    if rejected:
        err = error(lambda: run(body, version=version))
        assert (err.code, err.errmsg) == (14, "comment must be a string, not a object")
    else:
        assert run(body, version=version)[0]["cursor"]["id"]
    assert run({**body, "comment": "text"}, version=version)[0]["cursor"]["id"]


def test_read_concern_must_be_majority() -> None:
    body = {
        "aggregate": "c",
        "pipeline": [{"$changeStream": {}}],
        "cursor": {},
        "readConcern": {"level": "local"},
    }
    err = error(lambda: run(body))
    assert err.code == 72
    assert "cannot run with a readConcern other than 'majority'" in err.errmsg
    assert run({**body, "readConcern": {"level": "majority"}})[0]["cursor"]["id"]


# -- stage-level validation ----------------------------------------------------------------------------
def test_standalone_rejects_change_streams() -> None:
    d = Deployment(get_profile("8.0"), standalone=True)
    err = error(lambda: stream(d=d))
    assert err.code == 40573
    assert err.code_name == "Location40573"
    assert err.errmsg == "The $changeStream stage is only supported on replica sets"


def test_unknown_stage() -> None:
    err = error(lambda: stream({}, {"$unsupported": "foo"}))
    assert (err.code, err.errmsg) == (40324, "Unrecognized pipeline stage name: '$unsupported'")


def test_stage_objects_have_one_field() -> None:
    err = error(lambda: stream({}, {"$match": {}, "$project": {"a": 1}}))
    assert err.code == 40323


def test_change_stream_must_be_first() -> None:
    body = {"aggregate": "c", "pipeline": [{"$match": {}}, {"$changeStream": {}}], "cursor": {}}
    err = error(lambda: run(body))
    assert (err.code, err.errmsg) == (
        40602,
        "$changeStream is only valid as the first stage in a pipeline",
    )


@pytest.mark.parametrize("name", ["$group", "$sort", "$limit", "$lookup"])
def test_stages_not_allowed_in_a_change_stream(name: str) -> None:
    err = error(lambda: stream({}, {name: {}}))
    assert (err.code, err.code_name) == (20, "IllegalOperation")
    assert err.errmsg == f"{name} is not permitted in a $changeStream pipeline"


@pytest.mark.parametrize(("version", "code"), [("5.0", 50808), ("6.0", 6188500), ("8.0", 6188500)])
def test_spec_must_be_a_document(version: str, code: int) -> None:
    err = error(lambda: stream(5, version=version))
    assert err.code == code
    if code == 6188500:
        assert err.errmsg == "$changeStream must take a nested object but found: $changeStream: 5"


def test_unknown_option() -> None:
    err = error(lambda: stream({"foo": 1}))
    assert (err.code, err.code_name) == (40415, "IDLUnknownField")
    assert err.errmsg == "BSON field '$changeStream.foo' is an unknown field."


@pytest.mark.parametrize("option", ["showExpandedEvents", "fullDocumentBeforeChange"])
def test_options_new_in_60_are_unknown_before(option: str) -> None:
    value: Any = True if option == "showExpandedEvents" else "off"
    assert error(lambda: stream({option: value}, version="5.0")).code == 40415
    assert stream({option: value}, version="6.0")["cursor"]["id"]


def test_option_types() -> None:
    err = error(lambda: stream({"fullDocument": 1}))
    assert (err.code, err.errmsg) == (
        14,
        "BSON field '$changeStream.fullDocument' is the wrong type 'int', expected type 'string'",
    )
    err = error(lambda: stream({"allChangesForCluster": 1}))
    assert err.code == 14 and err.errmsg.endswith("expected type 'bool'")
    assert error(lambda: stream({"startAtOperationTime": 5})).code == 14
    assert error(lambda: stream({"resumeAfter": "x"})).code == 14


def test_full_document_values_by_version() -> None:
    err = error(lambda: stream({"fullDocument": "sometimes"}))
    assert (err.code, err.errmsg) == (
        2,
        "Enumeration value 'sometimes' for field '$changeStream.fullDocument' is not a valid value.",
    )
    err = error(lambda: stream({"fullDocument": "whenAvailable"}, version="5.0"))
    assert err.code == 40575
    assert stream({"fullDocument": "updateLookup"}, version="4.2")["cursor"]["id"]
    assert stream({"fullDocument": "required"}, version="6.0")["cursor"]["id"]
    err = error(lambda: stream({"fullDocumentBeforeChange": "on"}))
    assert err.code == 2


def test_all_changes_for_cluster_placement() -> None:
    err = error(lambda: stream({"allChangesForCluster": True}, target=1))
    assert err.code == 72
    assert err.errmsg == (
        "A $changeStream with 'allChangesForCluster:true' may only be opened on the 'admin' "
        "database, and with no collection name; found db.$cmd.aggregate"
    )
    err = error(lambda: stream({"allChangesForCluster": True}, db="admin", target="c"))
    assert err.code == 72 and err.errmsg.endswith("found admin.c")


@pytest.mark.parametrize(
    ("db", "target", "message"),
    [
        ("admin", 1, "$changeStream may not be opened on the internal admin database"),
        ("local", "c", "$changeStream may not be opened on the internal local database"),
        ("config", 1, "$changeStream may not be opened on the internal config database"),
        (
            "db",
            "system.js",
            "$changeStream may not be opened on the internal db.system.js collection",
        ),
    ],
)
def test_internal_namespaces_are_refused(db: str, target: Any, message: str) -> None:
    err = error(lambda: stream({}, db=db, target=target))
    assert (err.code, err.code_name, err.errmsg) == (73, "InvalidNamespace", message)


def test_ordinary_names_that_look_internal_are_fine() -> None:
    assert stream({}, target="system_users")["cursor"]["id"]
    assert stream({}, db="admins", target=1)["cursor"]["id"]


def test_views_cannot_be_watched() -> None:
    d = Deployment(get_profile("8.0"))
    with d.lock:
        d.catalog.new_collection("db", "v", {"viewOn": "c", "pipeline": []})
    err = error(lambda: stream({}, target="v", d=d))
    assert (err.code, err.errmsg) == (166, "Namespace db.v is a view, not a collection")


# -- resume options ---------------------------------------------------------------------------------
def test_resume_option_conflicts() -> None:
    token = event_token()
    err = error(lambda: stream({"resumeAfter": token, "startAfter": token}))
    assert err.code == 50865
    err = error(lambda: stream({"resumeAfter": token, "startAtOperationTime": TS}))
    assert (err.code, err.errmsg) == (
        40674,
        "Only one type of resume option is allowed, but multiple were found",
    )


def test_resume_after_an_invalidate_token_is_refused() -> None:
    err = error(lambda: stream({"resumeAfter": event_token(from_invalidate=True)}))
    assert err.code == 260 and err.code_name == "InvalidResumeToken"
    assert err.errmsg == (
        "Attempting to resume a change stream using 'resumeAfter' is not allowed from an "
        "invalidate notification"
    )


def test_single_collection_streams_need_a_uuid_in_event_tokens() -> None:
    no_uuid = event_token(uuid=None, event_identifier={"operationType": "dropDatabase"})
    err = error(lambda: stream({"resumeAfter": no_uuid}))
    assert err.code == 260
    assert "the resume token does not include a UUID" in err.errmsg
    assert stream({"resumeAfter": no_uuid}, target=1)["cursor"]["id"]
    hwm = encode_token(high_water_mark(TS, 2))
    assert stream({"resumeAfter": hwm})["cursor"]["id"]  # high-water marks never carry one


def test_malformed_tokens_fail_with_the_decoders_errors() -> None:
    assert error(lambda: stream({"resumeAfter": {"_data": 1}})).code == 40647
    assert error(lambda: stream({"resumeAfter": {"_data": "zz"}})).code == 9


# -- $changeStreamSplitLargeEvent ---------------------------------------------------------------------
def test_split_stage_rules() -> None:
    split = {"$changeStreamSplitLargeEvent": {}}
    assert stream({}, split, version="7.0")["cursor"]["id"]
    assert stream({}, split, version="6.0")["cursor"]["id"]  # 6.0.20: backported in 6.0.9
    assert error(lambda: stream({}, split, version="6.0.8")).code == 40324
    assert error(lambda: stream({}, split, version="5.0")).code == 40324
    err = error(lambda: stream({}, {"$changeStreamSplitLargeEvent": {"a": 1}}))
    assert (err.code, err.errmsg) == (
        7182800,
        "$changeStreamSplitLargeEvent spec should be an empty object",
    )
    err = error(lambda: stream({}, split, {"$match": {}}))
    assert (err.code, err.errmsg) == (
        7182802,
        "$changeStreamSplitLargeEvent must be the last stage in the pipeline",
    )
    err = error(lambda: run({"aggregate": "c", "pipeline": [split], "cursor": {}}))
    assert (err.code, err.errmsg) == (
        20,
        "$changeStreamSplitLargeEvent can only be used in a $changeStream pipeline",
    )
    fragment = event_token(fragment_num=0)
    err = error(lambda: stream({"resumeAfter": fragment}))
    assert err.code == 280
    assert stream({"resumeAfter": fragment}, split)["cursor"]["id"]


def test_user_stage_specs_are_checked_when_the_stream_opens() -> None:
    assert error(lambda: stream({}, {"$match": 1})).code == 15959
    assert error(lambda: stream({}, {"$project": {}})).code == 51272
    assert error(lambda: stream({}, {"$project": {"a": 1, "b": 0}})).code == 31254
    assert error(lambda: stream({}, {"$addFields": {"a": {"$nope": 1}}})).code == 168
    assert error(lambda: stream({}, {"$unset": 5})).code == 31002
    assert error(lambda: stream({}, {"$match": {"a": {"$bogus": 1}}})).code == 2


# -- plain aggregations -----------------------------------------------------------------------------
def test_plain_aggregation_over_a_collection() -> None:
    d = Deployment(get_profile("8.0"))
    with d.lock:
        state = d.catalog.new_collection("db", "c", {})
        for i in range(5):
            state.insert({"_id": i, "g": i % 2, "v": i})
        d.catalog.new_collection("db", "odd", {"viewOn": "c", "pipeline": [{"$match": {"g": 1}}]})
    body = {
        "aggregate": "c",
        "pipeline": [
            {"$match": {"v": {"$gte": 1}}},
            {"$group": {"_id": "$g", "total": {"$sum": "$v"}}},
            {"$sort": {"_id": 1}},
        ],
        "cursor": {},
    }
    reply, ctx = run(body, d=d)
    assert reply["cursor"]["firstBatch"] == [{"_id": 0, "total": 6}, {"_id": 1, "total": 4}]
    assert reply["cursor"]["id"] == 0 and not ctx.is_change_stream
    paged = {"aggregate": "odd", "pipeline": [{"$project": {"v": 1}}], "cursor": {"batchSize": 1}}
    reply, ctx = run(paged, d=d)
    assert reply["cursor"]["firstBatch"] == [{"_id": 1, "v": 1}]
    cursor = d.cursors.checkout(int(reply["cursor"]["id"]), d.members[0].name)
    rest = cursor.get_more(ctx, None, None)
    assert rest.documents == [{"_id": 3, "v": 3}] and rest.exhausted
    err = error(lambda: run({"aggregate": 1, "pipeline": [{"$match": {}}], "cursor": {}}, d=d))
    assert err.code == 73
