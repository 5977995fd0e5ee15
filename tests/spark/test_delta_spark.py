"""The Delta sink from both Spark paths: the table equals the collection, each batch once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from spark_support import PANDAS_WARNING, wait_for

pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")

from bson import json_util
from delta_support import (
    assert_mirrors,
    committed_versions,
    plain_state,
    table_state,
    write_mix,
)

import changestream
from changestream.delta import DeltaSink, DocumentSchemaError
from changestream.spark_adapter import (
    foreach_batch,
    merge_into,
    merge_into_tables,
    merge_ready,
    stage_into,
    stream_opener,
)

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]

SCRIPT = Path(__file__).with_name("delta_pipeline_process.py")


def test_foreach_batch_into_delta_with_the_sink_as_token_store(
    spark: Any, coll: Any, tmp_path: Path
) -> None:
    sink = DeltaSink(tmp_path / "t", app_id="helper", full_document="updateLookup")
    opener = stream_opener(coll, full_document="updateLookup", max_await_time_ms=50)
    foreach_batch(spark, opener, stage_into(sink), sink, until_idle=True)  # pins the start
    write_mix(coll, 150, seed=5)
    result = foreach_batch(spark, opener, stage_into(sink), sink, max_rows=50, until_idle=True)
    assert result.batches >= 3
    assert_mirrors(tmp_path / "t", coll, "helper")
    write_mix(coll, 60, seed=6)
    foreach_batch(spark, opener, stage_into(sink), sink, max_rows=50, until_idle=True)
    assert_mirrors(tmp_path / "t", coll, "helper")


def test_data_source_foreach_batch_into_delta_from_the_snapshot(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path
) -> None:
    coll.insert_many([{"_id": i, "v": "before"} for i in range(60)])
    sink = DeltaSink(tmp_path / "t", app_id="query", full_document="updateLookup")
    writer = threading.Thread(target=write_mix, args=(coll, 120, 7))
    writer.start()

    def run() -> None:
        df = (spark.readStream.format("changestream").option("uri", mongodb_uri)
              .option("database", coll.database.name).option("collection", coll.name)
              .option("full_document", "updateLookup").option("startup_mode", "snapshot")
              .option("max_rows_per_batch", "80").load())
        query = (df.writeStream.foreachBatch(merge_into(sink))
                 .option("checkpointLocation", str(tmp_path / "chk"))
                 .trigger(availableNow=True).start())
        query.awaitTermination(300)

    run()
    writer.join()
    run()  # picks up what was written after the first query's target
    assert_mirrors(tmp_path / "t", coll, "query")
    before = table_state(tmp_path / "t")
    versions = committed_versions(tmp_path / "t", "query")
    # Spark runs the last batch again after a failure: same id, skipped.
    replay = spark.createDataFrame([], "resume_token STRING")
    assert not sink.write(sink_table(replay), versions[-1])
    assert table_state(tmp_path / "t") == before


def sink_table(df: Any) -> Any:
    import pyarrow as pa

    return pa.table({"_key": pa.array([], pa.string()), "_op": pa.array([], pa.string()),
                     "document": pa.array([], pa.string())})


def test_merge_ready_dataframe_takes_the_last_change_in_token_order(
    spark: Any, coll: Any, tmp_path: Path
) -> None:
    coll.insert_many([{"_id": i, "v": 0} for i in range(3)])
    rows = [
        # one transaction: the same clusterTime, only the tokens order them
        ("82AA01", "update", '{"_id": 0}', '{"_id": 0, "v": "late"}'),
        ("82AA00", "update", '{"_id": 0}', '{"_id": 0, "v": "early"}'),
        ("82AA02", "delete", '{"_id": 1}', None),
        ("82AA03", "insert", '{"_id": 1}', '{"_id": 1, "v": "again"}'),
        ("82AA05", "delete", '{"_id": 2}', None),
        ("snapshot", "insert", '{"_id": 2}', '{"_id": 2, "v": 0}'),
        ("82AA06", "update", '{"_id": "2"}', None),
    ]
    df = spark.createDataFrame(
        [(t, op, "db", "c", key, doc) for t, op, key, doc in rows],
        "resume_token STRING, operation_type STRING, database STRING, collection STRING, "
        "document_key STRING, full_document STRING",
    )
    got = {r.key: (r.op, r.document) for r in merge_ready(df, full_document="updateLookup").collect()}
    assert got == {
        "0": ("upsert", '{"_id": 0, "v": "late"}'),
        "1": ("upsert", '{"_id": 1, "v": "again"}'),
        "2": ("delete", None),
        '"2"': ("delete", None),  # a string _id is another key; looked up after its delete
    }
    # The Delta writers collapse on the driver the same way, and refuse an unresolved update.
    sink = DeltaSink(str(tmp_path / 't'), app_id="direct")
    with pytest.raises(changestream.MissingDocumentError, match="full_document='updateLookup'"):
        merge_into(sink)(df, 0)
    merge_into(DeltaSink(str(tmp_path / 't'), app_id="direct", full_document="updateLookup"))(df, 0)
    assert table_state(str(tmp_path / 't')) == {0: {"_id": 0, "v": "late"},
                                              1: {"_id": 1, "v": "again"}}



# -- typed columns: DeltaSink(schema=...) from both Spark paths -----------------------------
DDL = "_id BIGINT, name STRING, qty INT, tags ARRAY<STRING>"


def typed_rows(path: Path) -> list[dict[str, Any]]:
    """The table's current state (the change log read on top of the base), by _id."""
    import deltalake

    from changestream._delta_layout import current_state

    return current_state(deltalake.DeltaTable(str(path))).sort_by("_id").to_pylist()


