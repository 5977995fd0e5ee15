"""Transactions: writes buffered until commit, one applyOps entry, undo on abort."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import pytest
from bson.binary import Binary
from bson.int64 import Int64

from changestream.testing.commands import REGISTRY, CommandContext, ConnectionInfo
from changestream.testing.core.errors import CommandError
from changestream.testing.core.versions import get_profile
from changestream.testing.storage.deployment import Deployment


class Session:
    """Runs commands in one session's transactions against a deployment."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.id = Binary(uuid.uuid4().bytes, 4)  # what the wire decoder hands over

    def run(
        self, body: dict[str, Any], txn: int | None = None, *, start: bool = False, db: str = "db"
    ) -> dict[str, Any]:
        ctx = CommandContext(
            deployment=self.dep,
            member=self.dep.members[0],
            connection=ConnectionInfo(1, ("127.0.0.1", 1)),
            db=db,
            name=next(iter(body)),
            body=body,
            lsid={"id": self.id} if txn is not None else None,
            txn_number=txn,
            autocommit=False if txn is not None else None,
            start_transaction=start,
        )
        return REGISTRY[ctx.name].handler(ctx)

    def commit(self, txn: int) -> dict[str, Any]:
        return self.run({"commitTransaction": 1}, txn, db="admin")

    def abort(self, txn: int) -> dict[str, Any]:
        return self.run({"abortTransaction": 1}, txn, db="admin")

    def fails(self, body: dict[str, Any], txn: int, **kw: Any) -> CommandError:
        with pytest.raises(CommandError) as info:
            self.run(body, txn, **kw)
        return info.value


@pytest.fixture
def dep() -> Deployment:
    deployment = Deployment(get_profile("8.0"))
    Session(deployment).run({"insert": "c", "documents": [{"_id": 1, "n": 0}]})
    return deployment


def test_commit_logs_one_apply_ops_entry_at_the_commit_time(dep: Deployment) -> None:
    s = Session(dep)
    start = dep.oplog.end_seq
    s.run({"insert": "c", "documents": [{"_id": 2}]}, 5, start=True)
    s.run({"update": "c", "updates": [{"q": {"_id": 1}, "u": {"$inc": {"n": 1}}}]}, 5)
    s.run({"delete": "c", "deletes": [{"q": {"_id": 2}, "limit": 1}]}, 5)
    s.run({"insert": "new", "documents": [{"_id": "x"}]}, 5)
    assert dep.oplog.read(start) == []  # nothing is logged before the commit
    state = dep.catalog.get("db", "c")
    assert state is not None and state.find_by_id(1) == {"_id": 1, "n": 1}  # applied already
    assert s.commit(5) == {}
    (entry,) = dep.oplog.read(start)
    new = dep.catalog.get("db", "new")
    assert new is not None
    assert (entry.op, entry.ns) == ("c", "admin.$cmd")
    assert entry.lsid == {"id": s.id, "uid": Binary(hashlib.sha256(b"").digest(), 0)}
    assert entry.txn_number == 5 and isinstance(entry.txn_number, Int64)
    assert entry.o == {
        "applyOps": [
            {"op": "i", "ns": "db.c", "ui": state.uuid, "o": {"_id": 2}, "o2": {"_id": 2}},
            {"op": "u", "ns": "db.c", "ui": state.uuid, "o": {"$v": 2, "diff": {"u": {"n": 1}}},
             "o2": {"_id": 1}},
            {"op": "d", "ns": "db.c", "ui": state.uuid, "o": {"_id": 2}},
            {"op": "c", "ns": "db.$cmd", "ui": new.uuid,
             "o": {"create": "new", "idIndex": {"v": 2, "key": {"_id": 1}, "name": "_id_"}}},
            {"op": "i", "ns": "db.new", "ui": new.uuid, "o": {"_id": "x"}, "o2": {"_id": "x"}},
        ]
    }  # fmt: skip
    assert entry.txn_ops is not None
    assert [(e.op, e.ns, e.o, e.o2, e.ui) for e in entry.txn_ops] == [
        (d["op"], d["ns"], d["o"], d.get("o2"), d["ui"]) for d in entry.o["applyOps"]
    ]
    assert all(e.ts == entry.ts and e.wall == entry.wall for e in entry.txn_ops)
    assert s.commit(5) == {}  # a retried commit succeeds and logs nothing more
    assert len(dep.oplog.read(start)) == 1


