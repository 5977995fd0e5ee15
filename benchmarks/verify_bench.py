"""``DeltaSink.verify``'s cost: end to end through the simulator, and the table side at 10M rows.

    python -m benchmarks.verify_bench --docs 1000000          # simulator: load, mirror, verify
    python -m benchmarks.verify_bench --table-rows 10000000   # table side only (no server)

End to end: the simulator (a child process) holds ``--docs`` orders of about
230 bytes (``delta_table_bench.document``); ``consume(initial_snapshot=True)``
fills a new table, then ``verify`` runs twice (equal, then after a damage
that drops a data file from the log). Reported: seconds, rows/s and
microseconds per row, split into the table side (current state + hashes)
and the collection side (snapshot read, the sink's converter, hashes).

Table side only: the table is written by the sink's first load
(``delta_table_bench.first_load``) and hashed as ``verify`` streams it; then
50,000 updates are committed as its change log and it is hashed again as
``verify`` streams it now (base batches without the logged keys, then the
log), and the old way (``read_current()`` in memory), and compared with itself
(the collection side faked by the same hashes, to time the range comparison).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import pyarrow as pa
from pymongo import MongoClient

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import changestream
from benchmarks.bench_client import simulator
from benchmarks.delta_table_bench import Tokens, document, first_load, realistic_changes
from changestream._delta_verify import Hashes, compare, current_batches, new_powers, table_hashes
from changestream.delta import DeltaSink


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def table_side(rows: int, workdir: str) -> None:
    sink = DeltaSink(os.path.join(workdir, "t"))
    started = time.perf_counter()
    first_load(sink, rows, 100_000)
    print(f"table of {rows:,} rows written in {time.perf_counter() - started:.0f} s", flush=True)
    rss_before = peak_rss_mb()
    streamed_side(sink, rows, "streamed (what verify does on a compacted table)")
    print(f"  (peak RSS before: {rss_before:.0f} MB)", flush=True)
    log_changes(sink, rows)
    streamed_side(sink, rows, "with a change log of 50,000 updates, streamed (what verify does "
                  "since 2026-12-02)")
    began = time.perf_counter()
    current = sink.read_current()
    read = time.perf_counter() - began
    hashed_at = time.perf_counter()
    hashes = table_hashes(current, new_powers())
    hashing = time.perf_counter() - hashed_at
    compared_at = time.perf_counter()
    result = compare(hashes, hashes, at=None, started=compared_at)
    comparing = time.perf_counter() - compared_at
    total = read + hashing + comparing
    assert result.ok
    print(f"table side at {rows:,} rows, in memory (read_current(): what verify did on a table "
          f"with a change log until 2026-12-02): read {read:.1f} s, hash {hashing:.1f} s, compare "
          f"{comparing:.2f} s ({result.ranges:,} ranges): {total:.1f} s, "
          f"{total / rows * 1e6:.2f} us/row; peak RSS {peak_rss_mb():.0f} MB", flush=True)


def streamed_side(sink: DeltaSink, rows: int, what: str) -> None:
    """The table side as ``verify`` reads it (``current_batches``), timed, with the peak RSS."""
    began = time.perf_counter()
    Hashes.of(current_batches(sink.table(), ["document"]), ["document"], new_powers())
    seconds = time.perf_counter() - began
    print(f"table side at {rows:,} rows, {what}: {seconds:.1f} s, "
          f"{seconds / rows * 1e6:.2f} us/row; peak RSS {peak_rss_mb():.0f} MB", flush=True)


def log_changes(sink: DeltaSink, rows: int) -> None:
    """50,000 updates of random keys committed as the change log (no compaction is due)."""
    changes, _ = realistic_changes("b", rows, 50_000, random.Random(3), Tokens(), rows)
    for change in changes:
        sink(change)
    sink.save(changes[-1]["_id"])


def end_to_end(docs: int, workdir: str) -> None:
    with simulator("8.0", ("--event-cache-mb", "256")) as (uri, _pid), \
            MongoClient(uri) as client:
        coll = client.bench.orders
        rng = random.Random(1)
        began = time.perf_counter()
        for start in range(0, docs, 10_000):
            coll.insert_many([document(n, 0, rng) for n in range(start, min(docs, start + 10_000))],
                             ordered=False)
        print(f"preloaded {docs:,} documents in {time.perf_counter() - began:.0f} s", flush=True)
        sink = DeltaSink(os.path.join(workdir, "t"), full_document="updateLookup")
        stop = threading.Event()
        seen = [0]

        def handle(change: Any) -> None:
            sink(change)
            seen[0] += 1
            if seen[0] >= docs or change.get("documentKey", {}).get("_id") == "caught-up":
                stop.set()

        began = time.perf_counter()
        changestream.consume(coll, handle, sink, initial_snapshot=True, stop=stop,
                             save_every=10_000,
                             watch_options={"copy_batch_size": 10_000, "max_await_time_ms": 200,
                                            "full_document": "updateLookup"})
        print(f"first load end to end: {docs / (time.perf_counter() - began):,.0f} docs/s",
              flush=True)
        # catch up, as mirror --verify does: a fresh position the server still keeps
        coll.insert_one({"_id": "caught-up"})
        stop.clear()
        changestream.consume(coll, handle, sink, initial_snapshot=True, stop=stop,
                             watch_options={"max_await_time_ms": 200,
                                            "full_document": "updateLookup"})
        sink.finish()
        for label in ("equal", "damaged"):
            if label == "damaged":
                log = os.path.join(workdir, "t", "_delta_log")
                actions = sink.table().get_add_actions(flatten=True)  # the newest commit adding
                live = set(pa.table(actions).column("path").to_pylist())  # a live file
                for name in sorted((n for n in os.listdir(log) if n.endswith(".json")),
                                   reverse=True):  # (after any checkpoint)
                    with open(os.path.join(log, name)) as commit:
                        lines = commit.readlines()
                    kept = [line for line in lines if not (line.startswith('{"add"') and any(
                        f'"{path}"' in line for path in live))]
                    if len(kept) != len(lines):
                        with open(os.path.join(log, name), "w") as commit:
                            commit.writelines(kept)
                        break
                sink = DeltaSink(os.path.join(workdir, "t"))
            began = time.perf_counter()
            result = sink.verify(coll)
            seconds = time.perf_counter() - began
            print(f"verify ({label}) at {docs:,} documents: {seconds:.1f} s, "
                  f"{seconds / docs * 1e6:.1f} us/row: {result.summary()[:160]}", flush=True)
        print(f"peak RSS {peak_rss_mb():.0f} MB; load average {os.getloadavg()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, help="end to end through the simulator")
    parser.add_argument("--table-rows", type=int, help="the table side only, at this size")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="verify-bench-")
    try:
        if args.table_rows:
            table_side(args.table_rows, workdir)
        if args.docs:
            end_to_end(args.docs, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
