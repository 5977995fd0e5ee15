"""Change events into a Delta table: events/s of ``mirror`` and ``foreach_batch``, replay cost.

    python -m benchmarks.delta_bench                      # 50,000 events, simulator child
    python -m benchmarks.delta_bench --events 200000 --spark   # + foreach_batch (local[2])
    python -m benchmarks.delta_bench --events 100000 --spark-only --batch 50000   # Spark paths

Documents are about ``--doc-bytes`` (200) bytes of JSON, as in the other benchmarks.

The simulator runs in its own process. Modes (each catches up ``--events``
updates of ``--keys`` documents written before it starts, so it measures
the consumer, not the writer):

Events are inserts of new documents by default; ``--updates`` makes them updates of
``--keys`` documents, which also measures the server's ``updateLookup``.

* (m) ``changestream mirror``'s loop in process: ``consume`` with
  :class:`changestream.delta.DeltaSink` as handler and store, ``--batch`` changes
  per commit (the command adds only its status line).
* (f) ``foreach_batch`` + ``stage_into(sink)`` with the sink as token store
  (``--spark``): Spark ``local[2]``, ``max_rows=--batch``.
* (d) the same, but ``func`` gets a DataFrame and collects it back to Arrow (what
  ``stage_into`` did before ``foreach_batch`` handed it the Arrow batch, and what the
  data source's ``foreachBatch`` + ``merge_into`` still does).
* (n) first (its query pays the Python workers' start), then (q):
* (q) the data source's ``foreachBatch`` + ``merge_into(sink)`` (``--spark``): a
  streaming query (``Trigger.availableNow``, ``startup_mode=timestamp`` at the cluster
  time before the writes, ``max_rows_per_batch=--batch``), Spark's batch id as the version.
  Two rates: the whole query, its start included (``foreach_batch``'s (f) is timed after a
  warm-up run, the query is not), and its steady state: the micro-batches after the first,
  from the end of the first to the end of the last (what a running query sustains).
* (n) the same query with a ``func`` that only collects the batch as Arrow
  (``df.toArrow()``): the rate the stream reaches the driver through Spark, the ceiling
  of (q) on this machine.
* (s) (``--sink-only``, no server, no Spark) the driver's part of both Spark writers on
  ready Arrow batches of change rows (``--batch`` changes each: 80% updates, most to the
  newest 5% of keys, 20% inserts; ObjectId ``_id``s): ``stage_into``'s ``arrow_batch`` +
  the sink's ``save`` (the collapse in Arrow kernels and one append commit, compactions
  included), and the collapse alone: the rate the writers sustain once Spark has the rows.
* (r) one batch merged as a new version vs. the same batch replayed (skipped by
  its application transaction): the cost of the skip is reading the table's
  latest txn version.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from pymongo import MongoClient

import changestream

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_client import simulator
from changestream.delta import DeltaSink

PAD = "x" * 170
"""Set by ``--doc-bytes``: documents of about that many bytes of JSON."""


def document(i: int) -> dict[str, Any]:
    return {"_id": i, "v": 0, "pad": PAD}


def pin_then_write(coll: Any, sink: DeltaSink, keys: int, events: int, updates: bool) -> None:
    """Commit the stream's start in ``sink``, then write ``events`` changes it must catch up."""
    coll.insert_many([document(i) for i in range(keys)])
    stop = threading.Event()
    changestream.consume(coll, sink, sink, initial_snapshot=True, save_every=10_000,
                         watch_options={"full_document": "updateLookup",
                                        "max_await_time_ms": 100},
                         stop=stop, on_stats=lambda s: stop.set() if s.handled >= keys else None,
                         stats_interval=0.2)
    write(coll, keys, events, updates)


def write(coll: Any, keys: int, events: int, updates: bool) -> None:
    """``events`` inserts of new documents, or updates of the ``keys`` documents (each event
    then costs the server an updateLookup)."""
    if not updates:
        for start in range(keys, keys + events, 1000):
            coll.insert_many([document(i)
                              for i in range(start, min(start + 1000, keys + events))])
        return
    ops = [{"q": {"_id": n % keys}, "u": {"$inc": {"v": 1}}, "upsert": True}
           for n in range(events)]
    for start in range(0, events, 1000):
        coll.database.command("update", coll.name, updates=ops[start:start + 1000])


def mirror_rate(uri: str, events: int, keys: int, batch: int, path: str,
                updates: bool) -> float:
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    coll = client.bench[f"m{time.monotonic_ns()}"]
    sink = DeltaSink(path, app_id="bench", full_document="updateLookup")
    pin_then_write(coll, sink, keys, events, updates)
    stop = threading.Event()
    started = time.perf_counter()
    result = changestream.consume(
        coll, sink, sink, initial_snapshot=True, save_every=batch,
        watch_options={"full_document": "updateLookup", "max_await_time_ms": 100},
        stop=stop, on_stats=lambda s: stop.set() if s.handled >= events else None,
        stats_interval=0.2)
    elapsed = time.perf_counter() - started
    assert result.handled >= events, result
    client.close()
    return result.handled / elapsed


