"""Snapshot, then stream: copy throughput, client CPU per document, memory over a large copy.

    python -m benchmarks.snapshot_bench                           # 200,000 docs, simulator child
    python -m benchmarks.snapshot_bench --docs 1000000 --memory   # + RSS/traced memory every 100k
    python -m benchmarks.snapshot_bench --spark                   # + Spark batch read, local[2]
    python -m benchmarks.snapshot_bench --uri "mongodb://host:27017/?replicaSet=rs0"

The simulator runs in a separate process (``python -m changestream.testing serve``),
so the client's CPU time (``time.process_time()``) is the client's own. Modes:

* (a) raw ``find``: PyMongo ``find().sort("_id")`` with the same batch size, dicts: the
  floor of any copy (no snapshot read concern, no records).
* (b) ``snapshot_then_watch``: the copy phase, records as dicts (``copy_batch_size``).
* (s) Spark batch read, ``local[2]`` (2 executors), ``snapshot_partitions=2``,
  ``write.format("noop")``: documents/s end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc
from typing import Any

from pymongo import MongoClient

import changestream

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_client import current_rss_mb, simulator

PAYLOAD = "x" * 32
INSERT_BATCH = 10_000
SAMPLE_EVERY = 100_000


def preload(coll: Any, count: int) -> None:
    began = time.perf_counter()
    for offset in range(0, count, INSERT_BATCH):
        size = min(INSERT_BATCH, count - offset)
        coll.insert_many([{"_id": offset + k, "s": PAYLOAD} for k in range(size)], ordered=False)
    print(f"preloaded {count:,} documents in {time.perf_counter() - began:.1f} s", flush=True)


def run_find(coll: Any, count: int, batch: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    n = sum(1 for _ in coll.find(batch_size=batch).sort("_id", 1))
    if n != count:
        raise RuntimeError(f"find read {n} documents, expected {count}")
    return time.perf_counter() - wall, time.process_time() - cpu


def run_copy(coll: Any, count: int, batch: int, *, memory: bool = False) -> tuple[float, float]:
    samples = []
    if memory:
        tracemalloc.start()
    wall, cpu = time.perf_counter(), time.process_time()
    n = 0
    with changestream.snapshot_then_watch(coll, copy_batch_size=batch, max_await_time_ms=10) as s:
        while s.copying:
            record = s.try_next()
            if record is None:
                break
            n += 1
            if memory and n % SAMPLE_EVERY == 0:
                current, peak = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                sample = {"docs": n, "rss_mb": round(current_rss_mb(), 1),
                          "traced_mb": round(current / 2**20, 2),
                          "traced_peak_mb": round(peak / 2**20, 2)}
                samples.append(sample)
                print(f"  {n:>9,} docs  RSS {sample['rss_mb']:7.1f} MB  traced "
                      f"{sample['traced_mb']:6.2f} MB (peak {sample['traced_peak_mb']:6.2f} MB)",
                      flush=True)
    elapsed, used = time.perf_counter() - wall, time.process_time() - cpu
    if memory:
        tracemalloc.stop()
    if n != count:
        raise RuntimeError(f"the copy delivered {n} records, expected {count}")
    return elapsed, used


def run_spark(uri: str, coll: Any, count: int) -> float:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from changestream.spark_adapter import register

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")

    register(spark)
    df = (spark.read.format("changestream").option("uri", uri)
          .option("database", coll.database.name).option("collection", coll.name)
          .option("snapshot_partitions", "2").load())
    began = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()  # every row read and converted
    elapsed = time.perf_counter() - began
    n = df.count()
    if n != count:
        raise RuntimeError(f"Spark read {n} rows, expected {count}")
    spark.stop()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--memory", action="store_true", help="sample memory during one copy")
    parser.add_argument("--spark", action="store_true", help="also time the Spark batch read")
    parser.add_argument("--uri")
    parser.add_argument("--version", default="8.0")
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    def bench(uri: str) -> dict[str, Any]:
        client: MongoClient[dict[str, Any]] = MongoClient(uri)
        coll = client.bench[f"snap_{os.getpid()}"]
        coll.drop()
        preload(coll, args.docs)
        out: dict[str, Any] = {"docs": args.docs, "batch": args.batch}
        for name, fn in (("find", run_find), ("copy", run_copy)):
            best = min((fn(coll, args.docs, args.batch) for _ in range(args.runs)),
                       key=lambda r: r[0])
            out[name] = {"docs_per_s": round(args.docs / best[0]),
                         "client_cpu_us_per_doc": round(best[1] / args.docs * 1e6, 2)}
            print(f"{name:5s} {out[name]['docs_per_s']:>9,} docs/s wall  "
                  f"{out[name]['client_cpu_us_per_doc']:6.2f} µs client CPU/doc", flush=True)
        if args.memory:
            run_copy(coll, args.docs, args.batch, memory=True)
        if args.spark:
            elapsed = run_spark(uri, coll, args.docs)
            out["spark"] = {"docs_per_s": round(args.docs / elapsed), "executors": 2}
            print(f"spark {out['spark']['docs_per_s']:>9,} docs/s wall (local[2], 2 ranges)",
                  flush=True)
        coll.drop()
        client.close()
        return out

    if args.uri:
        result = bench(args.uri)
    else:
        with simulator(args.version) as (uri, _pid):
            result = bench(uri)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