def test_abort_undoes_every_write_and_logs_nothing(dep: Deployment) -> None:
    s = Session(dep)
    start = dep.oplog.end_seq
    s.run({"insert": "c", "documents": [{"_id": 2}]}, 1, start=True)
    s.run({"update": "c", "updates": [{"q": {"_id": 1}, "u": {"$set": {"n": 9}}}]}, 1)
    s.run({"insert": "fresh", "documents": [{}]}, 1)
    s.run({"delete": "c", "deletes": [{"q": {"_id": 1}, "limit": 1}]}, 1)
    assert s.abort(1) == {}
    assert dep.oplog.read(start) == []
    state = dep.catalog.get("db", "c")
    assert state is not None and list(state.documents()) == [{"_id": 1, "n": 0}]
    assert dep.catalog.get("db", "fresh") is None
    err = s.fails({"commitTransaction": 1}, 1, db="admin")
    assert (err.code, err.errmsg) == (251, "Transaction with { txnNumber: 1 } has been aborted.")


def test_unknown_and_stale_transactions(dep: Deployment) -> None:
    s = Session(dep)
    err = s.fails({"find": "c"}, 3)
    assert err.code == 251 and err.code_name == "NoSuchTransaction"
    assert err.errmsg == (
        "Given transaction number 3 does not match any in-progress transactions. "
        "The active transaction number is -1"
    )
    s.run({"find": "c"}, 4, start=True)
    assert s.fails({"find": "c"}, 3, start=True).code == 225  # TransactionTooOld
    assert s.fails({"find": "c"}, 4, start=True).code == 117  # already started
    s.commit(4)
    assert s.fails({"abortTransaction": 1}, 4, db="admin").code == 256
    assert s.fails({"find": "c"}, 4).code == 256


def test_read_only_transaction_commits_without_an_entry(dep: Deployment) -> None:
    s = Session(dep)
    start = dep.oplog.end_seq
    reply = s.run({"find": "c"}, 1, start=True)
    assert reply["cursor"]["firstBatch"] == [{"_id": 1, "n": 0}]
    s.run({"update": "c", "updates": [{"q": {"_id": 1}, "u": {"$set": {"n": 0}}}]}, 1)  # no-op
    assert s.commit(1) == {}
    assert dep.oplog.read(start) == []


def test_a_failed_write_aborts_the_transaction(dep: Deployment) -> None:
    s = Session(dep)
    s.run({"insert": "c", "documents": [{"_id": 5}]}, 1, start=True)
    err = s.fails({"insert": "c", "documents": [{"_id": 1}]}, 1)
    assert err.code == 11000 and err.extra == {"keyPattern": {"_id": 1}, "keyValue": {"_id": 1}}
    state = dep.catalog.get("db", "c")
    assert state is not None and state.find_by_id(5) is None
    assert s.fails({"commitTransaction": 1}, 1, db="admin").code == 251


def test_a_new_transaction_aborts_the_previous_one(dep: Deployment) -> None:
    s = Session(dep)
    start = dep.oplog.end_seq
    s.run({"insert": "c", "documents": [{"_id": 7}]}, 1, start=True)
    s.run({"insert": "c", "documents": [{"_id": 8}]}, 2, start=True)
    s.commit(2)
    state = dep.catalog.get("db", "c")
    assert state is not None and state.find_by_id(7) is None
    (entry,) = dep.oplog.read(start)
    assert [op["o"] for op in entry.o["applyOps"]] == [{"_id": 8}]


def retryable(dep: Deployment, s: Session, body: dict[str, Any], txn: int) -> dict[str, Any]:
    """Run ``body`` as a retryable write (``lsid`` + ``txnNumber``, no ``autocommit``)."""
    ctx = CommandContext(
        deployment=dep,
        member=dep.members[0],
        connection=ConnectionInfo(1, ("127.0.0.1", 1)),
        db="db",
        name=next(iter(body)),
        body=body,
        lsid={"id": s.id},
        txn_number=txn,
    )
    return REGISTRY[ctx.name].handler(ctx)


def test_retryable_writes_are_not_transactions(dep: Deployment) -> None:
    s = Session(dep)
    start = dep.oplog.end_seq
    retryable(dep, s, {"insert": "c", "documents": [{"_id": 3}, {"_id": 4}]}, 9)
    entries = dep.oplog.read(start)
    assert [(e.op, e.o) for e in entries] == [("i", {"_id": 3}), ("i", {"_id": 4})]
    uid = Binary(hashlib.sha256(b"").digest(), 0)
    assert [(e.lsid, e.txn_number, e.stmt_id) for e in entries] == [
        ({"id": s.id, "uid": uid}, 9, 0),
        ({"id": s.id, "uid": uid}, 9, 1),
    ]