def foreach_batch_rate(uri: str, events: int, keys: int, batch: int, path: str,
                       updates: bool, dataframe: bool = False) -> float:
    """``foreach_batch`` + ``stage_into``: the Arrow batch straight to the sink, or (with
    ``dataframe``) through a DataFrame, as a ``func`` without ``arrow_batch`` gets it."""
    from changestream.spark_adapter import foreach_batch, stage_into, stream_opener

    spark = spark_session()
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    coll = client.bench[f"f{time.monotonic_ns()}"]
    sink = DeltaSink(path, app_id="bench", full_document="updateLookup")
    opener = stream_opener(coll, full_document="updateLookup", max_await_time_ms=100)
    stage = stage_into(sink)
    func = (lambda df, batch_id: stage(df, batch_id)) if dataframe else stage
    foreach_batch(spark, opener, func, sink, until_idle=True)
    write(coll, keys, events, updates)
    started = time.perf_counter()
    result = foreach_batch(spark, opener, func, sink, max_rows=batch, until_idle=True)
    elapsed = time.perf_counter() - started
    client.close()
    return result.rows / elapsed


def spark_session() -> Any:
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def data_source_rate(uri: str, events: int, keys: int, batch: int, path: str,
                     updates: bool, sink_it: bool = True) -> tuple[float, float]:
    """The data source's ``foreachBatch`` + ``merge_into`` (or, without ``sink_it``, a
    ``func`` that only collects the batch as Arrow) over ``events`` changes written before
    the query starts (from the cluster time before the writes): changes/s of the whole
    query (its start included: a new Python process for the reader, the first scan, the
    JVM compiling Spark's planning code) and of its steady state (the micro-batches after
    the first, from the end of the first to the end of the last: what a running query
    sustains)."""
    from changestream.spark_adapter import merge_into, register

    spark = spark_session()
    register(spark)
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    coll = client.bench[f"q{time.monotonic_ns()}"]
    coll.insert_many([document(i) for i in range(keys)])
    start = client.admin.command("hello")["operationTime"]
    write(coll, keys, events, updates)
    rows = 0
    if sink_it:
        sink = DeltaSink(path, app_id="bench", full_document="updateLookup")
        func = merge_into(sink)
    else:
        def func(df: Any, batch_id: int) -> None:
            nonlocal rows
            rows += df.toArrow().num_rows

    reader = (spark.readStream.format("changestream").option("uri", uri)
              .option("database", coll.database.name).option("collection", coll.name)
              .option("full_document", "updateLookup").option("startup_mode", "timestamp")
              .option("start_at_operation_time",
                      f'{{"$timestamp": {{"t": {start.time}, "i": {start.inc + 1}}}}}'))
    if batch:
        reader = reader.option("max_rows_per_batch", str(batch))
    ends: dict[int, float] = {}  # when each micro-batch's func returned, by batch id

    def timed(df: Any, batch_id: int) -> None:
        func(df, batch_id)
        ends[batch_id] = time.perf_counter()

    started = time.perf_counter()
    query = (reader.load().writeStream.foreachBatch(timed)
             .option("checkpointLocation", f"{path}.chk").trigger(availableNow=True).start())
    query.awaitTermination()
    elapsed = time.perf_counter() - started
    assert query.exception() is None, query.exception()
    if sink_it:
        state = DeltaSink(path, app_id="bench").read_current().num_rows
        assert state == (min(keys, events) if updates else events), state
    else:
        assert rows == events, rows
    client.close()
    counts = sorted((progress["batchId"], progress["numInputRows"])
                    for progress in query.recentProgress
                    if progress["numInputRows"] and progress["batchId"] in ends)
    steady = (sum(rows for _, rows in counts[1:]) / (ends[counts[-1][0]] - ends[counts[0][0]])
              if len(counts) > 1 else float("nan"))
    return events / elapsed, steady


def change_batches(count: int, rows: int) -> list[Any]:
    """Arrow batches of change rows as the Spark source gives them (JSON columns)."""
    import random

    import pyarrow as pa
    from bson import ObjectId

    from changestream.spark_adapter._convert import relaxed_json

    rnd = random.Random(7)
    ids: list[Any] = []
    batches = []
    for number in range(count):
        columns: list[list[Any]] = [[], [], [], [], [], []]
        for i in range(rows):
            if not ids or rnd.random() < 0.2:
                ids.append(ObjectId())
                key, operation = ids[-1], "insert"
            elif rnd.random() < 0.8:
                key, operation = ids[-1 - int(rnd.random() * len(ids) * 0.05)], "update"
            else:
                key, operation = rnd.choice(ids), "update"
            doc = {"_id": key, "v": i, "pad": PAD}
            for column, value in zip(columns, (f"82{number:08X}{i:06X}", operation, "bench",
                                               "c", relaxed_json({"_id": key}),
                                               relaxed_json(doc)), strict=True):
                column.append(value)
        batches.append(pa.table(
            {name: pa.array(column, pa.string()) for name, column in zip(
                ("resume_token", "operation_type", "database", "collection", "document_key",
                 "full_document"), columns, strict=True)}))
    return batches


