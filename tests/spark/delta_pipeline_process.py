"""A Delta pipeline process for the kill -9 tests: run it, SIGKILL its process group, restart.

    python delta_pipeline_process.py {helper|source} URI DB COLL TABLE STATE

``helper``: :func:`foreach_batch` + ``stage_into(sink)`` with the
:class:`DeltaSink` as token store; ``source``: the data source with
``startup_mode=snapshot`` and ``foreachBatch(merge_into(sink))``, checkpointed in
STATE. Small batches, so a kill lands mid-batch. Runs until killed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pymongo import MongoClient
from spark_support import spark_builder

from changestream.delta import DeltaSink
from changestream.spark_adapter import (
    foreach_batch,
    merge_into,
    register,
    stage_into,
    stream_opener,
)


def main(argv: list[str]) -> None:
    mode, uri, database, collection, table, state = argv
    spark = spark_builder().getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    sink = DeltaSink(table, app_id=mode, full_document="updateLookup")
    if mode == "helper":
        coll = MongoClient(uri)[database][collection]
        opener = stream_opener(coll, full_document="updateLookup", max_await_time_ms=100)
        foreach_batch(spark, opener, stage_into(sink), sink, max_rows=20, max_seconds=0.2)
        return
    register(spark)
    query = (
        spark.readStream.format("changestream").option("uri", uri)
        .option("database", database).option("collection", collection)
        .option("full_document", "updateLookup").option("startup_mode", "snapshot")
        .option("max_rows_per_batch", "20").load()
        .writeStream.foreachBatch(merge_into(sink))
        .option("checkpointLocation", str(Path(state) / "checkpoint"))
        .trigger(processingTime="200 milliseconds").start()
    )
    query.awaitTermination()


if __name__ == "__main__":
    main(sys.argv[1:])