def test_typed_columns_from_the_data_source_and_from_foreach_batch(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path
) -> None:
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import DataType

    # The DDL read without a JVM is what Spark's parser and to_arrow_schema make of it.
    wide = DDL + ", m MAP<STRING, DOUBLE>, s STRUCT<a: DECIMAL(12,2), b: TIMESTAMP>, d DATE"
    assert DeltaSink(tmp_path / "x", schema=wide).schema == to_arrow_schema(
        DataType.fromDDL(wide), timezone="UTC")

    coll.insert_many([{"_id": 1, "name": "pen", "qty": 3, "tags": ["a"], "x": 0},
                      {"_id": 2, "name": "cup", "qty": 1}])
    # The data source with typed documents (STRUCT columns) into a sink with a StructType.
    source_sink = DeltaSink(tmp_path / "s", app_id="q", full_document="updateLookup",
                            schema=DataType.fromDDL(DDL))
    query = (spark.readStream.format("changestream").option("uri", mongodb_uri)
             .option("database", coll.database.name).option("collection", coll.name)
             .option("full_document", "updateLookup").option("startup_mode", "snapshot")
             .option("full_document_schema", DDL).load()
             .writeStream.foreachBatch(merge_into(source_sink))
             .option("checkpointLocation", str(tmp_path / "chk")).trigger(availableNow=True)
             .start())
    assert query.awaitTermination(240)
    assert query.exception() is None
    assert typed_rows(tmp_path / "s") == [
        {"_key": "1", "_id": 1, "name": "pen", "qty": 3, "tags": ["a"]},
        {"_key": "2", "_id": 2, "name": "cup", "qty": 1, "tags": None},
    ]
    # foreach_batch with the JSON full_document, parsed into a DDL schema.
    sink = DeltaSink(tmp_path / "f", app_id="h", full_document="updateLookup", schema=DDL)
    opener = stream_opener(coll, full_document="updateLookup", max_await_time_ms=50)
    foreach_batch(spark, opener, stage_into(sink), sink, until_idle=True)  # pins the start
    coll.update_one({"_id": 1}, {"$set": {"qty": 5.0}})
    coll.delete_one({"_id": 2})
    coll.insert_one({"_id": 3, "name": "ink", "tags": ["b", "c"]})
    foreach_batch(spark, opener, stage_into(sink), sink, until_idle=True)
    assert typed_rows(tmp_path / "f") == [
        {"_key": "1", "_id": 1, "name": "pen", "qty": 5, "tags": ["a"]},
        {"_key": "3", "_id": 3, "name": "ink", "qty": None, "tags": ["b", "c"]},
    ]
    # A value that does not fit: the batch fails, nothing is written, the position stays.
    before, position = typed_rows(tmp_path / "f"), sink.load()
    coll.insert_many([{"_id": 4, "qty": 7}, {"_id": 5, "qty": "many"}])
    with pytest.raises(DocumentSchemaError, match=r"field 'qty' of the document with _id 5 "):
        foreach_batch(spark, opener, stage_into(sink), sink, until_idle=True)
    assert typed_rows(tmp_path / "f") == before
    assert DeltaSink(tmp_path / "f", app_id="h", schema=DDL).load() == position


