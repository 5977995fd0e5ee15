"""A pipeline process for the crash tests: run it, SIGKILL its process group, restart from its state.

    python pipeline_process.py {helper|source|snapshot} URI DB COLL START_TOKEN_JSON OUT STATE HOLD

``helper`` runs :func:`foreach_batch` with a ``FileTokenStore`` in STATE;
``source`` runs a ``changestream`` streaming query checkpointed in STATE;
``snapshot`` the same query with ``startup_mode=snapshot`` (one ``_id`` range per batch).
Both start after START_TOKEN_JSON and write each batch to OUT with
:class:`spark_support.ParquetSink`, which holds ``func`` for HOLD seconds
after the file of batch 2 (and later) is written, so a kill lands between
"output written" and "progress saved" after two completed batches. Runs
until killed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pymongo import MongoClient
from spark_support import ParquetSink, spark_builder

from changestream import token_from_json
from changestream.spark_adapter import foreach_batch, register, stream_opener
from changestream.stores import FileTokenStore


def main(argv: list[str]) -> None:
    mode, uri, database, collection, start_json, out, state, hold = argv
    spark = spark_builder().getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    sink = ParquetSink(Path(out), hold_seconds=float(hold), hold_from=2)
    if mode == "helper":
        coll = MongoClient(uri)[database][collection]
        open_stream = stream_opener(coll, start_after=token_from_json(start_json), batch_size=500)
        store = FileTokenStore(Path(state) / "token.json")
        foreach_batch(spark, open_stream, sink, store, max_rows=50, max_seconds=0.3)
        return
    register(spark)
    start = {"startup_mode": "token", "start_after": start_json, "max_rows_per_batch": "50"}
    if mode == "snapshot":  # copy one _id range per batch, then stream
        start = {"startup_mode": "snapshot", "snapshot_partitions": "6",
                 "snapshot_ranges_per_batch": "1", "full_document": "updateLookup"}
    reader = (
        spark.readStream.format("changestream")
        .option("uri", uri)
        .option("database", database)
        .option("collection", collection)
    )
    for key, value in start.items():
        reader = reader.option(key, value)
    query = (
        reader.load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(Path(state) / "checkpoint"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    query.awaitTermination()


if __name__ == "__main__":
    main(sys.argv[1:])