def test_a_retried_statement_returns_its_first_result_and_writes_nothing(
    dep: Deployment,
) -> None:
    s = Session(dep)
    first = retryable(dep, s, {"insert": "c", "documents": [{"_id": 5}]}, 1)
    start = dep.oplog.end_seq
    body = {"insert": "c", "documents": [{"_id": 5}, {"_id": 6}]}
    again = retryable(dep, s, body, 1)
    assert (first["n"], again["n"], again["retriedStmtIds"]) == (1, 2, [0])
    assert "writeErrors" not in again
    assert [e.o for e in dep.oplog.read(start)] == [{"_id": 6}]  # only the new statement
    update = {"update": "c", "updates": [{"q": {"_id": 5}, "u": {"$inc": {"k": 1}}}]}
    assert retryable(dep, s, update, 2)["nModified"] == 1
    retried = retryable(dep, s, update, 2)
    assert (retried["n"], retried["nModified"], retried["retriedStmtIds"]) == (1, 1, [0])
    assert Session(dep).run({"find": "c", "filter": {"_id": 5}})["cursor"]["firstBatch"] == [
        {"_id": 5, "k": 1}
    ]
    upsert = {
        "update": "c",
        "updates": [{"q": {"_id": 7}, "u": {"$set": {"u": 1}}, "upsert": True}],
    }
    assert retryable(dep, s, upsert, 3)["upserted"] == [{"index": 0, "_id": 7}]
    assert retryable(dep, s, upsert, 3)["upserted"] == [{"index": 0, "_id": 7}]
    fam = {"findAndModify": "c", "query": {"_id": 7}, "update": {"$inc": {"u": 1}}, "new": True}
    assert retryable(dep, s, fam, 4)["value"] == {"_id": 7, "u": 2}
    assert retryable(dep, s, fam, 4) == {
        "lastErrorObject": {"n": 1, "updatedExisting": True},
        "value": {"_id": 7, "u": 2},
        "retriedStmtId": 0,
    }
    delete = {"delete": "c", "deletes": [{"q": {"_id": 7}, "limit": 1}]}
    assert retryable(dep, s, delete, 5)["n"] == 1
    again = retryable(dep, s, delete, 5)
    assert (again["n"], again["retriedStmtIds"], list(again)[-1]) == (1, [0], "retriedStmtIds")


def test_retryable_write_numbers_and_multi_statements(dep: Deployment) -> None:
    s = Session(dep)
    retryable(dep, s, {"insert": "c", "documents": [{"_id": 20}]}, 4)
    with pytest.raises(CommandError) as info:
        retryable(dep, s, {"insert": "c", "documents": [{"_id": 21}]}, 3)
    assert info.value.code == 225
    assert "because a newer retryable write with txnNumber 4 has already started" in (
        info.value.errmsg
    )
    multi = {"update": "c", "updates": [{"q": {}, "u": {"$set": {"m": 1}}, "multi": True}]}
    err = retryable(dep, s, multi, 5)["writeErrors"][0]
    assert (err["code"], err["errmsg"]) == (
        72,
        "Cannot use (or request) retryable writes with multi=true",
    )
    many = {"delete": "c", "deletes": [{"q": {}, "limit": 0}]}
    assert retryable(dep, s, many, 6)["writeErrors"][0]["code"] == 72
    s.run({"insert": "c", "documents": [{"_id": 22}]}, 7, start=True)
    with pytest.raises(CommandError) as info:
        retryable(dep, s, {"insert": "c", "documents": [{"_id": 23}]}, 7)
    assert (info.value.code, info.value.code_name) == (217, "IncompleteTransactionHistory")
    retryable(dep, s, {"insert": "c", "documents": [{"_id": 24}]}, 8)  # aborts transaction 7
    found = Session(dep).run({"find": "c", "filter": {"_id": {"$in": [22, 24]}}})
    assert found["cursor"]["firstBatch"] == [{"_id": 24}]


def test_transaction_commands_are_admin_only() -> None:
    assert REGISTRY["commitTransaction"].admin_only and REGISTRY["abortTransaction"].admin_only


def test_retried_statement_ids_are_reported_from_6_0() -> None:
    old = Deployment(get_profile("5.0"))
    s = Session(old)
    body = {"insert": "c", "documents": [{"_id": 1}]}
    retryable(old, s, body, 1)
    again = retryable(old, s, body, 1)
    assert again["n"] == 1 and "retriedStmtIds" not in again  # 5.0: deduplicated silently
