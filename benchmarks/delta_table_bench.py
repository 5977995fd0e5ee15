"""The Delta sink at table sizes up to 10M rows: first load, skewed and uniform changes.

    python -m benchmarks.delta_table_bench                       # 100k, 1M, 10M rows (~15 min)
    python -m benchmarks.delta_table_bench --sizes 100000,1000000 --quick
    python -m benchmarks.delta_table_bench --options              # + today's MERGE, (i) and (ii)

Measured at the sink (:class:`changestream.delta.DeltaSink`, no server: the
simulator cannot hold 10M documents), fed what ``consume`` hands it:
change documents (dicts) with ~230-byte realistic orders (nested customer,
items, dates; ObjectId ``_id``\\ s in time order, so ``_key`` order is time
order), resume tokens in order, ``save`` every 10,000 changes (``mirror``'s
``--batch`` default).

* **first load**: snapshot records of a new table, saved every
  ``--load-batch`` (the benchmark's table is built this way, one run), until the
  switch to the stream and ``finish()`` (the small-file merges that run beside the
  load are joined: the rate is that of a settled table);
* **(a) skewed**: 80% updates of the newest 5% of keys, 20% inserts of new
  keys (the usual pattern of applications);
* **(b) uniform**: updates of keys drawn uniformly from the whole table.

A change run lasts at least ``--changes`` changes and ends right after a
compaction (whole LSM cycles: the rate includes its rewrite). Reported:
changes/s, bytes the compactions wrote per change, and the process's peak
RSS after each step (sizes run in increasing order). ``--options`` also
measures what was chosen against: (i) today's MERGE into a one-file table,
(ii) the same MERGE into files clustered by ``_key`` of bounded size.

Importable: :func:`first_load`, :func:`change_run` and :func:`realistic_changes`
feed any sink (the lead's end-to-end run uses them).
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from changestream._delta_rows import json_texts
from changestream.delta import DeltaSink, JsonWorker

NS = {"db": "shop", "coll": "orders"}
_BASE_TIME = datetime.datetime(2026, 11, 26, 2, 0, tzinfo=datetime.timezone.utc)
_CITIES = ["Lyon", "Porto", "Leeds", "Graz", "Turku", "Gent", "Brno", "Cork"]


def niceness(text: str) -> int:
    """``--against-worker-niceness``'s argparse type: how far below this process's priority
    the sink's JSON worker runs, an int from 0 to 19."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be an int from 0 to 19, not {text!r}")
    return value


def niced(options: dict[str, Any]) -> dict[str, Any]:
    """A copy of a variant's sink options, its ``json_worker_niceness`` made into the sink's
    JSON worker."""
    others = dict(options)
    if "json_worker_niceness" in others:
        others["json_worker"] = JsonWorker(json_texts,
                                           niceness=others.pop("json_worker_niceness"))
    return others


