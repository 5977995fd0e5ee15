"""``onPrimaryTransactionalWrite`` as mongod runs it (issue 33, item 21; PyMongo's
``test_retryable_writes.py`` relies on each point).

mongod evaluates it where a retryable write commits a write unit of work
(``TransactionParticipant``): once per update or delete statement, once per batch of inserted
documents (up to 64 documents, a batch closes once it reaches 256 KB), and a batch that fails
is tried again one document at a time. ``closeConnection`` (default true) ends the connection
but not the operation: the whole command runs and its reply is lost.
``failBeforeCommitExceptionCode`` fails the write, and closes the connection too unless
``closeConnection`` is false.
"""

from __future__ import annotations

import socket
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import bson
import pytest
from bson.binary import Binary
from bson.int64 import Int64
from pymongo import MongoClient

from changestream.testing import ReplicaSet

Client = MongoClient[dict[str, Any]]


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0", noop_interval=0) as replset:
        yield replset


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[Client]:
    c: Client = MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
    c.drop_database("db")
    yield c
    c.admin.command("configureFailPoint", "onPrimaryTransactionalWrite", mode="off")
    c.close()


def _reply_or_closed(member: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """One OP_MSG command; None when the server closes the connection instead of replying."""
    payload = bson.encode(body)
    host, port = member.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(struct.pack("<iiiiIB", 21 + len(payload), 1, 0, 2013, 0, 0) + payload)
        data = b""
        while len(data) < 4 or len(data) < int.from_bytes(data[:4], "little"):
            chunk = sock.recv(1 << 20)
            if not chunk:
                return None
            data += chunk
    return bson.decode(data[21:])


def _retryable(body: dict[str, Any], txn_number: int = 1) -> dict[str, Any]:
    lsid = {"id": Binary(uuid.uuid4().bytes, 4)}
    return {**body, "lsid": lsid, "txnNumber": Int64(txn_number), "$db": "db"}


def _fail_point(client: Client, mode: Any, **data: Any) -> None:
    client.admin.command("configureFailPoint", "onPrimaryTransactionalWrite", mode=mode, data=data)


def test_a_lost_reply_still_runs_the_whole_command(client: Client, rs: ReplicaSet) -> None:
    """mongod ends the connection at the first statement's commit; the other statements
    still run (the old simulator stopped the command there)."""
    client.db.c.insert_many([{"_id": i, "n": 0} for i in range(3)])
    _fail_point(client, {"times": 1})
    update = _retryable(
        {"update": "c", "updates": [{"q": {"_id": i}, "u": {"$inc": {"n": 1}}} for i in range(3)]}
    )
    assert _reply_or_closed(rs.primary, update) is None
    assert [d["n"] for d in client.db.c.find().sort("_id", 1)] == [1, 1, 1]
    retried = _reply_or_closed(rs.primary, update)
    assert retried is not None
    assert (retried["n"], retried["nModified"], retried["retriedStmtIds"]) == (3, 3, [0, 1, 2])
    assert [d["n"] for d in client.db.c.find().sort("_id", 1)] == [1, 1, 1]


@pytest.mark.parametrize("close", [None, False])
def test_fail_before_commit_closes_the_connection_unless_told_not_to(
    client: Client, rs: ReplicaSet, close: bool | None
) -> None:
    data: dict[str, Any] = {"failBeforeCommitExceptionCode": 91}
    if close is not None:
        data["closeConnection"] = close
    _fail_point(client, {"times": 1}, **data)
    reply = _reply_or_closed(rs.primary, _retryable({"insert": "c", "documents": [{"_id": 1}]}))
    if close is None:
        assert reply is None, "closeConnection defaults to true"
    else:
        assert reply is not None
        assert (reply["n"], [e["code"] for e in reply["writeErrors"]]) == (0, [91])
    assert client.db.c.count_documents({}) == 0, "the write is not reflected"


def test_skip_counts_insert_batches_and_large_documents_commit_alone(
    client: Client, rs: ReplicaSet
) -> None:
    """Each document over 256 KB is a batch of its own: ``skip: 2`` lets two documents
    through and fails the third (PyMongo's test_batch_splitting_retry_fails counts
    documents so)."""
    _fail_point(client, {"skip": 2}, closeConnection=False, failBeforeCommitExceptionCode=1)
    big = "x" * (300 * 1024)
    insert = _retryable({"insert": "c", "documents": [{"_id": i, "v": big} for i in range(3)]})
    reply = _reply_or_closed(rs.primary, insert)
    assert reply is not None
    assert (reply["n"], [e["index"] for e in reply["writeErrors"]]) == (2, [2])


def test_a_batch_that_fails_to_commit_is_tried_one_document_at_a_time(
    client: Client, rs: ReplicaSet
) -> None:
    _fail_point(client, {"times": 1}, closeConnection=False, failBeforeCommitExceptionCode=1)
    insert = _retryable({"insert": "c", "documents": [{"_id": i} for i in range(3)]})
    reply = _reply_or_closed(rs.primary, insert)
    assert reply is not None
    assert (reply["n"], "writeErrors" in reply) == (3, False)
    assert client.db.c.count_documents({}) == 3
