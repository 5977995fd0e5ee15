"""CRUD behaviour PyMongo's own suites expect, checked with PyMongo as the client.

Each test names the mongod behaviour it checks and where it comes from (mongod's
source under ``src/mongo``, a jstest, or the manual).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from bson.code import Code
from pymongo import CursorType, MongoClient, ReadPreference
from pymongo.errors import NotPrimaryError, OperationFailure, WriteConcernError, WriteError
from pymongo.write_concern import WriteConcern

from changestream.testing import ReplicaSet

Client = MongoClient[dict[str, Any]]


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0", members=3, noop_interval=0) as replica_set:
        yield replica_set


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[Client]:
    c: Client = MongoClient(rs.uri)
    yield c
    c.close()


@pytest.fixture
def db(client: Client, request: pytest.FixtureRequest) -> Any:
    database = client[f"crud_{request.node.name[:40]}"]
    client.drop_database(database.name)
    return database


def test_aggregate_first_in_a_transaction_starts_it(client: Client, db: Any) -> None:
    # mongod: any read or write with startTransaction starts the transaction, aggregate
    # included (TransactionParticipant::beginOrContinue from service_entry_point_common.cpp);
    # committing it then succeeds (before the fix: NoSuchTransaction, 251).
    db.create_collection("t")
    db.t.insert_one({"a": 1})
    with client.start_session() as session, session.start_transaction():
        assert [d["a"] for d in db.t.aggregate([{"$match": {}}], session=session)] == [1]
        db.t.insert_one({"a": 2}, session=session)
    assert db.t.count_documents({}) == 2


def test_projection_of_id_alone_is_an_inclusion(db: Any) -> None:
    # mongod: {_id: 1} alone is an inclusion projection (projection_policies /
    # "Projection" in the manual: "_id: 1" returns only _id); {_id: 0} alone excludes it.
    db.p.insert_one({"_id": 1, "a": 1, "b": 2})
    assert db.p.find_one({}, {"_id": 1}) == {"_id": 1}
    assert db.p.find_one({}, {"_id": 0}) == {"a": 1, "b": 2}
    assert list(db.p.aggregate([{"$project": {"_id": 1}}])) == [{"_id": 1}]
    db.p.insert_one({"_id": 2, "arr": [1, 2, 3], "c": 1})
    assert db.p.find_one({"_id": 2}, {"_id": 1, "arr": {"$slice": 1}}) == {
        "_id": 2,
        "arr": [1],
        "c": 1,
    }


def test_tailable_await_cursor_on_a_capped_collection(db: Any) -> None:
    # mongod: a tailable cursor stays open when its results run out, and an awaitData
    # getMore waits up to its maxTimeMS for new documents (find_cmd.cpp, getmore_cmd.cpp;
    # "Tailable Cursors" in the manual). A tailable find on a non-capped collection fails
    # with BadValue "tailable cursor requested on non capped collection".
    db.create_collection("cap", capped=True, size=100_000)
    db.cap.insert_one({"x": 1})
    cursor = db.cap.find(cursor_type=CursorType.TAILABLE_AWAIT).max_await_time_ms(5000)
    assert next(cursor)["x"] == 1
    assert cursor.alive
    timer = threading.Timer(0.2, lambda: db.cap.insert_one({"x": 2}))
    timer.start()
    assert next(cursor)["x"] == 2  # the getMore waited for it
    timer.join()
    tail = db.cap.find(cursor_type=CursorType.TAILABLE)
    assert [d["x"] for d in tail] == [1, 2]
    assert tail.alive  # no data now, still open
    db.cap.insert_one({"x": 3})
    assert [d["x"] for d in tail] == [3]
    cursor.close()
    db.create_collection("plain")
    with pytest.raises(OperationFailure) as err:
        next(db.plain.find(cursor_type=CursorType.TAILABLE))
    assert err.value.code == 2
    assert "tailable cursor requested on non capped collection" in str(err.value)


def test_tailing_the_oplog(client: Client, db: Any) -> None:
    # mongod: local.oplog.rs is a capped collection; tailing it (tailable awaitData with
    # a ts filter) is how oplog readers work ("Replica Set Oplog" in the manual).
    db.o.insert_one({"_id": 1})
    oplog = client.local["oplog.rs"]
    cursor = oplog.find({"ns": db.o.full_name}, cursor_type=CursorType.TAILABLE_AWAIT)
    first = next(cursor)
    assert (first["op"], first["o"]) == ("i", {"_id": 1})
    db.o.insert_one({"_id": 2})
    second = next(cursor)
    assert (second["op"], second["o"], second["ns"]) == ("i", {"_id": 2}, db.o.full_name)
    assert second["ts"] > first["ts"]
    cursor.close()


def test_injected_shutdown_errors_carry_no_topology_version(rs: ReplicaSet, db: Any) -> None:
    # mongod (service_entry_point_common.cpp, appendErrorLabelsAndTopologyVersion):
    # NotPrimary errors always carry topologyVersion; shutdown errors (91, 11600) only
    # while the server is in quiesce mode. One injected by failCommand has none, so
    # PyMongo takes it as current and clears its pool
    # (jstests/replsets/notprimary_errors_return_topology_version.js). PyMongo then waits
    # for its monitor's next check (heartbeatFrequencyMS) before the next command.
    client: Client = MongoClient(rs.uri, heartbeatFrequencyMS=500)
    db = client[db.name]
    db.create_collection("s")
    for code, has_version in ((91, False), (11600, False), (10107, True), (13435, True)):
        client.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 1},
            data={"failCommands": ["find"], "errorCode": code},
        )
        reply = _raw_find(db)
        assert reply["code"] == code
        assert ("topologyVersion" in reply) == has_version, code
    client.close()


def _raw_find(db: Any) -> dict[str, Any]:
    try:
        db.command("find", "s")
    except (OperationFailure, NotPrimaryError) as err:
        details: dict[str, Any] = err.details or {}
        return details
    raise AssertionError("the failpoint did not fire")


@pytest.mark.parametrize(
    "write",
    [
        lambda c: c.find_one_and_update({"_id": 1}, {"$set": {"a": 1}}),
        lambda c: c.find_one_and_delete({"_id": 1}),
        lambda c: c.insert_one({"a": 1}),
        lambda c: c.create_index("a"),
        lambda c: c.drop(),
    ],
    ids=["findAndModify-update", "findAndModify-delete", "insert", "createIndexes", "drop"],
)
def test_unsatisfiable_write_concern(db: Any, write: Callable[[Any], Any]) -> None:
    # mongod runs the write, then waitForWriteConcern reports w above the data-bearing
    # members as writeConcernError UnsatisfiableWriteConcern (100) "Not enough
    # data-bearing nodes" (checkIfWriteConcernCanBeSatisfied,
    # replication_coordinator_impl.cpp), for DDL and findAndModify too.
    db.create_collection("w")
    coll = db.get_collection("w", write_concern=WriteConcern(w=4))
    with pytest.raises(WriteConcernError) as err:
        write(coll)
    assert err.value.code == 100
    assert db.get_collection("w", write_concern=WriteConcern(w=3)).insert_one({}).acknowledged


def test_documents_over_16_mb_are_refused(db: Any) -> None:
    # mongod: fixDocumentForInsert (src/mongo/db/ops/insert.cpp) refuses a document over
    # BSONObjMaxUserSize (16 MiB) with "object to insert too large"; an update whose
    # result is over it fails with 17419 (update_stage.cpp). PyMongo sends documents up
    # to 16 MiB + 16 KiB, so the server must check.
    big = "x" * (16 * 1024 * 1024)
    with pytest.raises(WriteError) as err:
        db.big.insert_one({"foo": big})
    assert "object to insert too large" in str(err.value)
    db.big.insert_one({"_id": 1})
    with pytest.raises(WriteError) as err:
        db.big.replace_one({"_id": 1}, {"foo": big})
    assert err.value.code == 17419
    half = "x" * (8 * 1024 * 1024)
    db.big.insert_many([{"foo": half}, {"foo": half}])
    assert db.big.count_documents({}) == 3


def test_unknown_query_operator_fails_on_an_empty_collection(db: Any) -> None:
    # mongod parses the filter (MatchExpressionParser) before it reads, so an unknown
    # operator fails with BadValue (2) "unknown operator: $bad" on a missing or empty
    # collection too.
    for query, message in (
        ({"x": {"$bad": 1}}, "unknown operator: $bad"),
        ({"$bad": 1}, "unknown top level operator: $bad"),
    ):
        with pytest.raises(OperationFailure) as err:
            db.missing.find_one(query)
        assert (err.value.code, message in str(err.value)) == (2, True)
        with pytest.raises(OperationFailure):
            db.missing.count_documents(query)


def test_where_subset(db: Any) -> None:
    # mongod runs $where with JavaScript; the simulator runs comparisons of this.<field>
    # with literals (the forms PyMongo's test_cursor uses) and refuses the rest. Code with
    # scope fails as on 4.4+ (SERVER-45970 removed it from $where).
    db.w.insert_many([{"x": i} for i in range(10)])
    assert len(list(db.w.find().where("this.x < 3"))) == 3
    assert [d["x"] for d in db.w.find({"x": 5}).where(Code("this.x > 3"))] == [5]
    assert len(list(db.w.find({"$where": "function() { return this.x >= 8; }"}))) == 2
    with pytest.raises(OperationFailure):
        list(db.w.find().where(Code("this.x < i", {"i": 3})))
    with pytest.raises(OperationFailure) as err:
        list(db.w.find().where("db.getSiblingDB('admin')"))
    assert "not supported by the simulator" in str(err.value)


def test_upsert_with_null_id_reports_upserted(db: Any) -> None:
    # mongod reports every upsert in ``upserted`` with its _id, null included
    # (write_ops_exec.cpp performUpdates; "update" command output in the manual).
    result = db.n.update_one({"_id": None}, {"$set": {"a": 1}}, upsert=True)
    assert result.raw_result["upserted"] is None  # PyMongo's summary of [{index 0, _id null}]
    assert result.raw_result["updatedExisting"] is False  # PyMongo: "upserted" was present
    reply = db.command("update", "n", updates=[{"q": {"_id": None}, "u": {"$set": {"b": 1}}}])
    assert "upserted" not in reply  # now it exists: matched
    db.n.delete_many({})
    reply = db.command(
        "update", "n", updates=[{"q": {"_id": None}, "u": {"$set": {"b": 1}}, "upsert": True}]
    )
    assert reply["upserted"] == [{"index": 0, "_id": None}]


def test_explain_validate_profile(db: Any) -> None:
    # mongod: explain answers queryPlanner/executionStats (explain_cmd.cpp, "Explain
    # Results"); validate reports a valid collection and NamespaceNotFound (26) for a
    # missing one (validate.cpp); profile -1/0 read/set the level.
    db.e.insert_many([{"a": i} for i in range(5)])
    plan = db.e.find({"a": {"$lt": 2}}).explain()
    assert plan["executionStats"]["nReturned"] == 2
    assert plan["queryPlanner"]["namespace"] == db.e.full_name
    with pytest.raises(OperationFailure):
        db.e.find({"a": {"$bad": 1}}).explain()
    assert db.validate_collection("e")["valid"] is True
    with pytest.raises(OperationFailure) as err:
        db.validate_collection("nope")
    assert err.value.code == 26
    assert db.command("profile", -1)["was"] == 0
    with pytest.raises(OperationFailure) as err:
        db.command("profile", 2)
    assert "not supported by the simulator" in str(err.value)


def test_repl_set_freeze(client: Client, rs: ReplicaSet) -> None:
    # mongod: a primary refuses to freeze with NotSecondary (95)
    # (TopologyCoordinator::prepareFreezeResponse); a secondary accepts, 0 unfreezes.
    with pytest.raises(OperationFailure) as err:
        client.admin.command("replSetFreeze", 10)
    assert err.value.code == 95
    secondary = next(m for m in rs.members if m != rs.primary)
    direct: Client = MongoClient(f"mongodb://{secondary}/?directConnection=true")
    try:
        assert direct.admin.command("replSetFreeze", 10, read_preference=ReadPreference.SECONDARY)
        assert direct.admin.command("replSetFreeze", 0)["info"] == "unfreezing"
    finally:
        direct.close()


def test_capped_rollover_ends_a_tailable_cursor(db: Any) -> None:
    # mongod: a capped collection keeps at most ``max`` documents, dropping the oldest;
    # a tailable cursor whose last document was dropped fails with CappedPositionLost
    # (136, CollectionScan), which PyMongo takes as the cursor's end ("Capped
    # Collections" and "Tailable Cursors" in the manual).
    db.create_collection("roll", capped=True, size=1000, max=3)
    db.roll.insert_many([{"x": i} for i in range(1, 4)])
    cursor = db.roll.find(cursor_type=CursorType.TAILABLE)
    assert [d["x"] for d in cursor] == [1, 2, 3]
    db.roll.insert_many([{"x": i} for i in range(4, 7)])
    assert cursor.to_list() == []
    assert not cursor.alive
    assert [d["x"] for d in db.roll.find()] == [4, 5, 6]
    assert [d["x"] for d in db.roll.find(cursor_type=CursorType.TAILABLE)[1:2]] == [5]


def test_oplog_queries_compare_timestamps(client: Client, db: Any) -> None:
    # mongod compares Timestamps within their type bracket, so {ts: {$gte: t}} on
    # local.oplog.rs selects the entries from t on; {$natural: -1} reads newest first.
    db.ts.insert_many([{"_id": 1}, {"_id": 2}])
    oplog = client.local["oplog.rs"]
    last = oplog.find({"ns": db.ts.full_name}).sort("$natural", -1).limit(-1).next()
    assert last["o"] == {"_id": 2}
    found = list(oplog.find({"ts": {"$gte": last["ts"]}, "ns": db.ts.full_name}))
    assert [d["o"] for d in found] == [{"_id": 2}]


def test_snapshot_distinct_reports_at_cluster_time(client: Client, db: Any) -> None:
    # mongod: a snapshot read outside a transaction answers with the time it read at
    # (atClusterTime, distinct.cpp), which a snapshot session then uses for later reads.
    db.snap.insert_one({"x": 1})
    reply = db.command("distinct", "snap", key="x", readConcern={"level": "snapshot"})
    assert reply["values"] == [1]
    assert reply["atClusterTime"] is not None


def test_out_replaces_the_target(client: Client, db: Any) -> None:
    # mongod: $out replaces the target collection with the pipeline's results and the
    # aggregate returns an empty, closed cursor (document_source_out.cpp; "$out" in the
    # manual); it runs in an (implicit) session like any aggregate.
    db.src.insert_many([{"a": i} for i in range(3)])
    db.target.insert_one({"old": True})
    with client.start_session() as session:
        assert (
            list(
                db.src.aggregate(
                    [{"$match": {"a": {"$gte": 1}}}, {"$out": "target"}], session=session
                )
            )
            == []
        )
    assert sorted(d["a"] for d in db.target.find()) == [1, 2]


def test_list_local_sessions_needs_no_collection(client: Client, db: Any) -> None:
    # mongod: $listLocalSessions is a collectionless stage run with {aggregate: 1}
    # ("$listLocalSessions" in the manual); the simulator lists the sessions it keeps
    # state for (those that ran a transaction or a retryable write).
    with client.start_session() as session:
        db.ls.insert_one({}, session=session)
        sessions = list(db.aggregate([{"$listLocalSessions": {}}]))
        assert session.session_id["id"] in [s["_id"]["id"] for s in sessions]
    assert len(list(db.aggregate([{"$listLocalSessions": {}}, {"$limit": 1}]))) == 1


def test_hint(db: Any) -> None:
    # mongod: a hint naming no index fails with BadValue "hint provided does not
    # correspond to an existing index" (query_planner.cpp), explain included; a hinted
    # index's scan returns the documents in its key order.
    db.h.insert_many([{"num": i} for i in range(20)])
    with pytest.raises(OperationFailure) as err:
        next(db.h.find().hint([("num", 1)]))
    assert err.value.code == 2
    with pytest.raises(OperationFailure):
        db.h.find({"num": 3}).hint("num_1").explain()
    db.h.create_index([("num", -1)])
    assert next(db.h.find().hint([("num", -1)]))["num"] == 19
    assert next(db.h.find().hint("num_-1"))["num"] == 19
    assert next(db.h.find())["num"] == 0


def test_max_time_always_time_out(client: Client, db: Any) -> None:
    # mongod's maxTimeAlwaysTimeOut failpoint fails every operation with a time limit with
    # MaxTimeMSExpired (50) (OperationContext::checkForInterrupt); a cursor opened with
    # maxTimeMS keeps a time limit on its getMores (getmore_cmd.cpp).
    from pymongo.errors import ExecutionTimeout

    db.m.insert_many([{} for _ in range(200)])
    cursor = db.m.find().max_time_ms(10_000)
    next(cursor)
    client.admin.command("configureFailPoint", "maxTimeAlwaysTimeOut", mode="alwaysOn")
    try:
        with pytest.raises(ExecutionTimeout):
            cursor.to_list()
        with pytest.raises(ExecutionTimeout):
            db.m.find_one(max_time_ms=1)
        assert db.m.find_one() is not None  # no time limit: not affected
    finally:
        client.admin.command("configureFailPoint", "maxTimeAlwaysTimeOut", mode="off")


def test_find_batch_that_uses_up_the_results_leaves_the_cursor_open(db: Any) -> None:
    # mongod's find stops filling a batch once it is full, before it looks for more
    # (find_cmd.cpp / getmore_cmd.cpp), so a batch that exactly uses up the results
    # leaves the cursor open and the next getMore returns an empty, final batch; a
    # limit ends the cursor at once.
    db.b.insert_many([{"_id": i} for i in range(3)])
    reply = db.command("find", "b", batchSize=3)
    assert len(reply["cursor"]["firstBatch"]) == 3
    assert reply["cursor"]["id"] != 0
    more = db.command("getMore", reply["cursor"]["id"], collection="b")
    assert (more["cursor"]["nextBatch"], more["cursor"]["id"]) == ([], 0)
    assert db.command("find", "b", batchSize=3, limit=3)["cursor"]["id"] == 0
    assert db.command("find", "b", batchSize=5)["cursor"]["id"] == 0


def test_min_max_bound_the_hinted_index(db: Any) -> None:
    # mongod: min (inclusive) and max (exclusive) bound the hinted index's key; without a
    # hint they fail (51173), with bounds not in the index's field order too (51174)
    # (query_planner.cpp; cursor.min()/max() in the manual).
    db.mm.create_index([("j", 1), ("k", 1)])
    db.mm.create_index("j")
    db.mm.insert_many([{"j": j, "k": j} for j in range(10)])
    assert len(db.mm.find().min([("j", 3)]).hint([("j", 1)]).to_list()) == 7
    assert len(db.mm.find().max([("j", 3)]).hint([("j", 1)]).to_list()) == 3
    both = db.mm.find().min([("j", 3), ("k", 3)]).max([("j", 5), ("k", 5)])
    assert [d["j"] for d in both.hint([("j", 1), ("k", 1)])] == [3, 4]
    with pytest.raises(OperationFailure) as err:
        db.mm.find().min([("k", 3), ("j", 3)]).hint([("j", 1), ("k", 1)]).to_list()
    assert err.value.code == 51174
    with pytest.raises(OperationFailure) as err:  # PyMongo refuses it itself: send it raw
        db.command("find", "mm", min={"j": 3})
    assert err.value.code == 51173


def test_index_options_background_and_drop_dups(db: Any) -> None:
    # mongod: listIndexes shows `background` as given; `dropDups` is a deprecated option
    # it accepts and ignores (index_key_validate.cpp), so a unique index over duplicates
    # still fails with DuplicateKey.
    from pymongo.errors import DuplicateKeyError

    db.ix.create_index("a", background=True)
    db.ix.create_index("b", background=False)
    db.ix.create_index("c")
    info = db.ix.index_information()
    assert (info["a_1"]["background"], info["b_1"]["background"]) == (True, False)
    assert "background" not in info["c_1"]
    db.ix.insert_many([{"i": 2}, {"i": 2}])
    with pytest.raises(DuplicateKeyError):
        db.ix.create_index("i", unique=True, dropDups=False)


def test_out_with_unsatisfiable_write_concern(db: Any) -> None:
    # mongod: an aggregate with $out takes a write concern and reports it as a write does
    # (UnsatisfiableWriteConcern, 100, for w above the members).
    db.src.insert_one({"a": 1})
    coll = db.get_collection("src", write_concern=WriteConcern(w=4))
    with pytest.raises(WriteConcernError):
        coll.aggregate([{"$out": "dest"}])
