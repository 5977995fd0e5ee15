"""Behaviours where the simulator follows mongod closely, checked through PyMongo (and raw
sockets for the wire layer): split events on 6.0.9+, wire compression, the 8.0 ``bulkWrite``
command, retryable-write de-duplication, session kills, index builds, view DDL events and
Decimal128 resume tokens."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from bson.decimal128 import Decimal128
from pymongo import IndexModel, MongoClient
from pymongo.errors import CursorNotFound, OperationFailure
from pymongo.operations import DeleteMany, InsertOne, UpdateMany, UpdateOne

from changestream.testing import ReplicaSet
from changestream.testing.changestreams.resume_token import decode_token

Client = MongoClient[dict[str, Any]]
MIB = 1024 * 1024
AWAIT_MS = 50


# -- 1. $changeStreamSplitLargeEvent on 6.0.9+ -------------------------------------------------------
def test_split_large_event_works_on_6_0_with_v2_fragment_tokens(
    start_rs: Any, clients: Any
) -> None:
    rs = start_rs("6.0")
    db = clients(rs.uri).db
    coll = db.create_collection("c", changeStreamPreAndPostImages={"enabled": True})
    coll.insert_one({"_id": 1, "big": "a" * (10 * MIB)})
    split = [{"$changeStreamSplitLargeEvent": {}}]
    with (
        coll.watch(max_await_time_ms=AWAIT_MS) as plain,
        coll.watch(
            split, full_document_before_change="required", max_await_time_ms=AWAIT_MS
        ) as stream,
    ):
        coll.update_one({"_id": 1}, {"$set": {"big": "b" * (10 * MIB)}})
        fragments = [stream.next(), stream.next()]
        assert decode_token(plain.next()["_id"]).version == 1  # 6.0's default
    assert [f["splitEvent"] for f in fragments] == [
        {"fragment": 1, "of": 2},
        {"fragment": 2, "of": 2},
    ]
    tokens = [decode_token(f["_id"]) for f in fragments]
    assert [(t.version, t.fragment_num) for t in tokens] == [(2, 0), (2, 1)]


def test_split_large_event_is_unknown_before_6_0_9(start_rs: Any, clients: Any) -> None:
    coll = clients(start_rs("6.0.8").uri).db.c
    with pytest.raises(OperationFailure) as info:
        coll.watch([{"$changeStreamSplitLargeEvent": {}}])
    assert info.value.code == 40324
    assert clients(start_rs("6.0.8").uri).admin.command("buildInfo")["version"] == "6.0.8"


# -- 2. wire compression ----------------------------------------------------------------------------
def test_pymongo_zlib_compression_round_trips_requests_and_replies(
    start_rs: Any, clients: Any
) -> None:
    rs = start_rs("8.0")
    plain, zipped = clients(rs.uri), clients(rs.uri, compressors="zlib")
    before = plain.admin.command("serverStatus")["network"]["compression"]["zlib"]
    coll = zipped.db.c
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.insert_many([{"_id": i, "text": "abc" * 2000} for i in range(20)])
        assert [stream.next()["documentKey"]["_id"] for _ in range(20)] == list(range(20))
    assert [d["_id"] for d in coll.find({}, batch_size=5)] == list(range(20))
    after = plain.admin.command("serverStatus")["network"]
    zlib_after = after["compression"]["zlib"]
    # requests arrived compressed, replies left compressed, and both shrank on the wire
    inflated = zlib_after["decompressor"]["bytesOut"] - before["decompressor"]["bytesOut"]
    deflated = zlib_after["decompressor"]["bytesIn"] - before["decompressor"]["bytesIn"]
    assert inflated > 20 * 6000 > deflated > 0
    sent = zlib_after["compressor"]["bytesIn"] - before["compressor"]["bytesIn"]
    sent_wire = zlib_after["compressor"]["bytesOut"] - before["compressor"]["bytesOut"]
    assert sent > 2 * 20 * 6000 > sent_wire > 0  # the change events and the find batches
    assert after["physicalBytesOut"] < after["bytesOut"]
    assert list(after["compression"]) == ["zlib"]  # mongod's default minus what is missing here


# -- 4. retryable writes ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "failpoint",
    [
        pytest.param(
            {"configureFailPoint": "onPrimaryTransactionalWrite", "mode": {"times": 1},
             "data": {"closeConnection": True}},
            id="reply-lost-after-the-write",
        ),
        pytest.param(
            {"configureFailPoint": "failCommand", "mode": {"times": 1},
             "data": {"failCommands": ["insert"], "writeConcernError": {"code": 262,
                                                                       "errmsg": "down"}}},
            id="retryable-write-concern-error",
        ),
        pytest.param(
            {"configureFailPoint": "failCommand", "mode": {"times": 1},
             "data": {"failCommands": ["insert"], "closeConnection": True}},
            id="connection-closed-before-the-write",
        ),
    ],
)  # fmt: skip
def test_a_retried_insert_writes_once_and_yields_one_event(
    start_rs: Any, clients: Any, failpoint: dict[str, Any]
) -> None:
    rs = start_rs("8.0")
    client = clients(rs.uri, retryWrites=True)
    coll = client.db.c
    coll.insert_one({"_id": 0})
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        client.admin.command(failpoint)
        seq = rs.deployment.oplog.end_seq
        assert coll.insert_one({"_id": 1, "x": 1}).acknowledged
        assert list(coll.find({}, sort=[("_id", 1)])) == [{"_id": 0}, {"_id": 1, "x": 1}]
        event = stream.next()
        assert (event["operationType"], event["documentKey"]) == ("insert", {"_id": 1})
        assert "lsid" not in event and "txnNumber" not in event  # only transaction events
        assert stream.try_next() is None
    (entry,) = [e for e in rs.deployment.oplog.read(seq) if e.op == "i"]
    assert entry.txn_number is not None and entry.stmt_id == 0
    assert entry.lsid is not None and set(entry.lsid) == {"id", "uid"}


# -- 3. the bulkWrite command -----------------------------------------------------------------------
def _entries(rs: ReplicaSet, seq: int) -> list[tuple[Any, ...]]:
    """The CRUD oplog entries from ``seq`` on, without timestamps and session fields."""
    return [(e.op, e.ns, e.o, e.o2) for e in rs.deployment.oplog.read(seq) if e.op in "iud"]


def test_client_bulk_write_across_namespaces(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0")
    client = clients(rs.uri)
    client.db.a.insert_one({"_id": 1, "n": 0})
    ops = [
        InsertOne({"_id": 2}, namespace="db.a"),
        InsertOne({"_id": 7, "x": 1}, namespace="other.b"),
        UpdateOne({"_id": 1}, {"$inc": {"n": 1}}, namespace="db.a"),
        UpdateOne({"_id": 3}, {"$set": {"n": 5}}, upsert=True, namespace="db.a"),
        UpdateMany({}, {"$set": {"k": 1}}, namespace="db.a"),
        DeleteMany({}, namespace="other.b"),
    ]
    with client.watch(max_await_time_ms=AWAIT_MS) as stream:
        seq = rs.deployment.oplog.end_seq
        result = client.bulk_write(ops, verbose_results=True)
        kinds = [(e["operationType"], e["ns"]["coll"]) for e in (stream.next() for _ in range(8))]
    assert (result.inserted_count, result.matched_count, result.modified_count) == (2, 4, 4)
    assert (result.upserted_count, result.deleted_count) == (1, 1)
    assert result.update_results[3].upserted_id == 3
    assert kinds == [("insert", "a"), ("insert", "b"), ("update", "a"), ("insert", "a"),
                     ("update", "a"), ("update", "a"), ("update", "a"), ("delete", "b")]  # fmt: skip
    bulk_entries = _entries(rs, seq)
    # the same writes through insert/update/delete log exactly the same entries
    for name in ("a", "b"):
        client.db.drop_collection(name)
    client.other.drop_collection("b")
    client.db.a.insert_one({"_id": 1, "n": 0})
    seq = rs.deployment.oplog.end_seq
    client.db.a.insert_one({"_id": 2})
    client.other.b.insert_one({"_id": 7, "x": 1})
    client.db.a.update_one({"_id": 1}, {"$inc": {"n": 1}})
    client.db.a.update_one({"_id": 3}, {"$set": {"n": 5}}, upsert=True)
    client.db.a.update_many({}, {"$set": {"k": 1}})
    client.other.b.delete_many({})
    assert _entries(rs, seq) == bulk_entries


def test_bulk_write_reply_shape_errors_and_cursor(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0")
    admin = clients(rs.uri).admin
    command = {
        "bulkWrite": 1,
        "ops": [
            {"insert": 0, "document": {"_id": 1}},
            {"insert": 0, "document": {"_id": 1}},
            {"update": 0, "filter": {"_id": 1}, "updateMods": {"$set": {"a": 1}}},
            {"delete": 0, "filter": {"_id": 1}},
        ],
        "nsInfo": [{"ns": "db.c"}],
        "ordered": False,
        "cursor": {"batchSize": 2},
    }
    reply = admin.command(command)
    assert list(reply) == ["cursor", "nErrors", "nInserted", "nMatched", "nModified", "nUpserted",
                           "nDeleted", "electionId", "opTime", "ok", "$clusterTime",
                           "operationTime"]  # fmt: skip
    assert list(reply["cursor"]) == ["id", "firstBatch", "ns"]
    assert reply["cursor"]["ns"] == "admin.$cmd.bulkWrite" and reply["cursor"]["id"]
    assert reply["cursor"]["firstBatch"] == [
        {"ok": 1.0, "idx": 0, "n": 1},
        {"ok": 0.0, "idx": 1, "code": 11000,
         "errmsg": "E11000 duplicate key error collection: db.c index: _id_ dup key: { _id: 1 }",
         "keyPattern": {"_id": 1}, "keyValue": {"_id": 1}, "n": 0},
    ]  # fmt: skip
    rest = admin.command({"getMore": reply["cursor"]["id"], "collection": "$cmd.bulkWrite"})
    assert rest["cursor"]["nextBatch"] == [
        {"ok": 1.0, "idx": 2, "n": 1, "nModified": 1},
        {"ok": 1.0, "idx": 3, "n": 1},
    ]
    counts = {k: reply[k] for k in ("nErrors", "nInserted", "nMatched", "nModified", "nDeleted")}
    assert counts == {"nErrors": 1, "nInserted": 1, "nMatched": 1, "nModified": 1, "nDeleted": 1}
    errors_only = admin.command({**command, "ordered": True, "errorsOnly": True, "cursor": {}})
    assert [i["idx"] for i in errors_only["cursor"]["firstBatch"]] == [1]  # only the error
    assert (errors_only["nErrors"], errors_only["nInserted"], errors_only["nModified"]) == (1, 1, 0)
    bad = {"bulkWrite": 1, "ops": [{"insert": 1, "document": {}}], "nsInfo": [{"ns": "db.c"}]}
    with pytest.raises(OperationFailure) as info:
        admin.command(bad)
    assert info.value.code == 2
    with pytest.raises(OperationFailure) as info:
        clients(rs.uri).db.command(command)
    assert info.value.code == 13  # admin only


def test_bulk_write_does_not_exist_before_8_0(start_rs: Any, clients: Any) -> None:
    admin = clients(start_rs("7.0").uri).admin
    with pytest.raises(OperationFailure) as info:
        admin.command({"bulkWrite": 1, "ops": [{"insert": 0, "document": {}}],
                       "nsInfo": [{"ns": "db.c"}]})  # fmt: skip
    assert (info.value.code, info.value.details["errmsg"]) == (59, "no such command: 'bulkWrite'")


def test_retried_bulk_write_is_not_applied_twice(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0")
    client = clients(rs.uri, retryWrites=True)
    client.admin.command({"configureFailPoint": "onPrimaryTransactionalWrite",
                          "mode": {"times": 1}})  # fmt: skip
    result = client.bulk_write(
        [InsertOne({"_id": 1}, namespace="db.c"),
         UpdateOne({"_id": 1}, {"$inc": {"n": 1}}, namespace="db.c")]
    )  # fmt: skip
    assert (result.inserted_count, result.modified_count) == (1, 1)
    assert list(client.db.c.find()) == [{"_id": 1, "n": 1}]


# -- 5. killSessions / killAllSessions / endSessions ------------------------------------------------
def _open_session_work(client: Client) -> tuple[Any, Any, Any, Any]:
    """Sessions: one with an open transaction, one with a cursor, one with another cursor."""
    client.db.c.insert_many([{"_id": i} for i in range(5)])
    in_txn, with_cursor, bystander = (client.start_session() for _ in range(3))
    in_txn.start_transaction()
    client.db.c.insert_one({"_id": "in-txn"}, session=in_txn)
    numbers = {"_id": {"$type": "int"}}  # the simulator has no snapshot isolation
    mine = client.db.c.find(numbers, batch_size=2, session=with_cursor)
    next(mine)
    other = client.db.c.find(numbers, batch_size=2, session=bystander)
    next(other)
    return in_txn, with_cursor, mine, other


def test_kill_sessions_aborts_transactions_and_kills_cursors(start_rs: Any, clients: Any) -> None:
    client = clients(start_rs("8.0").uri)
    in_txn, with_cursor, mine, other = _open_session_work(client)
    client.admin.command("killSessions", [in_txn.session_id, with_cursor.session_id])
    with pytest.raises(OperationFailure) as info:
        in_txn.commit_transaction()
    assert info.value.code == 251  # NoSuchTransaction: the kill aborted it
    assert client.db.c.count_documents({"_id": "in-txn"}) == 0
    with pytest.raises(CursorNotFound):
        list(mine)
    assert len(list(other)) == 4  # another session's cursor is untouched


def test_kill_all_sessions_kills_every_session(start_rs: Any, clients: Any) -> None:
    client = clients(start_rs("8.0").uri)
    in_txn, _, mine, other = _open_session_work(client)
    client.admin.command("killAllSessions", [{"user": "nobody", "db": "admin"}])
    # no session belongs to a named user without auth: the cursor still has its getMores
    assert [next(other), next(other)] == [{"_id": 1}, {"_id": 2}]
    client.admin.command("killAllSessions", [])
    for cursor in (mine, other):
        with pytest.raises(CursorNotFound):
            list(cursor)
    with pytest.raises(OperationFailure) as info:
        in_txn.commit_transaction()
    assert info.value.code == 251


def test_end_sessions_kills_nothing_at_once(start_rs: Any, clients: Any) -> None:
    client = clients(start_rs("8.0").uri)
    in_txn, with_cursor, mine, _ = _open_session_work(client)
    client.admin.command("endSessions", [in_txn.session_id, with_cursor.session_id])
    assert len(list(mine)) == 4  # mongod reaps ended sessions at its next cache refresh
    in_txn.commit_transaction()
    assert client.db.c.count_documents({"_id": "in-txn"}) == 1


# -- 6. index builds --------------------------------------------------------------------------------
def test_index_build_on_a_non_empty_collection_is_one_event(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0")
    db = clients(rs.uri).db
    db.full.insert_one({"_id": 1, "a": 1, "b": 1})
    db.create_collection("empty")
    models = [IndexModel("a"), IndexModel([("b", -1)], name="b_desc", sparse=True)]
    with db.watch(show_expanded_events=True, max_await_time_ms=AWAIT_MS) as stream:
        seq = rs.deployment.oplog.end_seq
        db.full.create_indexes(models)
        db.empty.create_indexes(models)
        events = [stream.next() for _ in range(3)]
        assert stream.try_next() is None
    indexes = [
        {"v": 2, "key": {"a": 1}, "name": "a_1"},
        {"v": 2, "key": {"b": -1}, "name": "b_desc", "sparse": True},
    ]
    assert (
        [(e["ns"]["coll"], e["operationDescription"]) for e in events]
        == [
            ("full", {"indexes": indexes}),  # commitIndexBuild: the whole build at once
            ("empty", {"indexes": indexes[:1]}),  # createIndexes entries: one per index
            ("empty", {"indexes": indexes[1:]}),
        ]
    )
    start, commit = [e.o for e in rs.deployment.oplog.read(seq)][:2]
    assert list(start) == ["startIndexBuild", "indexBuildUUID", "indexes"]
    assert list(commit) == ["commitIndexBuild", "indexBuildUUID", "indexes"]
    assert start["indexBuildUUID"] == commit["indexBuildUUID"]


def test_a_failed_index_build_is_aborted_without_an_event(start_rs: Any, clients: Any) -> None:
    rs = start_rs("8.0")
    db = clients(rs.uri).db
    db.c.insert_many([{"u": 1}, {"u": 1}])
    with db.watch(show_expanded_events=True, max_await_time_ms=AWAIT_MS) as stream:
        seq = rs.deployment.oplog.end_seq
        with pytest.raises(OperationFailure) as info:
            db.c.create_index("u", unique=True)
        assert info.value.code == 11000
        assert stream.try_next() is None
    kinds = [next(iter(e.o)) for e in rs.deployment.oplog.read(seq)]
    assert kinds == ["startIndexBuild", "abortIndexBuild"]
    cause = rs.deployment.oplog.read(seq)[1].o["cause"]
    assert (cause["ok"], cause["code"], cause["keyValue"]) == (False, 11000, {"u": 1})
    assert [i["name"] for i in db.c.list_indexes()] == ["_id_"]


# -- 7. view DDL in change streams ------------------------------------------------------------------
def test_view_create_modify_drop_events(start_rs: Any, clients: Any) -> None:
    db = clients(start_rs("8.0").uri).db
    db.create_collection("base")
    pipeline = [{"$match": {"a": 2}}, {"$project": {"a": 1}}]
    with (
        db.watch(show_expanded_events=True, max_await_time_ms=AWAIT_MS) as stream,
        db.base.watch(show_expanded_events=True, max_await_time_ms=AWAIT_MS) as base_stream,
    ):
        db.create_collection("view", viewOn="base", pipeline=pipeline)
        db.command("collMod", "view", viewOn="base", pipeline=[])
        db.drop_collection("view")
        db.base.insert_one({"_id": 1})
        got = [stream.next() for _ in range(4)]
        assert base_stream.next()["operationType"] == "insert"  # no view events there
    assert [(e["operationType"], e["ns"]) for e in got] == [
        ("create", {"db": "db", "coll": "view"}),
        ("modify", {"db": "db", "coll": "view"}),
        ("drop", {"db": "db", "coll": "view"}),
        ("insert", {"db": "db", "coll": "base"}),
    ]
    assert got[0]["operationDescription"] == {"viewOn": "base", "pipeline": pipeline}
    assert got[1]["operationDescription"] == {"viewOn": "base", "pipeline": []}
    assert "operationDescription" not in got[2] and "collectionUUID" not in got[2]
    for before, after in itertools.pairwise(got):  # every view event is a resume point
        with db.watch(resume_after=before["_id"], show_expanded_events=True) as resumed:
            assert resumed.next() == after
    with db.watch(max_await_time_ms=AWAIT_MS) as classic:
        db.create_collection("view2", viewOn="base")
        db.base.insert_one({"_id": 2})
        assert classic.next()["operationType"] == "insert"  # without showExpandedEvents: nothing


# -- 8. Decimal128 in resume tokens -----------------------------------------------------------------
@pytest.mark.parametrize("version", ["6.0", "8.0"])
def test_decimal_ids_get_resumable_tokens(start_rs: Any, clients: Any, version: str) -> None:
    coll = clients(start_rs(version).uri).db.c
    ids = [Decimal128("19.99"), Decimal128("1.50"), Decimal128("-3.141592653589793238462643")]
    with coll.watch(max_await_time_ms=AWAIT_MS) as stream:
        coll.insert_many([{"_id": i} for i in ids])
        tokens = [stream.next()["_id"] for _ in ids]
    data = decode_token(tokens[1])
    key = data.event_identifier if data.version == 1 else data.event_identifier["documentKey"]
    assert key["_id"].bid == Decimal128("1.50").bid  # the exponent survives the token
    assert tokens == sorted(tokens, key=lambda t: t["_data"])  # still ordered by _data
    with coll.watch(resume_after=tokens[0], max_await_time_ms=AWAIT_MS) as resumed:
        assert [resumed.next()["documentKey"]["_id"] for _ in ids[1:]] == ids[1:]


def _fcv_error(client: Any, value: Any, **options: Any) -> tuple[int, str]:
    with pytest.raises(OperationFailure) as refused:
        client.admin.command("setFeatureCompatibilityVersion", value, **options)
    return refused.value.code, str(refused.value.details["errmsg"])


@pytest.mark.parametrize(
    ("version", "accepted", "refused"),
    [
        ("9.0", ["8.3", "8.0", "9.0"], "8.2"),
        ("8.3", ["8.2", "8.0"], "7.0"),
        ("7.0", ["6.0"], "8.0"),
    ],
)
def test_set_fcv_accepts_latest_last_continuous_and_last_lts_only(
    start_rs: Any, clients: Any, version: str, accepted: list[str], refused: str
) -> None:
    """mongod's ``validFcvVersions`` (feature_compatibility_version_parser.cpp), its text
    with its stray quote; the value is checked before ``confirm``."""
    client = clients(start_rs(version).uri)
    for value in accepted:
        client.admin.command("setFeatureCompatibilityVersion", value, confirm=True)
        fcv = client.admin.command("getParameter", 1, featureCompatibilityVersion=1)
        assert fcv["featureCompatibilityVersion"] == {"version": value}
    code, message = _fcv_error(client, refused)
    valid = {"9.0": "'9.0', '8.3', '8.0'", "8.3": "'8.3', '8.2', '8.0'", "7.0": "'7.0', '6.0'"}
    lts = valid[version].rsplit("'", 2)[-2]
    assert (code, message) == (
        4926900,
        f"Invalid feature compatibility version value '{refused}'. Expected one of the "
        f"following versions: '{valid[version]}. See https://docs.mongodb.com/master/"
        f"release-notes/{lts}-compatibility/#feature-compatibility.",
    )


def test_set_fcv_needs_confirm_even_for_the_current_value_and_names_bson_types(
    start_rs: Any, clients: Any
) -> None:
    client = clients(start_rs("9.0").uri)
    code, message = _fcv_error(client, "9.0")
    assert code == 7369100
    assert message.startswith("Once you have downgraded the FCV")  # mongod: not an upgrade
    code, message = _fcv_error(client, 9.0, confirm=True)
    assert (code, message) == (
        14,
        "BSON field 'setFeatureCompatibilityVersion.setFeatureCompatibilityVersion' is the "
        "wrong type 'double', expected type 'string'",
    )
