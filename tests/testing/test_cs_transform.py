"""Change events built from synthetic oplog entries: exact fields, order, tokens, scopes.

Each test appends entries with ``Deployment.log`` (the contract the storage
layer follows), opens a stream through the ``aggregate`` handler and reads the
events with one getMore.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp

from changestream.testing.changestreams.resume_token import ResumeTokenData, decode_token
from changestream.testing.commands import (
    REGISTRY,
    CommandContext,
    ConnectionInfo,
    aggregate,  # noqa: F401  (registers "aggregate")
)
from changestream.testing.core.oplog import OplogEntry
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment

NOW = 1_700_000_000.0
VERSIONS = ["4.2", "5.0", "6.0", "7.0", "8.0", "8.2"]
EXPANDED_VERSIONS = ["6.0", "7.0", "8.0", "8.2"]
UUID_A = uuid.UUID("a5093abb-38fe-4b9e-a67f-01bb1a96d812")
UUID_B = uuid.UUID("11111111-2222-4333-8444-555555555555")
WALL = datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc)


def deployment(version: str) -> Deployment:
    return Deployment(get_profile(version), now=lambda: NOW)


def command(d: Deployment, db: str, body: dict[str, Any]) -> dict[str, Any]:
    ctx = CommandContext(
        deployment=d,
        member=d.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db=db,
        name=next(iter(body)),
        body=body,
    )
    with d.lock:
        return REGISTRY["aggregate"].handler(ctx)


def watch(
    d: Deployment, db: str = "db", target: str | int = "c", pipeline: list[Any] | None = None,
    **options: Any,
) -> int:  # fmt: skip
    reply = command(
        d,
        db,
        {
            "aggregate": target,
            "pipeline": [{"$changeStream": options}, *(pipeline or [])],
            "cursor": {},
        },
    )
    assert reply["cursor"]["firstBatch"] == []
    return int(reply["cursor"]["id"])


def events(d: Deployment, cid: int) -> list[dict[str, Any]]:
    cursor = d.cursors.checkout(cid, d.members[0].name)
    ctx = CommandContext(
        deployment=d, member=d.members[0], connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db="db", name="getMore", body={"getMore": Int64(cid)},
    )  # fmt: skip
    batch = cursor.get_more(ctx, None, 0)
    d.cursors.checkin(cid, drop=batch.exhausted)
    return batch.documents


def log(d: Deployment, op: str, ns: str, o: dict[str, Any], **kw: Any) -> OplogEntry:
    with d.lock:
        return d.log(op, ns, o, wall=WALL, **kw)


def head(version: str, *, expanded: bool = False) -> list[str]:
    """``_id, operationType, clusterTime, [collectionUUID], [wallTime]``."""
    fields = ["_id", "operationType", "clusterTime"]
    if expanded:
        fields.append("collectionUUID")
    if get_profile(version).wall_time:
        fields.append("wallTime")
    return fields


# -- CRUD ----------------------------------------------------------------------------------------
SCOPES = {
    "collection": {"db": "db", "target": "c"},
    "database": {"db": "db", "target": 1},
    "cluster": {"db": "admin", "target": 1, "allChangesForCluster": True},
}


@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("version", VERSIONS)
def test_crud_events_have_mongods_fields_in_order(version: str, scope: str) -> None:
    d = deployment(version)
    cid = watch(d, **SCOPES[scope])
    log(d, "i", "db.c", {"_id": 1, "a": 1}, ui=UUID_A, o2={"_id": 1})
    log(d, "u", "db.c", {"$v": 2, "diff": {"u": {"a": 2}, "i": {"b": 3}}}, ui=UUID_A, o2={"_id": 1})
    log(d, "u", "db.c", {"_id": 1, "z": 9}, ui=UUID_A, o2={"_id": 1})
    log(d, "d", "db.c", {"_id": 1}, ui=UUID_A)
    insert, update, replace, delete = events(d, cid)
    base = head(version)
    assert list(insert) == [*base, "fullDocument", "ns", "documentKey"]
    assert list(update) == [*base, "ns", "documentKey", "updateDescription"]
    assert list(replace) == [*base, "fullDocument", "ns", "documentKey"]
    assert list(delete) == [*base, "ns", "documentKey"]
    assert [e["operationType"] for e in (insert, update, replace, delete)] == [
        "insert", "update", "replace", "delete",
    ]  # fmt: skip
    assert insert["fullDocument"] == {"_id": 1, "a": 1}
    assert insert["ns"] == {"db": "db", "coll": "c"}
    assert insert["documentKey"] == {"_id": 1}
    assert replace["fullDocument"] == {"_id": 1, "z": 9}
    description: dict[str, Any] = {"updatedFields": {"a": 2, "b": 3}, "removedFields": []}
    if get_profile(version).v2_update_oplog:
        description["truncatedArrays"] = []
    assert update["updateDescription"] == description
    assert list(update["updateDescription"]) == list(description)
    if get_profile(version).wall_time:
        assert insert["wallTime"] == WALL
    assert insert["clusterTime"] == Timestamp(int(NOW), 3)  # after the "initiating set" no-op


@pytest.mark.parametrize("version", VERSIONS)
def test_event_tokens_decode_to_the_event(version: str) -> None:
    d = deployment(version)
    cid = watch(d)
    entry = log(d, "i", "db.c", {"_id": 7}, ui=UUID_A, o2={"_id": 7})
    (event,) = events(d, cid)
    data = decode_token(event["_id"])
    token_version = get_profile(version).token_version
    identifier: Any = {"_id": 7}
    if token_version == 2:
        identifier = {"operationType": "insert", "documentKey": {"_id": 7}}
    assert data == ResumeTokenData(entry.ts, token_version, 128, 0, False, UUID_A, identifier)


def test_v2_insert_token_bytes_match_mongod() -> None:
    """server-notes §1.5: the v2 insert token of ``{_id: 1}`` at (1700000000, 3)."""
    d = deployment("8.0")
    cid = watch(d)
    log(d, "i", "db.c", {"_id": 1}, ui=UUID_A, o2={"_id": 1})
    (event,) = events(d, cid)
    assert event["_id"] == {
        "_data": "826553F100000000032B042C0100296E5A1004A5093ABB38FE4B9EA67F01BB1A96D812463C6F"
        "7065726174696F6E54797065003C696E736572740046646F63756D656E744B657900461E5F6964002B"
        "02000004"
    }


def test_generate_v2_resume_tokens_overrides_the_default() -> None:
    d = deployment("8.0")
    reply = command(
        d, "db",
        {"aggregate": "c", "pipeline": [{"$changeStream": {}}], "cursor": {},
         "$_generateV2ResumeTokens": False},
    )  # fmt: skip
    log(d, "i", "db.c", {"_id": 1}, ui=UUID_A, o2={"_id": 1})
    (event,) = events(d, int(reply["cursor"]["id"]))
    assert decode_token(event["_id"]).version == 1
    assert decode_token(reply["cursor"]["postBatchResumeToken"]).version == 1


@pytest.mark.parametrize("version", EXPANDED_VERSIONS)
def test_show_expanded_events_adds_collection_uuid(version: str) -> None:
    d = deployment(version)
    cid = watch(d, showExpandedEvents=True)
    log(d, "i", "db.c", {"_id": 1}, ui=UUID_A, o2={"_id": 1})
    (event,) = events(d, cid)
    assert list(event) == [*head(version, expanded=True), "fullDocument", "ns", "documentKey"]
    assert event["collectionUUID"] == UUID_A


@pytest.mark.parametrize(("version", "expected"), [("6.0", False), ("7.0", True), ("8.0", True)])
def test_disambiguated_paths_need_61_and_expanded_events(version: str, expected: bool) -> None:
    d = deployment(version)
    cid = watch(d, showExpandedEvents=True)
    plain = watch(d)
    diff = {"sa": {"s0": {"u": {"x": 5}}}}  # field "0" of object "a": an ambiguous path
    log(d, "u", "db.c", {"$v": 2, "diff": diff}, ui=UUID_A, o2={"_id": 1})
    (event,) = events(d, cid)
    description = event["updateDescription"]
    assert description["updatedFields"] == {"a.0.x": 5}
    assert ("disambiguatedPaths" in description) is expected
    if expected:
        assert description["disambiguatedPaths"] == {"a.0.x": ["a", "0", "x"]}
    assert "disambiguatedPaths" not in events(d, plain)[0]["updateDescription"]


def test_show_raw_update_description() -> None:
    d = deployment("8.0")
    cid = watch(d, showRawUpdateDescription=True)
    o = {"$v": 2, "diff": {"u": {"a": 2}}}
    log(d, "u", "db.c", o, ui=UUID_A, o2={"_id": 1})
    (event,) = events(d, cid)
    assert event["rawUpdateDescription"] == o
    assert "updateDescription" not in event


# -- DDL and invalidation ---------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_drop_then_invalidate_closes_a_collection_stream(version: str) -> None:
    d = deployment(version)
    cid = watch(d)
    entry = log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    drop, invalidate = events(d, cid)
    assert list(drop) == [*head(version), "ns"]
    assert drop["ns"] == {"db": "db", "coll": "c"}
    assert list(invalidate) == head(version)
    assert invalidate["operationType"] == "invalidate"
    assert invalidate["clusterTime"] == entry.ts
    drop_token, invalidate_token = decode_token(drop["_id"]), decode_token(invalidate["_id"])
    assert invalidate_token.from_invalidate and not drop_token.from_invalidate
    assert invalidate_token == ResumeTokenData(
        drop_token.cluster_time, drop_token.version, 128, 0, True, UUID_A,
        drop_token.event_identifier,
    )  # fmt: skip
    assert d.cursors.ids() == []


@pytest.mark.parametrize("version", VERSIONS)
def test_rename_has_to_before_id(version: str) -> None:
    d = deployment(version)
    cid = watch(d)
    log(d, "c", "db.$cmd", {"renameCollection": "db.c", "to": "db.d", "stayTemp": False}, ui=UUID_A)
    rename, invalidate = events(d, cid)
    assert list(rename) == ["to", *head(version), "ns"]
    assert rename["to"] == {"db": "db", "coll": "d"}
    assert rename["ns"] == {"db": "db", "coll": "c"}
    assert invalidate["operationType"] == "invalidate"


@pytest.mark.parametrize("version", EXPANDED_VERSIONS)
def test_rename_operation_description_with_drop_target(version: str) -> None:
    d = deployment(version)
    cid = watch(d, target="d", showExpandedEvents=True)  # the rename's target collection
    o = {"renameCollection": "db.c", "to": "db.d", "stayTemp": False, "dropTarget": UUID_B}
    log(d, "c", "db.$cmd", o, ui=UUID_A)
    rename, invalidate = events(d, cid)
    assert list(rename) == ["to", *head(version, expanded=True), "ns", "operationDescription"]
    assert rename["operationDescription"] == {"to": {"db": "db", "coll": "d"}, "dropTarget": UUID_B}
    assert list(rename["operationDescription"]) == ["to", "dropTarget"]
    identifier = decode_token(rename["_id"]).event_identifier
    if get_profile(version).token_version == 2:
        op_desc = rename["operationDescription"]
        assert identifier == {"operationType": "rename", "operationDescription": op_desc}
    else:  # v1: classic events without a documentKey have no eventIdentifier
        assert identifier is None
    assert invalidate["operationType"] == "invalidate"


@pytest.mark.parametrize("version", VERSIONS)
def test_drop_database_invalidates_database_streams_only(version: str) -> None:
    d = deployment(version)
    db_stream = watch(d, target=1)
    cluster = watch(d, db="admin", target=1, allChangesForCluster=True)
    log(d, "c", "db.$cmd", {"drop": "c"}, ui=UUID_A)
    log(d, "c", "db.$cmd", {"dropDatabase": 1})
    drop, drop_db, invalidate = events(d, db_stream)
    assert drop["operationType"] == "drop"
    assert list(drop_db) == [*head(version), "ns"]
    assert drop_db["ns"] == {"db": "db"}
    assert invalidate["operationType"] == "invalidate"
    assert [e["operationType"] for e in events(d, cluster)] == ["drop", "dropDatabase"]
    assert d.cursors.ids() == [cluster]


@pytest.mark.parametrize("version", EXPANDED_VERSIONS)
def test_expanded_ddl_events(version: str) -> None:
    d = deployment(version)
    cid = watch(d, target=1, showExpandedEvents=True)
    plain = watch(d, target=1)
    id_index = {"v": 2, "key": {"_id": 1}, "name": "_id_"}
    log(d, "c", "db.$cmd", {"create": "c", "idIndex": id_index}, ui=UUID_A)
    log(
        d, "c", "db.$cmd", {"createIndexes": "c", "v": 2, "key": {"x": 1}, "name": "x_1"}, ui=UUID_A
    )
    log(d, "c", "db.$cmd", {"dropIndexes": "c", "index": "x_1"}, ui=UUID_A,
        o2={"v": 2, "key": {"x": 1}, "name": "x_1"})  # fmt: skip
    log(d, "c", "db.$cmd", {"collMod": "c", "validationLevel": "off"}, ui=UUID_A,
        o2={"collectionOptions_old": {"uuid": UUID_A}})  # fmt: skip
    create, create_index, drop_index, modify = events(d, cid)
    base = [*head(version, expanded=True), "ns", "operationDescription"]
    ns_type = ["nsType"] if get_profile(version).ns_type else []
    assert list(create) == [*base, *ns_type]
    assert create["operationDescription"] == {"idIndex": id_index}
    if ns_type:
        assert create["nsType"] == "collection"
    assert list(create_index) == base
    assert create_index["operationType"] == "createIndexes"
    assert create_index["operationDescription"] == {
        "indexes": [{"v": 2, "key": {"x": 1}, "name": "x_1"}]
    }
    assert drop_index["operationDescription"] == {
        "indexes": [{"v": 2, "key": {"x": 1}, "name": "x_1"}]
    }
    assert list(modify) == [*base, "stateBeforeChange"]
    assert modify["operationDescription"] == {"validationLevel": "off"}
    assert modify["stateBeforeChange"] == {"collectionOptions": {"uuid": UUID_A}}
    assert events(d, plain) == []  # classic streams never see DDL events


@pytest.mark.parametrize("version", ["6.0", "8.2"])
def test_view_events_come_from_system_views_writes(version: str) -> None:
    d = deployment(version)
    cid = watch(d, target=1, showExpandedEvents=True)
    cluster = watch(d, db="admin", target=1, allChangesForCluster=True, showExpandedEvents=True)
    coll_stream = watch(d, target="v", showExpandedEvents=True)
    classic = watch(d, target=1)
    definition = {"_id": "db.v", "viewOn": "c", "pipeline": [{"$match": {"a": 1}}]}
    changed = {**definition, "pipeline": []}
    log(d, "i", "db.system.views", definition, ui=UUID_B, o2={"_id": "db.v"})
    log(d, "u", "db.system.views", changed, ui=UUID_B, o2={"_id": "db.v"})
    log(d, "d", "db.system.views", {"_id": "db.v"}, ui=UUID_B)
    create, modify, drop = events(d, cid)
    assert events(d, cluster) == [create, modify, drop]
    ns_type = ["nsType"] if get_profile(version).ns_type else []
    assert list(create) == [*head(version), "ns", "operationDescription", *ns_type]
    assert list(modify) == [*head(version), "ns", "operationDescription"]
    assert list(drop) == [*head(version), "ns"]  # no collectionUUID: views have none
    assert [e["operationType"] for e in (create, modify, drop)] == ["create", "modify", "drop"]
    assert {str(e["ns"]) for e in (create, modify, drop)} == {str({"db": "db", "coll": "v"})}
    assert create["operationDescription"] == {"viewOn": "c", "pipeline": [{"$match": {"a": 1}}]}
    assert modify["operationDescription"] == {"viewOn": "c", "pipeline": []}
    if ns_type:
        assert create["nsType"] == "view"
    tokens = [decode_token(e["_id"]) for e in (create, modify, drop)]
    assert {t.uuid for t in tokens} == {UUID_B}  # the system.views collection's UUID
    token_version = get_profile(version).token_version
    assert tokens[2].event_identifier == ({"operationType": "drop"} if token_version == 2 else None)
    assert events(d, coll_stream) == [] and events(d, classic) == []


# -- scopes --------------------------------------------------------------------------------------------
def test_scopes_see_the_right_namespaces() -> None:
    d = deployment("8.0")
    coll = watch(d)
    db_stream = watch(d, target=1)
    cluster = watch(d, db="admin", target=1, allChangesForCluster=True)
    for ns in ("db.c", "db.other", "db.system.views", "other.c", "admin.x", "config.x", "local.x"):
        log(d, "i", ns, {"_id": ns}, ui=UUID_A, o2={"_id": ns})
    seen = {
        name: [e["documentKey"]["_id"] for e in events(d, cid)]
        for name, cid in (("coll", coll), ("db", db_stream), ("cluster", cluster))
    }
    assert seen == {
        "coll": ["db.c"],
        "db": ["db.c", "db.other"],
        "cluster": ["db.c", "db.other", "other.c"],
    }


def test_collection_stream_sees_drop_database_of_its_database() -> None:
    d = deployment("7.0")
    cid = watch(d)
    other = watch(d, db="other", target="c")
    log(d, "c", "db.$cmd", {"dropDatabase": 1})
    assert [e["operationType"] for e in events(d, cid)] == ["dropDatabase", "invalidate"]
    assert events(d, other) == []


# -- transactions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_transaction_events(version: str) -> None:
    d = deployment(version)
    cid = watch(d)
    lsid = {"id": uuid.UUID(int=5), "uid": b"\x00" * 32}
    ts = d.clock.tick()
    inner = [
        OplogEntry(ts=ts, wall=WALL, op="i", ns="db.c", o={"_id": 1}, ui=UUID_A, o2={"_id": 1}),
        OplogEntry(ts=ts, wall=WALL, op="i", ns="db.other", o={"_id": 2}, ui=UUID_B, o2={"_id": 2}),
        OplogEntry(ts=ts, wall=WALL, op="d", ns="db.c", o={"_id": -5}, ui=UUID_A),
    ]
    log(
        d, "c", "admin.$cmd", {"applyOps": []}, lsid=lsid, txn_number=Int64(3), txn_ops=inner, ts=ts
    )
    first, second = events(d, cid)
    assert list(first) == ["txnNumber", "lsid", *head(version), "fullDocument", "ns", "documentKey"]
    assert first["txnNumber"] == Int64(3) and isinstance(first["txnNumber"], Int64)
    assert first["lsid"] == lsid
    assert first["clusterTime"] == second["clusterTime"] == ts
    assert [decode_token(e["_id"]).txn_op_index for e in (first, second)] == [0, 2]
    assert second["operationType"] == "delete"
