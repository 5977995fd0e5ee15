"""Change events into a Delta table: events/s of ``mirror`` and ``foreach_batch``, replay cost.

    python -m benchmarks.delta_bench                      # 50,000 events, simulator child
    python -m benchmarks.delta_bench --events 200000 --spark   # + foreach_batch (local[2])

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


def pin_then_write(coll: Any, sink: DeltaSink, keys: int, events: int, updates: bool) -> None:
    """Commit the stream's start in ``sink``, then write ``events`` changes it must catch up."""
    coll.insert_many([{"_id": i, "v": 0, "pad": "x" * 64} for i in range(keys)])
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
            coll.insert_many([{"_id": i, "v": 0, "pad": "x" * 64}
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
    from pyspark.sql import SparkSession

    from changestream.spark_adapter import foreach_batch, stage_into, stream_opener

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
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
    parser.add_argument("--updates", action="store_true",
                        help="updates of --keys documents (updateLookup) instead of inserts")
    parser.add_argument("--version", default="8.0")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="delta_bench_")
    try:
        with simulator(args.version) as (uri, _pid):
            rate = mirror_rate(uri, args.events, args.keys, args.batch, f"{work}/m",
                               args.updates)
            print(f"(m) mirror loop (consume + DeltaSink), {args.batch}/commit: {rate:,.0f} events/s")
            if args.spark:
                rate = foreach_batch_rate(uri, args.events, args.keys, args.batch, f"{work}/f",
                                          args.updates)
                print(f"(f) foreach_batch + stage_into, max_rows {args.batch}: {rate:,.0f} events/s")
                rate = foreach_batch_rate(uri, args.events, args.keys, args.batch, f"{work}/d",
                                          args.updates, dataframe=True)
                print(f"(d) the same through a DataFrame (Arrow -> Spark -> Arrow): "
                      f"{rate:,.0f} events/s")
        for rows in (1_000, args.batch):
            new, skipped = replay_cost(f"{work}/r{rows}", rows, 5)
            print(f"(r) {rows}-row batch: merge {new * 1000:.1f} ms, replay skipped in "
                  f"{skipped * 1000:.1f} ms (median of 5)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
