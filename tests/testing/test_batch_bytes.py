"""Batches cut by bytes as mongod cuts them: what the reply's batch array really uses.

mongod appends a document to a batch only while the array built so far (its
length prefix, each element's type byte and index name, the documents) plus
the next document stays within 16 MiB, and the first document always goes. A
backlog of any length then reads through with the default batch size, and no
reply exceeds ``BSONObjMaxInternalSize`` (16 MiB + 16 KiB).
"""

from __future__ import annotations

import itertools
import random
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import bson
import pytest
from bson.int64 import Int64
from bson.timestamp import Timestamp
from pymongo import MongoClient
from support import command_context

from changestream.testing import ReplicaSet
from changestream.testing.changestreams.cursor import ChangeStreamCursor
from changestream.testing.commands.aggregate import aggregate
from changestream.testing.core.codec import ENCODE_OPTIONS
from changestream.testing.core.cursors import MAX_BATCH_BYTES, BatchBytes, cursor_reply
from changestream.testing.core.versions import VERSIONS, get_profile
from changestream.testing.server.listener import MAX_REPLY_SIZE
from changestream.testing.storage.deployment import Deployment

MIB = 1024 * 1024
UUID_A = uuid.UUID("a5093abb-38fe-4b9e-a67f-01bb1a96d812")
UUID_B = uuid.UUID("11111111-2222-4333-8444-555555555555")
WALL = datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc)
ENVELOPE = {
    "ok": 1.0,
    "$clusterTime": {
        "clusterTime": Timestamp(1_700_000_000, 1),
        "signature": {"hash": b"\0" * 20, "keyId": Int64(0)},
    },
    "operationTime": Timestamp(1_700_000_000, 1),
}
"""What the dispatcher adds around a cursor reply (the sizes are what matter)."""

Client = MongoClient[dict[str, Any]]


def size_of(doc: Any) -> int:
    return len(bson.encode(doc, codec_options=ENCODE_OPTIONS))


def array_bytes(docs: list[Any]) -> int:
    """The bytes of ``docs`` as a BSON array, without its terminating NUL."""
    return size_of({"a": docs}) - 4 - 3 - 1 - 1  # length, type + "a" + NUL, array NUL, doc NUL


# -- the accounting ----------------------------------------------------------------------------------
def test_batch_bytes_counts_the_array_as_encoded() -> None:
    rng = random.Random(7)
    docs: list[dict[str, Any]] = []
    size = BatchBytes()
    assert size.used == array_bytes([])
    for i in range(1200):  # element names up to four digits
        doc = {"_id": i, "s": "x" * rng.randrange(0, 300)}
        size.add(size_of(doc))
        docs.append(doc)
    assert size.used == array_bytes(docs)
    assert size.count == len(docs)


def test_the_first_document_always_fits_then_the_limit_counts_what_is_used() -> None:
    size = BatchBytes()
    assert size.fits(MAX_BATCH_BYTES + 10_000)  # the first document always goes
    size.add(MAX_BATCH_BYTES - 100)
    room = MAX_BATCH_BYTES - size.used
    assert size.fits(room)
    assert not size.fits(room + 1)


# -- the change-stream cursor, at every emulated version -------------------------------------------------
def open_stream(
    d: Deployment, db: str, target: str | int, pipeline: list[Any] | None = None, **options: Any
) -> tuple[dict[str, Any], ChangeStreamCursor | None]:
    body: dict[str, Any] = {
        "aggregate": target,
        "pipeline": [{"$changeStream": options}, *(pipeline or [])],
        "cursor": {},
    }
    with d.lock:
        reply = aggregate(command_context(d, db, body))
    cid = int(reply["cursor"]["id"])
    if not cid:
        return reply, None
    cursor = d.cursors.checkout(cid, d.members[0].name)
    d.cursors.checkin(cid)
    assert isinstance(cursor, ChangeStreamCursor)
    return reply, cursor


def insert(d: Deployment, ns: str, _id: Any, ui: uuid.UUID = UUID_A, **doc: Any) -> None:
    with d.lock:
        d.log("i", ns, {"_id": _id, **doc}, ui=ui, o2={"_id": _id}, wall=WALL)


def read_through(
    d: Deployment, cursor: ChangeStreamCursor, first: list[Any], *, expect: int
) -> list[list[Any]]:
    """Every batch of ``cursor`` until ``expect`` events, each checked against mongod's rule."""
    batches = [first] if first else []
    got = len(first)
    while got < expect:
        ctx = command_context(d, "db", {"getMore": Int64(1)})
        batch = cursor.get_more(ctx, None, 0)
        assert batch.documents, f"the stream stopped after {got} of {expect} events"
        reply = {**cursor_reply(1, cursor.ns, batch, first=False), **ENVELOPE}
        assert size_of(reply) <= MAX_REPLY_SIZE
        batches.append(batch.documents)
        got += len(batch.documents)
    assert got == expect
    for batch_docs, following in itertools.pairwise(batches):
        # mongod's rule: the last document joined an array that left it room, and the next
        # batch's first document would not have fitted in this one
        if len(batch_docs) > 1:
            assert array_bytes(batch_docs[:-1]) + size_of(batch_docs[-1]) <= MAX_BATCH_BYTES
        assert array_bytes(batch_docs) + size_of(following[0]) > MAX_BATCH_BYTES
    return batches