def test_a_typed_document_that_does_not_fit_the_sink_schema_fails_the_batch(
    spark: Any, tmp_path: Path
) -> None:
    ddl = "resume_token STRING, operation_type STRING, database STRING, collection STRING, " \
        "document_key STRING, full_document STRUCT<_id: BIGINT, qty: STRING>"
    df = spark.createDataFrame([
        ("82AA01", "insert", "db", "c", '{"_id": 1}', (1, "12")),
        ("82AA02", "insert", "db", "c", '{"_id": 2}', (2, "many")),
    ], ddl)
    sink = DeltaSink(tmp_path / "t", app_id="q", schema="_id BIGINT, qty INT")
    with pytest.raises(DocumentSchemaError, match=r"field 'qty' of the document with _id 2 .*"
                                                  r"int32: 'many'"):
        merge_into(sink)(df, 0)
    assert sink.table() is None  # nothing written
    merge_into(sink)(df.where("resume_token = '82AA01'"), 0)
    assert typed_rows(tmp_path / "t") == [{"_key": "1", "_id": 1, "qty": 12}]
    with pytest.raises(ValueError, match="give the sink a schema"):
        merge_into(DeltaSink(tmp_path / "j", app_id="q"))(df, 0)


@pytest.mark.parametrize("mode", ["helper", "source"])
def test_kill_9_of_the_delta_pipeline_then_restart_mirrors_the_collection(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path, mode: str
) -> None:
    coll.insert_many([{"_id": i, "v": "before"} for i in range(40)])
    table, state = str(tmp_path / "t"), tmp_path / "state"
    state.mkdir()
    if mode == "helper":  # pins the start (the data source copies a snapshot instead)
        sink = DeltaSink(table, app_id=mode, full_document="updateLookup")
        opener = stream_opener(coll, full_document="updateLookup", max_await_time_ms=50)
        foreach_batch(spark, opener, stage_into(sink), sink, until_idle=True)
        coll.update_many({}, {"$set": {"v": "pinned"}})
    log = (tmp_path / "pipeline.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, mongodb_uri, coll.database.name, coll.name,
         table, str(state)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=SCRIPT.parent,
    )
    writer = threading.Thread(target=write_mix, args=(coll, 150, 8))
    try:
        wait_for(lambda: process.poll() is not None or len(versions_or_none(table, mode)) >= 2,
                 timeout=240, what="the pipeline process to commit two batches")
        assert process.poll() is None, (tmp_path / "pipeline.log").read_text()[-3000:]
        writer.start()
        time.sleep(1.0)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log.close()
        if writer.is_alive() or writer.ident is not None:
            writer.join()
    sink = DeltaSink(table, app_id=mode, full_document="updateLookup")
    if mode == "helper":
        opener = stream_opener(coll, full_document="updateLookup", max_await_time_ms=50)
        foreach_batch(spark, opener, stage_into(sink), sink, max_rows=100, until_idle=True)
        assert_mirrors(table, coll, mode)
        return
    for _ in range(2):  # the second run takes what came after the first one's target
        query = (
            spark.readStream.format("changestream").option("uri", mongodb_uri)
            .option("database", coll.database.name).option("collection", coll.name)
            .option("full_document", "updateLookup").option("startup_mode", "snapshot")
            .load().writeStream.foreachBatch(merge_into(sink))
            .option("checkpointLocation", str(state / "checkpoint"))
            .trigger(availableNow=True).start()
        )
        assert query.awaitTermination(240)
    assert table_state(table) == {d["_id"]: d for d in coll.find()}
    versions = committed_versions(table, mode)
    assert versions == sorted(set(versions)), f"a Spark batch id committed twice: {versions}"