def sink_only(path: str, rows: int, count: int) -> tuple[float, float]:
    """Changes/s of ``stage_into`` + ``save`` on ready batches, and of the collapse alone."""
    from changestream.spark_adapter import stage_into
    from changestream.spark_adapter._merge import _merge_table

    batches = change_batches(count, rows)
    sink = DeltaSink(path, app_id="bench", full_document="updateLookup")
    stage = stage_into(sink)
    started = time.perf_counter()
    for number, batch in enumerate(batches):
        stage.arrow_batch(batch, number)
        sink.save({"_data": batch.column("resume_token")[-1].as_py()}, batch_id=number)
    written = rows * count / (time.perf_counter() - started)
    started = time.perf_counter()
    for batch in batches:
        _merge_table(batch, sink)
    return written, rows * count / (time.perf_counter() - started)


def replay_cost(path: str, rows: int, runs: int) -> tuple[float, float]:
    """Seconds to merge a ``rows``-row batch as a new version, and to skip its replay."""
    from bson.timestamp import Timestamp

    sink = DeltaSink(path, app_id="replay")
    token = {"_data": "8200000001000000012B0229296E04"}
    changes = [{"_id": token, "operationType": "replace", "ns": {"db": "d", "coll": "c"},
                "clusterTime": Timestamp(1, 1), "documentKey": {"_id": i},
                "fullDocument": {"_id": i, "v": 1, "pad": "x" * 64}} for i in range(rows)]
    new, skipped = [], []
    for version in range(runs):
        started = time.perf_counter()
        assert sink.write(changes, version, token)
        new.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert not sink.write(changes, version, token)
        skipped.append(time.perf_counter() - started)
    return sorted(new)[runs // 2], sorted(skipped)[runs // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--keys", type=int, default=5_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--spark", action="store_true")
    parser.add_argument("--spark-only", action="store_true",
                        help="only the Spark modes (f), (q), (n) (implies --spark)")
    parser.add_argument("--sink-only", action="store_true",
                        help="only (s): the Spark writers' driver side on ready Arrow batches")
    parser.add_argument("--doc-bytes", type=int, default=200,
                        help="bytes of JSON per document (default 200)")
    parser.add_argument("--updates", action="store_true",
                        help="updates of --keys documents (updateLookup) instead of inserts")
    parser.add_argument("--version", default="8.0")
    args = parser.parse_args()
    global PAD
    PAD = "x" * max(0, args.doc_bytes - len('{"_id": 100000, "v": 0, "pad": ""}'))
    args.spark = args.spark or args.spark_only
    print(f"load average at start: {os.getloadavg()[0]:.1f} (2 cores, shared)")
    work = tempfile.mkdtemp(prefix="delta_bench_")
    if args.sink_only:
        try:
            written, collapsed = sink_only(f"{work}/s", args.batch, 10)
            print(f"(s) stage_into + save, 10 ready batches of {args.batch}: {written:,.0f} "
                  f"changes/s; the collapse alone {collapsed:,.0f} changes/s")
            print(f"load average at end: {os.getloadavg()[0]:.1f}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    try:
        with simulator(args.version) as (uri, _pid):
            if not args.spark_only:
                rate = mirror_rate(uri, args.events, args.keys, args.batch, f"{work}/m",
                                   args.updates)
                print(f"(m) mirror loop (consume + DeltaSink), {args.batch}/commit: "
                      f"{rate:,.0f} events/s")
            if args.spark:
                rate = foreach_batch_rate(uri, args.events, args.keys, args.batch, f"{work}/f",
                                          args.updates)
                print(f"(f) foreach_batch + stage_into, max_rows {args.batch}: {rate:,.0f} events/s")
                if not args.spark_only:
                    rate = foreach_batch_rate(uri, args.events, args.keys, args.batch,
                                              f"{work}/d", args.updates, dataframe=True)
                    print(f"(d) the same through a DataFrame (Arrow -> Spark -> Arrow): "
                          f"{rate:,.0f} events/s")
                rate, steady = data_source_rate(uri, args.events, args.keys, args.batch,
                                                f"{work}/n", args.updates, sink_it=False)
                print(f"(n) data source foreachBatch + df.toArrow() only (the ceiling of q): "
                      f"{rate:,.0f} events/s (steady state after the first batch: "
                      f"{steady:,.0f}/s)")
                rate, steady = data_source_rate(uri, args.events, args.keys, args.batch,
                                                f"{work}/q", args.updates)
                print(f"(q) data source foreachBatch + merge_into, max_rows_per_batch "
                      f"{args.batch}: {rate:,.0f} events/s (steady state after the first "
                      f"batch: {steady:,.0f}/s)")
            print(f"load average at end: {os.getloadavg()[0]:.1f}")
        for rows in () if args.spark_only else (1_000, args.batch):
            new, skipped = replay_cost(f"{work}/r{rows}", rows, 5)
            print(f"(r) {rows}-row batch: merge {new * 1000:.1f} ms, replay skipped in "
                  f"{skipped * 1000:.1f} ms (median of 5)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
