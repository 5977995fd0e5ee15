"""``$collStats: {storageStats: {}}`` on ``local.oplog.rs``, through PyMongo: mongod's shape
(``storage_stats.cpp``), so a client can tell how full the oplog is."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from changestream.testing import ReplicaSet

STATS = [{"$collStats": {"storageStats": {}}}]


def storage_stats(client: MongoClient[dict[str, Any]], **options: Any) -> dict[str, Any]:
    docs = list(client.local["oplog.rs"].aggregate(
        [{"$collStats": {"storageStats": options}}]))
    assert len(docs) == 1
    assert docs[0]["ns"] == "local.oplog.rs" and "host" in docs[0] and "localTime" in docs[0]
    stats: dict[str, Any] = docs[0]["storageStats"]
    return stats


def test_oplog_storage_stats_grow_to_the_byte_limit_then_stay_full() -> None:
    with ReplicaSet("9.0", oplog_max_bytes=64 * 1024) as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        try:
            before = storage_stats(client)
            assert list(before)[:3] == ["size", "count", "avgObjSize"]  # mongod's order
            assert before["capped"] is True and before["maxSize"] == 64 * 1024
            assert before["max"] == 0 and before["nindexes"] == 0 and before["scaleFactor"] == 1
            assert 0 < before["size"] < 0.9 * before["maxSize"]
            assert before["count"] == len(list(client.local["oplog.rs"].find({}, {"ts": 1})))
            coll = client.db.coll
            for i in range(20):
                coll.insert_many([{"i": i, "pad": "x" * 1000} for _ in range(10)])
            full = storage_stats(client)
            assert 0.9 * full["maxSize"] <= full["size"] <= full["maxSize"]
            assert full["count"] == len(list(client.local["oplog.rs"].find({}, {"ts": 1})))
            scaled = storage_stats(client, scale=1024)
            assert scaled["maxSize"] == 64 and scaled["scaleFactor"] == 1024
        finally:
            client.close()


def test_an_entry_limit_reports_the_bytes_at_that_limit_and_no_limit_mongods_default() -> None:
    with ReplicaSet("8.0", oplog_max_entries=50) as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        try:
            client.db.coll.insert_many([{"i": i} for i in range(100)])
            stats = storage_stats(client)
            assert stats["count"] == 50 and stats["size"] == stats["maxSize"]  # full
        finally:
            client.close()
    with ReplicaSet("8.0") as rs:
        client = MongoClient(rs.uri)
        try:
            assert storage_stats(client)["maxSize"] == 990 * 1024 * 1024
        finally:
            client.close()


def test_a_standalone_has_no_oplog() -> None:
    with ReplicaSet("8.0", standalone=True) as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        try:
            with pytest.raises(OperationFailure) as info:
                list(client.local["oplog.rs"].aggregate(STATS))
            assert info.value.code == 26
            assert info.value.details["errmsg"] == (
                "PlanExecutor error during aggregation :: caused by :: Unable to retrieve "
                "storageStats in $collStats stage :: caused by :: Collection [local.oplog.rs] "
                "not found."
            )
        finally:
            client.close()


def test_other_sections_and_bad_options_are_refused() -> None:
    """Sections the simulator does not answer fail (115) instead of being dropped from the
    reply; a ``scale`` of a wrong type is TypeMismatch (14) with its BSON type name."""
    with ReplicaSet("8.0") as rs:
        client: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        oplog = client.local["oplog.rs"]
        try:
            for section in ("count", "latencyStats", "queryExecStats"):
                with pytest.raises(OperationFailure) as refused:
                    list(oplog.aggregate([{"$collStats": {"storageStats": {}, section: {}}}]))
                assert refused.value.code == 115, section
            with pytest.raises(OperationFailure) as unknown:
                list(oplog.aggregate([{"$collStats": {"nope": {}}}]))
            assert unknown.value.code == 40415
            with pytest.raises(OperationFailure) as wrong:
                storage_stats(client, scale="1024")
            assert wrong.value.code == 14
            assert "is the wrong type 'string'" in str(wrong.value)
        finally:
            client.close()
