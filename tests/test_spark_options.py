"""The Spark source's options without Spark: mongo-spark aliases, the namespace filter, and
schema inference (``infer_ddl``). The queries themselves are in ``tests/spark`` (``-m spark``)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

pytest.importorskip("pyspark", reason='the Spark adapter needs pip install -e ".[spark]"')

from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from changestream.spark_adapter import MONGO_SPARK_ALIASES, infer_ddl
from changestream.spark_adapter._config import MONGO_SPARK_UNSUPPORTED, SourceConfig
from changestream.spark_adapter._infer import MAP_MIN_KEYS


def config(**options: str) -> SourceConfig:
    return SourceConfig.from_options(options)


def test_mongo_spark_option_names_are_aliases() -> None:
    ours = config(
        uri="mongodb://h/", database="shop", collection="orders", pipeline='[{"$match": {}}]',
        full_document="updateLookup", full_document_before_change="whenAvailable",
        publish_full_document_only="true", startup_mode="timestamp",
        start_at_operation_time="1700000000", max_rows_per_batch="500",
    )
    theirs = SourceConfig.from_options({
        "connection.uri": "mongodb://h/",
        "database": "shop",
        "collection": "orders",
        "aggregation.pipeline": '[{"$match": {}}]',
        "change.stream.lookup.full.document": "updateLookup",
        "change.stream.lookup.full.document.before.change": "whenAvailable",
        "Change.Stream.Publish.Full.Document.Only": "true",  # keys are case-insensitive
        "change.stream.startup.mode": "timestamp",
        "change.stream.startup.mode.timestamp.start.at.operation.time": "2023-11-14T22:13:20Z",
        "change.stream.micro.batch.max.rows": "500",
    })
    assert theirs == ours
    # Spark session-level names work too, and the connector's "unset" time is unset.
    conf = SourceConfig.from_options({
        "spark.mongodb.read.connection.uri": "mongodb://h/",
        "spark.mongodb.read.change.stream.startup.mode.timestamp.start.at.operation.time": "-1",
    })
    assert conf.uri == "mongodb://h/" and conf.start_at_operation_time is None
    assert set(MONGO_SPARK_ALIASES.values()) <= {f for f in SourceConfig.__dataclass_fields__}


def test_unsupported_and_doubled_options_are_refused_with_what_to_do() -> None:
    for name, advice in MONGO_SPARK_UNSUPPORTED.items():
        with pytest.raises(ValueError, match="has no equivalent here") as refused:
            SourceConfig.from_options({"uri": "mongodb://h/", name: "1"})
        assert advice in str(refused.value)
    with pytest.raises(ValueError, match=r"'connection\.uri' and 'uri' both set 'uri'"):
        SourceConfig.from_options({"connection.uri": "mongodb://a/", "uri": "mongodb://b/"})
    with pytest.raises(ValueError, match="ISO-8601"):
        config(uri="mongodb://h/", startup_mode="timestamp", start_at_operation_time="soon")


def test_namespace_filter_and_the_connector_collection_lists() -> None:
    listed = config(uri="mongodb://h/", database="shop", namespaces="orders, shop.users")
    assert listed.namespaces == (("shop", "orders"), ("shop", "users"))
    assert listed.pipeline[0] == {"$match": {"$or": [
        {"ns.db": "shop", "ns.coll": "orders"},
        {"ns.db": "shop", "ns.coll": "users"},
        {"operationType": "invalidate"},
    ]}}
    cluster = config(uri="mongodb://h/", namespaces="shop.*,crm.leads", pipeline='[{"$limit": 1}]')
    assert cluster.database is None and cluster.pipeline[0]["$match"]["$or"][:2] == [
        {"ns.db": "shop"}, {"ns.db": "crm", "ns.coll": "leads"}
    ]
    assert cluster.pipeline[1] == {"$limit": 1}  # the user's stages come after the filter
    # mongo-spark's comma list and "*" mean the same: a database-level source, filtered.
    connector = SourceConfig.from_options(
        {"connection.uri": "mongodb://h/", "database": "shop", "collection": "orders,users"}
    )
    assert connector.collection is None and connector.namespaces == listed.namespaces
    every = SourceConfig.from_options(
        {"connection.uri": "mongodb://h/", "database": "shop", "collection": "*"}
    )
    assert every.collection is None and every.namespaces == ()
    for bad, message in [
        ({"namespaces": "orders"}, "needs a database"),
        ({"database": "shop", "namespaces": "crm.leads"}, "outside database 'shop'"),
        ({"database": "shop", "collection": "o", "namespaces": "shop.o"}, "only one namespace"),
        ({"namespaces": " , "}, "is empty"),
        ({"namespaces": ".x"}, "is not 'db.coll'"),
    ]:
        with pytest.raises(ValueError, match=message):
            SourceConfig.from_options({"uri": "mongodb://h/", **bad})


def test_infer_schema_needs_one_collection() -> None:
    assert config(uri="mongodb://h/", database="d", collection="c", infer_schema="true",
                  samplesize="50").infer_schema_sample_size == 50
    with pytest.raises(ValueError, match="infer_schema=true samples one collection"):
        config(uri="mongodb://h/", database="d", infer_schema="true")


def test_infer_ddl_widens_numbers_types_nesting_and_falls_back_to_string() -> None:
    documents: list[dict[str, Any]] = [
        {"_id": ObjectId(), "qty": 1, "price": 2, "big": Int64(5), "ok": True,
         "at": datetime.datetime(2026, 1, 1), "tags": ["a"], "addr": {"city": "Oslo"},
         "mixed": 1, "blob": b"\x00", "dec": Decimal128("1.5"), "ts": Timestamp(1, 1),
         "empty": {}, "nothing": None},
        {"_id": ObjectId(), "qty": 3_000_000_000, "price": 2.5, "tags": [],
         "addr": {"zip": 1234}, "mixed": "one", "new": [{"k": 1}, {"k": 2.0}]},
    ]
    assert infer_ddl(documents) == (
        "`_id` STRING, `qty` BIGINT, `price` DOUBLE, `big` BIGINT, `ok` BOOLEAN, "
        "`at` TIMESTAMP, `tags` ARRAY<STRING>, `addr` STRUCT<`city`: STRING, `zip`: INT>, "
        "`mixed` STRING, `blob` BINARY, `dec` STRING, `ts` STRING, `empty` STRING, "
        "`nothing` STRING, `new` ARRAY<STRUCT<`k`: DOUBLE>>"
    )
    wide = {"counts": {f"k{i}": i for i in range(MAP_MIN_KEYS)}, "odd`name": 1}
    assert infer_ddl([wide]) == "`counts` MAP<STRING, INT>, `odd``name` INT"
    with pytest.raises(ValueError, match="no documents"):
        infer_ddl([])


def test_session_settings_are_defaults_and_a_query_option_wins() -> None:
    from changestream.spark_adapter._config import session_settings

    session = session_settings({
        "spark.mongodb.read.connection.uri": "mongodb://session/",
        "spark.mongodb.read.database": "shop",
        "spark.mongodb.read.collection": "orders",
        "spark.mongodb.read.partitioner": "SamplePartitioner",  # the connector's batch reads
        "spark.mongodb.read.comment": "not supported here, but a session setting: skipped",
        "spark.mongodb.write.connection.uri": "mongodb://writes/",  # not a read setting
        "spark.sql.shuffle.partitions": "2",
    })
    assert set(session) == {
        "spark.mongodb.read.connection.uri", "spark.mongodb.read.database",
        "spark.mongodb.read.collection", "spark.mongodb.read.partitioner",
        "spark.mongodb.read.comment",
    }
    defaults = SourceConfig.from_options({}, session)
    assert (defaults.uri, defaults.database, defaults.collection) == (
        "mongodb://session/", "shop", "orders"
    )
    for name in ("uri", "connection.uri", "spark.mongodb.read.connection.uri"):
        assert SourceConfig.from_options({name: "mongodb://query/"}, session).uri == (
            "mongodb://query/"
        ), name
    with pytest.raises(ValueError, match="option 'uri' is required"):
        SourceConfig.from_options({"database": "shop"}, {})


def test_unknown_options_list_the_connector_aliases_and_suggest_the_closest() -> None:
    with pytest.raises(ValueError) as refused:
        SourceConfig.from_options({"uri": "mongodb://h/", "full_documnt": "updateLookup"})
    message = str(refused.value)
    assert "'full_documnt' (did you mean 'full_document'?)" in message
    assert all(alias in message for alias in MONGO_SPARK_ALIASES), message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"did you mean 'change\.stream\.startup\.mode'"):
        SourceConfig.from_options({"uri": "mongodb://h/", "change.stream.startup.mod": "latest"})
    with pytest.raises(ValueError) as nothing_close:
        SourceConfig.from_options({"uri": "mongodb://h/", "zzz": "1"})
    assert "did you mean" not in str(nothing_close.value)


def test_unreachable_deployments_and_refused_credentials_read_as_one_line() -> None:
    from pymongo.errors import OperationFailure, ServerSelectionTimeoutError

    from changestream.errors import ChangeStreamError
    from changestream.spark_adapter._errors import history_lost_as_error

    with pytest.raises(ChangeStreamError) as unreachable, history_lost_as_error(None):
        raise ServerSelectionTimeoutError(
            "db:27017: [Errno 111] Connection refused, Timeout: 30s, Topology Description: <...>"
        )
    assert str(unreachable.value).startswith(
        "cannot reach the MongoDB deployment (ServerSelectionTimeoutError: db:27017: "
    )
    assert "Topology" not in str(unreachable.value) and unreachable.value.__cause__ is None
    with pytest.raises(ChangeStreamError) as refused, history_lost_as_error(None):
        raise OperationFailure("Authentication failed.", code=18,
                               details={"ok": 0, "code": 18, "codeName": "AuthenticationFailed",
                                        "errmsg": "Authentication failed."})
    assert str(refused.value).startswith(
        "the MongoDB deployment refused the credentials (18 AuthenticationFailed: "
        "Authentication failed.)"
    )
