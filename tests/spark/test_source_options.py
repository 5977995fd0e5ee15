"""The data source's option story end to end: session-wide settings, split large events, and
what a query says when the deployment cannot be reached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from spark_support import PANDAS_WARNING, ParquetSink, current_token

import changestream
from changestream.spark_adapter import register

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]

_UNREACHABLE = "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=1000"
"""Nothing listens on the discard port of loopback: connection refused at once."""


def _finish(query: Any, timeout: float = 300) -> None:
    if not query.awaitTermination(timeout):
        query.stop()
        pytest.fail(f"the availableNow query did not end within {timeout}s")


def test_session_settings_are_defaults_that_a_query_option_overrides(
    spark: Any, mongodb_uri: str, coll: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    start = current_token(coll)
    coll.insert_many([{"_id": i} for i in range(3)])
    settings = {
        "spark.mongodb.read.connection.uri": _UNREACHABLE,  # the option below wins
        "spark.mongodb.read.database": coll.database.name,
        "spark.mongodb.read.collection": coll.name,
        "spark.mongodb.read.partitioner": "for the connector's batch reads: ignored here",
    }
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        register(spark)
        df = (
            spark.readStream.format("changestream")
            .option("connection.uri", mongodb_uri)
            .option("startup_mode", "token")
            .option("start_after", changestream.token_to_json(start))
            .load()
        )
        query = (
            df.writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(tmp_path / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        _finish(query)
    finally:
        for key in settings:
            spark.conf.unset(key)
        register(spark)
    assert sink.ids() == [0, 1, 2]


def test_an_unreachable_deployment_fails_the_query_naming_the_cause(
    spark: Any, sink: ParquetSink, tmp_path: Path
) -> None:
    df = (
        spark.readStream.format("changestream")
        .option("uri", _UNREACHABLE)
        .option("database", "d")
        .option("collection", "c")
        .load()
    )
    query = (
        df.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(StreamingQueryException) as caught:
        _finish(query)
    message = str(caught.value)
    # Spark's own first line names the phase; the Python error's is ours: one line, the cause
    # first, and no PyMongo topology dump or chained traceback burying it.
    errors = [line for line in message.splitlines() if line.startswith("changestream.errors.")]
    assert len(errors) == 1, message
    assert errors[0].startswith(
        "changestream.errors.ChangeStreamError: cannot reach the MongoDB deployment "
        "(ServerSelectionTimeoutError: 127.0.0.1:9: [Errno 111] Connection refused)"
    ), errors[0]
    assert "Topology Description" not in message and "During handling" not in message


BIG = 10 * 1024 * 1024


def test_events_over_16_mib_are_reassembled_into_one_row(mongodb_uri: str, coll: Any) -> None:
    """``$changeStreamSplitLargeEvent`` as the last stage: fragments become one row, the batch
    ends at the last fragment's token, and a replay from the server yields the same row."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable
    from pyspark.sql.types import StructType

    from changestream.spark_adapter._config import SourceConfig
    from changestream.spark_adapter._schema import ENVELOPE_COLUMNS
    from changestream.spark_adapter._source import ChangeStreamReader, TokenRange

    coll.database.create_collection(coll.name, changeStreamPreAndPostImages={"enabled": True})
    coll.insert_one({"_id": 1, "value": "q" * BIG})
    config = SourceConfig.from_options({
        "uri": mongodb_uri, "database": coll.database.name, "collection": coll.name,
        "pipeline": '[{"$changeStreamSplitLargeEvent": {}}]',
        "full_document_before_change": "required",
    })
    schema = StructType.fromJson({"type": "struct", "fields": [
        {"name": name, "nullable": True, "metadata": {},
         "type": "string" if kind == "STRING" else
         {"type": "struct", "fields": [
             {"name": f, "type": "long", "nullable": True, "metadata": {}} for f in "ti"
         ]} if name == "cluster_time" else "timestamp" if kind == "TIMESTAMP" else "long"}
        for name, kind in ENVELOPE_COLUMNS
    ]})
    reader = ChangeStreamReader(config, schema)
    try:
        start = reader.initialOffset()
        coll.update_one({"_id": 1}, {"$set": {"value": "z" * BIG}})  # > 16 MiB: 2 fragments
        coll.insert_one({"_id": 2})
        end = reader.latestOffset(start, ReadAllAvailable())
        rows = [
            row
            for partition in reader.partitions(start, end)
            for batch in reader.read(partition)
            for row in batch.to_pylist()
        ]
    finally:
        reader.stop()
    assert [row["operation_type"] for row in rows] == ["update", "insert"]
    update = rows[0]
    assert len(update["full_document_before_change"]) > BIG
    assert f'"{"z" * 8}' in update["update_description"]
    assert len(update["update_description"]) > BIG
    replayed = [
        row
        for batch in ChangeStreamReader(config, schema).read(TokenRange(start, end))
        for row in batch.to_pylist()
    ]
    assert replayed == rows