@pytest.mark.parametrize("version", VERSIONS)
def test_a_backlog_of_small_events_reads_through_in_full_batches(version: str) -> None:
    """~4 KiB events: an array of 16 MiB of them carries ~25 KiB of element overhead,
    more than the reply's 16 KiB allowance, so only counting it keeps replies legal."""
    d = Deployment(get_profile(version), now=lambda: 1_700_000_000.0)
    reply, cursor = open_stream(d, "db", "c")
    assert cursor is not None
    count = 9000
    for i in range(count):
        insert(d, "db.c", i, s="x" * 4000)
    batches = read_through(d, cursor, reply["cursor"]["firstBatch"], expect=count)
    assert len(batches) == 3
    ids = [e["documentKey"]["_id"] for batch in batches for e in batch]
    assert ids == list(range(count))


@pytest.mark.parametrize("version", VERSIONS)
def test_large_events_and_many_streams_of_every_scope(version: str) -> None:
    d = Deployment(get_profile(version), now=lambda: 1_700_000_000.0)
    streams = [
        open_stream(d, "db", "c"),
        open_stream(d, "db", "c", [{"$match": {"operationType": "insert"}}]),
        open_stream(d, "db", 1),
        open_stream(d, "db", 1, [{"$match": {"ns.coll": "c"}}]),
        open_stream(d, "admin", 1, allChangesForCluster=True),
        open_stream(d, "admin", 1, [{"$match": {"ns.coll": "other"}}], allChangesForCluster=True),
    ]
    rng = random.Random(11)
    sizes = [rng.choice([100, 64 * 1024, 3 * MIB, 7 * MIB, 15 * MIB]) for _ in range(12)]
    for i, blob in enumerate(sizes):
        insert(d, "db.c", i, s="x" * blob)
        insert(d, "db.other", i, ui=UUID_B, s="y" * (blob // 3))
    n = len(sizes)
    expected = [n, n, 2 * n, n, 2 * n, n]
    for (reply, cursor), expect in zip(streams, expected, strict=True):
        assert cursor is not None
        read_through(d, cursor, reply["cursor"]["firstBatch"], expect=expect)


def test_an_event_larger_than_16_mib_goes_alone_in_its_batch() -> None:
    d = Deployment(get_profile("8.0"), now=lambda: 1_700_000_000.0)
    _, cursor = open_stream(d, "db", "c")
    assert cursor is not None
    insert(d, "db.c", 0)
    insert(d, "db.c", 1, s="x" * (MAX_BATCH_BYTES + 4096))
    insert(d, "db.c", 2)
    batches = read_through(d, cursor, [], expect=3)
    assert [[e["documentKey"]["_id"] for e in b] for b in batches] == [[0], [1], [2]]
    assert size_of(batches[1][0]) > MAX_BATCH_BYTES


# -- over the wire, with clients this project did not write ------------------------------------------
@pytest.fixture(scope="module", params=["4.4", "8.0"])
def backlog(request: pytest.FixtureRequest) -> Iterator[tuple[ReplicaSet, Timestamp, int]]:
    """50,000 inserts: ~340-byte documents (17 MiB) whose events are ~550 bytes."""
    with ReplicaSet(request.param) as rs:
        client: Client = MongoClient(rs.uri, serverSelectionTimeoutMS=5000)
        start = client.db.command("ping")["operationTime"]
        count = 50_000
        for k in range(0, count, 10_000):
            client.db.c.insert_many([{"i": i, "s": "x" * 300} for i in range(k, k + 10_000)])
        client.close()
        yield rs, start, count


def test_pymongo_watch_reads_a_backlog_over_16_mib_with_the_default_batch_size(
    backlog: tuple[ReplicaSet, Timestamp, int], clients: Callable[..., Client]
) -> None:
    rs, start, count = backlog
    coll = clients(rs.uri).db.c
    with coll.watch(start_at_operation_time=start) as stream:
        seen = [stream.next()["fullDocument"]["i"] for _ in range(count)]
        token = stream.resume_token
    assert seen == list(range(count))
    assert token is not None


def test_resume_after_an_old_token_over_a_big_backlog(
    backlog: tuple[ReplicaSet, Timestamp, int], clients: Callable[..., Client]
) -> None:
    rs, start, count = backlog
    coll = clients(rs.uri).db.c
    with coll.watch(start_at_operation_time=start) as stream:
        stream.next()
        old = stream.resume_token
    with coll.watch(resume_after=old) as resumed:
        seen = [resumed.next()["fullDocument"]["i"] for _ in range(count - 1)]
    assert seen == list(range(1, count))


def test_find_and_aggregate_cursors_cut_by_the_same_rule(
    backlog: tuple[ReplicaSet, Timestamp, int], clients: Callable[..., Client]
) -> None:
    rs, _, count = backlog
    coll = clients(rs.uri).db.c
    assert [d["i"] for d in coll.find({}, {"_id": 0})] == list(range(count))
    assert sum(1 for _ in coll.aggregate([{"$match": {}}])) == count