def versions_or_none(table: str, app_id: str) -> list[int]:
    try:
        return committed_versions(table, app_id)
    except Exception:  # no table yet
        return []


def test_the_data_source_on_a_database_into_one_table_per_collection(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path
) -> None:
    """A database's stream, one table per collection under one directory (mirror's layout)."""
    db = coll.database
    start = db.client.admin.command("ping")["$clusterTime"]["clusterTime"]
    for seed, name in enumerate(("a", "b")):
        write_mix(db[name], 60, seed)
    df = (spark.readStream.format("changestream").option("uri", mongodb_uri)
          .option("database", db.name).option("full_document", "updateLookup")
          .option("startup_mode", "timestamp")
          .option("start_at_operation_time", str(start.time)).option("max_rows_per_batch", "50")
          .load())
    query = (df.writeStream.foreachBatch(merge_into_tables(
                 str(tmp_path / "tables"), app_id="q", full_document="updateLookup"))
             .option("checkpointLocation", str(tmp_path / "chk"))
             .trigger(availableNow=True).start())
    query.awaitTermination(300)
    for name in ("a", "b"):
        assert table_state(tmp_path / "tables" / name) == {d["_id"]: d for d in db[name].find()}


# -- the Arrow path: keys as the sink writes them, one layout for every writer ------------------
def test_the_key_of_every_id_type_is_the_sinks_text_and_a_key_changed_often_ends_last(
    tmp_path: Path,
) -> None:
    import datetime
    import uuid

    import pyarrow as pa
    from bson import Binary, Decimal128, Int64, ObjectId, Timestamp

    from changestream._merge import key_json
    from changestream.spark_adapter._convert import relaxed_json
    from changestream.spark_adapter._merge import _merge_table

    ids: list[Any] = [
        7, -3, 0, Int64(2**40), 2**62, "a", 'q"uo\\te', "é ☃ \n", "", ObjectId(), 1.5, -0.0,
        float("nan"), True, None, {"b": 1, "a": [1, {"c": "d"}]}, [1, 2],
        datetime.datetime(2020, 1, 2, 3, 4, 5, 6000, tzinfo=datetime.timezone.utc),
        datetime.datetime(1960, 1, 1, tzinfo=datetime.timezone.utc), Decimal128("1.10"),
        Binary(uuid.UUID(int=5).bytes, 4), Timestamp(5, 6),
    ]
    rows = []
    for n in range(3):  # three changes of each key, in one batch, tokens out of order
        for i, _id in enumerate(ids):
            shard_key = {"region": "eu", "_id": _id} if i % 4 == 3 else {"_id": _id}
            token = f"82{(2 - n) * 100 + i:06X}" if n else f"82{900 + i:06X}"  # n=0 is last
            rows.append((token, "update", "db", "c", relaxed_json(shard_key),
                         relaxed_json({"_id": _id, "n": n})))
    changes = pa.table({name: pa.array(column, pa.string()) for name, column in zip(
        ("resume_token", "operation_type", "database", "collection", "document_key",
         "full_document"), zip(*rows, strict=True), strict=True)})

    class Sink:
        full_document = "updateLookup"
        schema = None

    table, cleared = _merge_table(changes, Sink())
    assert not cleared
    assert table.column("_key").to_pylist() == [key_json(_id) for _id in ids]
    assert all('"n": 0}' in doc for doc in table.column("document").to_pylist())