def oid(n: int) -> ObjectId:
    """The ``n``-th key: ObjectIds grow with ``n`` (a timestamp, then a counter)."""
    return ObjectId((1_700_000_000 + n // 1000).to_bytes(4, "big") + b"\x00" * 3
                    + (n % (1 << 40)).to_bytes(5, "big"))


def document(n: int, version: int, rng: random.Random) -> dict[str, Any]:
    """An order of about 230 BSON bytes (canned_server's realistic shape)."""
    return {
        "_id": oid(n),
        "i": n,
        "customer": {"name": f"c{rng.randrange(100_000)}", "city": rng.choice(_CITIES)},
        "items": [{"sku": rng.randrange(10_000), "qty": rng.randrange(1, 5),
                   "price": rng.randrange(100, 10_000) / 100} for _ in range(2)],
        "status": ("new", "paid", "shipped")[version % 3],
        "created": _BASE_TIME + datetime.timedelta(milliseconds=n * 137),
        "v": version,
        "tags": [rng.choice(["gift", "express", "fragile", "promo", "b2b"])],
    }


class Tokens:
    """Resume tokens in order (the shape of a real one: cluster time, then the key)."""

    def __init__(self) -> None:
        self.count = 0

    def next(self) -> dict[str, Any]:
        self.count += 1
        seconds, inc = 1_800_000_000 + self.count // 10_000, self.count % 10_000 + 1
        return {"_data": f"82{seconds:08X}{inc:08X}2B042C0100296E5A1004463C5F6964003C0004"}


def snapshot_records(start: int, count: int, rng: random.Random) -> Iterator[dict[str, Any]]:
    """What ``consume(initial_snapshot=True)`` hands the handler while it copies."""
    at = Timestamp(1_800_000_000, 1)
    for n in range(start, start + count):
        doc = document(n, 0, rng)
        yield {"_id": {"_data": "snapshot", "phase": "copy", "at": at, "lastId": doc["_id"]},
               "operationType": "insert", "clusterTime": at, "ns": NS,
               "documentKey": {"_id": doc["_id"]}, "fullDocument": doc}


def first_load(sink: DeltaSink, count: int, batch: int, seed: int = 1) -> tuple[float, float]:
    """Docs/s of a first load of ``count`` documents (generation not timed): per second of
    wall time, and per second of this process's CPU time (what a shared machine blurs less)."""
    rng = random.Random(seed)
    spent = cpu = 0.0
    sink.load()
    for start in range(0, count, batch):
        records = list(snapshot_records(start, min(batch, count - start), rng))
        started, started_cpu = time.perf_counter(), time.process_time()
        for record in records:
            sink(record)
        sink.save(records[-1]["_id"])
        spent += time.perf_counter() - started
        cpu += time.process_time() - started_cpu
    # the copy is done: the position moves to the stream (a token-only commit), and the
    # table settles (finish() joins the small-file merge running beside the load): timed
    started, started_cpu = time.perf_counter(), time.process_time()
    sink.save({"_data": "snapshot", "phase": "stream", "at": Timestamp(1_800_000_000, 1)})
    sink.finish()
    spent += time.perf_counter() - started
    cpu += time.process_time() - started_cpu
    return count / spent, count / cpu


def realistic_changes(
    workload: str, rows: int, count: int, rng: random.Random, tokens: Tokens, next_key: int
) -> tuple[list[dict[str, Any]], int]:
    """``count`` change events of ``workload`` (``"a"`` skewed, ``"b"`` uniform) on keys
    ``0 .. next_key - 1``; returns them and the next new key."""
    changes = []
    for _ in range(count):
        if workload == "a" and rng.random() < 0.2:
            n, operation = next_key, "insert"
            next_key += 1
        elif workload == "a":
            n, operation = next_key - 1 - rng.randrange(max(1, next_key // 20)), "update"
        else:
            n, operation = rng.randrange(next_key), "update"
        doc = document(n, 1 + rng.randrange(1000), rng)
        changes.append({"_id": tokens.next(), "operationType": operation, "ns": NS,
                        "clusterTime": Timestamp(1_800_000_000, 1),
                        "documentKey": {"_id": doc["_id"]}, "fullDocument": doc})
    return changes, next_key


def change_run(sink: DeltaSink, workload: str, rows: int, min_changes: int, batch: int,
               seed: int = 2, max_changes: int | None = None) -> dict[str, float]:
    """Feed ``workload`` changes until ``min_changes`` and a compaction just ended a cycle."""
    rng = random.Random(seed)
    tokens = Tokens()
    tokens.count = rows * 3 + seed * 10_000_000
    compactions_before = len(sink.compactions)
    next_key = rows
    done = 0
    spent = cpu = 0.0
    limit = max_changes or min_changes * 20
    while True:
        changes, next_key = realistic_changes(workload, rows, batch, rng, tokens, next_key)
        started, started_cpu = time.perf_counter(), time.process_time()
        for change in changes:
            sink(change)
        compacted = len(sink.compactions)
        sink.save(changes[-1]["_id"])
        spent += time.perf_counter() - started
        cpu += time.process_time() - started_cpu
        done += len(changes)
        if done >= limit or (done >= min_changes and len(sink.compactions) > compacted):
            break
    ran = sink.compactions[compactions_before:]
    return {"changes": done, "rate": done / spent, "cpu_rate": done / cpu, "compactions": len(ran),
            "bytes_per_change": sum(c.bytes_written for c in ran) / done,
            "rows_rewritten_per_change": sum(c.rows_written for c in ran) / done}


def files(sink: DeltaSink) -> str:
    """The table's data files: how many, and the rows of the largest."""
    import pyarrow as pa

    actions = pa.table(sink.table().get_add_actions(flatten=True))  # type: ignore[union-attr]
    rows = actions.column("num_records").to_pylist()
    return f"{len(rows)} files, the largest {max(rows):,} rows"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the options measured before choosing ----------------------------------------------------
def merge_option(path: str, rows: int, workload: str, clustered: bool, batches: int,
                 batch: int) -> float:
    """Changes/s of today's MERGE (one row per key) into a one-file or a clustered table."""
    from deltalake import DeltaTable, write_deltalake

    from changestream import merge_ready
    from changestream.delta import merge_table

    rng = random.Random(3)
    step = 100_000 if clustered else rows
    for start in range(0, rows, step):
        docs = [document(n, 0, rng) for n in range(start, min(rows, start + step))]
        part = merge_table(merge_ready([
            {"_id": {"_data": "snapshot"}, "operationType": "insert", "ns": NS,
             "documentKey": {"_id": d["_id"]}, "fullDocument": d} for d in docs]))
        write_deltalake(path, part.drop_columns(["_op"]), mode="append")
    table = DeltaTable(path)
    tokens = Tokens()
    spent, next_key = 0.0, rows
    for _ in range(batches):
        changes, next_key = realistic_changes(workload, rows, batch, rng, tokens, next_key)
        started = time.perf_counter()
        source = merge_table(merge_ready(changes))
        columns = {name: f"s.`{name}`" for name in ("_key", "document")}
        (table.merge(source, "t.`_key` = s.`_key`", source_alias="s", target_alias="t")
         .when_matched_update(updates=columns)
         .when_not_matched_insert(updates=columns).execute())
        spent += time.perf_counter() - started
    return batches * batch / spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--load-sizes", default="10000",
                        help="extra first-load-only sizes (the table sizes are loaded too)")
    parser.add_argument("--batch", type=int, default=10_000, help="changes per save (mirror's)")
    parser.add_argument("--load-batch", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=200_000,
                        help="at least this many changes per run (then up to the end of a cycle)")
    parser.add_argument("--quick", action="store_true", help="50,000 changes per run")
    parser.add_argument("--options", action="store_true",
                        help="also today's MERGE into one file (i) and into clustered files (ii)")
    parser.add_argument("--dir", default=None, help="where the tables go (default: a temp dir)")
    parser.add_argument("--file-rows", default=None,
                        help="base file sizes in rows to compare, e.g. 32768,65536,131072 "
                             "(a table per value; default: the sink's)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    min_changes = 50_000 if args.quick else args.changes
    work = tempfile.mkdtemp(prefix="delta_table_bench_", dir=args.dir)
    print(f"load average at start: {os.getloadavg()[0]:.1f}; batch {args.batch}")
    try:
        for size in [int(s) for s in args.load_sizes.split(",") if s]:
            rate, cpu = first_load(DeltaSink(f"{work}/l{size}", app_id="bench"), size,
                                   args.load_batch)
            print(f"first load {size:>10,} docs: {rate:>9,.0f} docs/s ({cpu:,.0f} per CPU s)  "
                  f"peak RSS {peak_rss_mb():,.0f} MB")
        for size, file_rows in [(size, rows) for size in sizes for rows in
                                (args.file_rows.split(",") if args.file_rows else [None])]:
            sink = DeltaSink(f"{work}/t{size}", app_id="bench")
            if file_rows is not None:
                sink.file_rows = int(file_rows)
                print(f"base files of {sink.file_rows:,} rows")
            rate, cpu = first_load(sink, size, args.load_batch)
            print(f"first load {size:>10,} docs: {rate:>9,.0f} docs/s ({cpu:,.0f} per CPU s)  "
                  f"peak RSS {peak_rss_mb():,.0f} MB  load {os.getloadavg()[0]:.1f}  "
                  f"{files(sink)}")
            for workload in ("a", "b"):
                result = change_run(sink, workload, size, min_changes, args.batch)
                print(f"  ({workload}) {size:>10,} rows: {result['rate']:>9,.0f} changes/s "
                      f"({result['cpu_rate']:,.0f} per CPU s) over "
                      f"{result['changes']:,.0f} changes, {result['compactions']:.0f} compactions, "
                      f"{result['bytes_per_change']:,.0f} B and "
                      f"{result['rows_rewritten_per_change']:.1f} rows rewritten per change, "
                      f"peak RSS {peak_rss_mb():,.0f} MB  load {os.getloadavg()[0]:.1f}")
                started = time.perf_counter()
                done = sink.finish()
                print(f"      then finish() (what --until-idle ends with): "
                      f"{time.perf_counter() - started:.2f} s, "
                      f"{done.rows_written if done else 0:,} rows written; {files(sink)}")
            shutil.rmtree(f"{work}/t{size}", ignore_errors=True)
        if args.options:
            for size in [s for s in sizes if s <= 1_000_000]:
                for workload in ("a", "b"):
                    for clustered in (False, True):
                        path = f"{work}/o{size}{workload}{clustered}"
                        rate = merge_option(path, size, workload, clustered, 3, args.batch)
                        shutil.rmtree(path, ignore_errors=True)
                        print(f"  ({'ii' if clustered else 'i'}) MERGE, "
                              f"{'clustered 100k-row files' if clustered else 'one file'}, "
                              f"({workload}) {size:>10,} rows: {rate:>9,.0f} changes/s")
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
