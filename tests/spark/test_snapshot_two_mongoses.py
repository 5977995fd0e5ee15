"""Spark's snapshot ranges through a URI listing two mongoses, read as executors read them.

Each executor reads its ``_id`` range at the copy's time with its own client; with two
mongoses in the URI, a getMore that selects a server again reaches the other mongos half
of the time (CursorNotFound, 43). The client here alternates its server selection, so a
getMore not pinned to its cursor's mongos fails every time. No query runs: the
executors' function is called directly (the session only parses the rows' schema).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import DataType, StructType
from snapshot_support import Alternate, GetMores
from spark_support import PANDAS_WARNING

from changestream.spark_adapter import _snapshot as spark_snapshot
from changestream.spark_adapter import event_ddl
from changestream.spark_adapter._config import SourceConfig
from changestream.spark_adapter._convert import EventConverter
from changestream.testing import ShardedCluster

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]

DOCS = 3000


@pytest.fixture
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.1) as c:
        with pymongo.MongoClient(c.mongos_uri(0), directConnection=True) as one:
            one.admin.command("shardCollection", "sp.c", key={"_id": 1})
            one.admin.command("split", "sp.c", middle={"_id": DOCS // 2})
            one.admin.command("moveChunk", "sp.c", find={"_id": DOCS}, to=c.shard_names[1])
            one.admin.command("moveChunk", "sp.c", find={"_id": 0}, to=c.shard_names[0])
            one.sp.c.insert_many([{"_id": i, "v": i} for i in range(DOCS)])
        yield c


def test_snapshot_ranges_read_through_two_mongoses(
    spark: Any, cluster: ShardedCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = GetMores()
    monkeypatch.setattr(spark_snapshot, "MongoClient", functools.partial(
        pymongo.MongoClient, server_selector=Alternate(), event_listeners=[listener]))
    config = SourceConfig.from_options({"uri": cluster.uri, "database": "sp", "collection": "c",
                                        "batch_size": "200"})
    plan = spark_snapshot.plan_snapshot(config, 3)
    with pymongo.MongoClient(cluster.mongos_uri(1), directConnection=True) as one:
        one.sp.c.delete_many({"_id": {"$lt": 50}})  # after the copy's time: still copied
    schema = DataType.fromDDL(event_ddl())
    assert isinstance(schema, StructType)
    converter = EventConverter(to_arrow_schema(schema, timezone="UTC"))
    ids: list[Any] = []
    for i in range(plan.ranges):
        for batch in spark_snapshot.read_snapshot_range(config, converter, plan.partition(i)):
            assert set(batch.column("operation_type").to_pylist()) == {"insert"}
            ids.extend(key["_id"] for key in _keys(batch))
    assert sorted(ids) == list(range(DOCS))
    assert listener.check() >= DOCS // 200 - plan.ranges


def _keys(batch: Any) -> list[dict[str, Any]]:
    from bson import json_util

    return [json_util.loads(key) for key in batch.column("document_key").to_pylist()]