def run_mirror(uri: str, coll: Any, table: Path, app_id: str) -> None:
    """``changestream mirror --until-idle`` on ``table`` as ``app_id`` (the same sink, no JVM)."""
    done = subprocess.run(
        [sys.executable, "-m", "changestream", "mirror", uri, "--db", coll.database.name,
         "--coll", coll.name, "--to", str(table), "--app-id", app_id, "--batch", "25",
         "--batch-seconds", "0.2", "--until-idle", "1", "--no-status"],
        capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_foreach_batch_and_mirror_take_one_table_over_from_each_other(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path
) -> None:
    table = tmp_path / "t"
    opener = stream_opener(coll, full_document="updateLookup", max_await_time_ms=50)

    def spark_run() -> None:
        sink = DeltaSink(table, app_id="both", full_document="updateLookup")
        foreach_batch(spark, opener, stage_into(sink), sink, max_rows=30, until_idle=True)

    spark_run()  # pins the start
    write_mix(coll, 90, seed=11)
    spark_run()
    assert_mirrors(table, coll, "both")
    write_mix(coll, 90, seed=12)
    run_mirror(mongodb_uri, coll, table, "both")  # continues from the token Spark committed
    assert_mirrors(table, coll, "both")
    write_mix(coll, 90, seed=13)
    spark_run()  # and Spark from mirror's
    assert_mirrors(table, coll, "both")
    DeltaSink(table, app_id="both").finish()
    assert plain_state(table) == {doc["_id"]: doc for doc in coll.find()}


def test_the_data_source_and_mirror_take_one_table_over_from_each_other(
    spark: Any, mongodb_uri: str, coll: Any, tmp_path: Path
) -> None:
    table = tmp_path / "t"
    coll.insert_many([{"_id": i, "v": "before"} for i in range(40)])

    def query(sink: DeltaSink, checkpoint: str, **options: str) -> None:
        reader = (spark.readStream.format("changestream").option("uri", mongodb_uri)
                  .option("database", coll.database.name).option("collection", coll.name)
                  .option("full_document", "updateLookup").option("max_rows_per_batch", "40"))
        for name, value in options.items():
            reader = reader.option(name, value)
        running = (reader.load().writeStream.foreachBatch(merge_into(sink))
                   .option("checkpointLocation", str(tmp_path / checkpoint))
                   .trigger(availableNow=True).start())
        assert running.awaitTermination(240)
        assert running.exception() is None

    sink = DeltaSink(table, app_id="query", full_document="updateLookup")
    query(sink, "chk", startup_mode="snapshot")
    write_mix(coll, 90, seed=14)
    query(sink, "chk", startup_mode="snapshot")  # the stream after the copy
    assert table_state(table) == {doc["_id"]: doc for doc in coll.find()}
    # The query committed its last event's token with its batch: mirror resumes there
    # (without it mirror would copy the whole collection again).
    resumed = DeltaSink(table, app_id="query").load()
    assert resumed is not None and resumed.batch_id == committed_versions(table, "query")[-1]
    write_mix(coll, 90, seed=15)
    run_mirror(mongodb_uri, coll, table, "query")
    assert table_state(table) == {doc["_id"]: doc for doc in coll.find()}
    versions = committed_versions(table, "query")
    assert versions == sorted(set(versions)), versions
    # A new query (its own app id: Spark's batch ids start again at 0) after mirror's token.
    position = DeltaSink(table, app_id="query").load()
    assert position is not None
    write_mix(coll, 90, seed=16)
    after = json_util.dumps(position.token)
    query(DeltaSink(table, app_id="query2", full_document="updateLookup"), "chk2",
          startup_mode="token", start_after=after)
    assert table_state(table) == {doc["_id"]: doc for doc in coll.find()}
