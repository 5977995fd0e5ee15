"""The simulator's fast ``_id`` range reads (what range copies and re-snapshot chunks send)
return exactly what the general, type-bracketed test returns, at the read time.

A range copy's filter is ``{$or: [{_id: {$gt: v}}, {_id: {$type: [...]}}]}``; the simulator
used to filter it per document with the general test after copying every version chain
(5 s a chunk at 1M documents, under the deployment lock that writes wait for). Now the
bounds' own kind is compared natively and only the kept ``_id``s look up their versions.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from bson.objectid import ObjectId
from bson.timestamp import Timestamp
from hypothesis import given, settings
from hypothesis import strategies as st
from pymongo import MongoClient

from changestream._snapshot import SnapshotError, range_filter
from changestream.testing import ReplicaSet
from changestream.testing.commands.snapshot_reads import id_filter, id_predicate

VALUES: list[Any] = [
    -5, 0, 3, 7, 2**40, 2.5, -0.0, math.inf, float("nan"), True, False, None, "", "a", "b", "zz",
    ObjectId(b"\0" * 12), ObjectId(b"\1" * 12), ObjectId(b"\xff" * 12),
    datetime.datetime(2020, 1, 1), {"a": 1}, [1, 2], b"x",
]
values = st.sampled_from(VALUES)


@st.composite
def queries(draw: st.DrawFn) -> dict[str, Any]:
    lower, upper = draw(values), draw(values)
    has_lower, has_upper = draw(st.booleans()), draw(st.booleans())
    try:
        query = range_filter(lower, upper, has_lower=has_lower, has_upper=has_upper,
                             lower_inclusive=draw(st.booleans()))
    except SnapshotError:
        query = {"_id": {"$gt": lower}}
    if not query or draw(st.integers(0, 3)) == 0:
        op = draw(st.sampled_from(["$gt", "$gte", "$lt", "$lte"]))
        query = {"_id": {op: lower}}
    return query


@settings(max_examples=400, deadline=None)
@given(queries(), st.lists(values, min_size=1, max_size=8))
def test_the_fast_filter_agrees_with_the_bracketed_test(query: dict[str, Any], ids: list[Any]) -> None:
    fast, general = id_filter(query), id_predicate(query)
    assert fast is not None and general is not None
    assert [fast(v) for v in ids] == [general(v) for v in ids], query


def test_a_range_read_at_a_time_sees_the_versions_of_that_time() -> None:
    """Updated, deleted and inserted after the read time, with mixed ``_id`` types: the
    range read at that time returns what the whole read at that time holds in the range."""
    ids: list[Any] = [*range(0, 300, 3), *(f"s{n:03d}" for n in range(40)),
                      *(ObjectId(n.to_bytes(12, "big")) for n in range(40)), 1.5, 2**40]
    with ReplicaSet("8.0") as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        coll = client.db.c
        coll.insert_many([{"_id": i, "v": 0} for i in ids])
        at: Timestamp = client.admin.command("ping")["operationTime"]
        for n, i in enumerate(ids):
            if n % 3 == 0:
                coll.update_one({"_id": i}, {"$set": {"v": 1}})
            elif n % 3 == 1:
                coll.delete_one({"_id": i})
        coll.insert_many([{"_id": i, "v": 2} for i in (1, 4, "s0005x", 10**6)])

        def read(pipeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
            reply = client.db.command({
                "aggregate": "c", "pipeline": pipeline, "cursor": {"batchSize": 100_000},
                "readConcern": {"level": "snapshot", "atClusterTime": at}})
            return list(reply["cursor"]["firstBatch"])

        whole = read([{"$sort": {"_id": 1}}])
        assert len(whole) == len(ids) and all(d["v"] == 0 for d in whole)
        for lower, upper, has_upper in ((30, "s020", True), (0, None, False),
                                        ("s010", ObjectId(b"\0" * 11 + b"\x14"), True),
                                        (ObjectId(b"\0" * 12), None, False)):
            query = range_filter(lower, upper, has_lower=True, has_upper=has_upper)
            test = id_predicate(query)
            assert test is not None
            want = [d for d in whole if test(d["_id"])]
            assert want, query
            assert read([{"$match": query}, {"$sort": {"_id": 1}}]) == want, query
            found = client.db.command({
                "find": "c", "filter": query, "sort": {"_id": 1}, "batchSize": 100_000,
                "readConcern": {"level": "snapshot", "atClusterTime": at}})
            assert found["cursor"]["firstBatch"] == want, query
