"""The Delta sink's CPU per change: decoded events against raw events read from their bytes.

    python -m benchmarks.raw_events_bench                  # 100k and 1M rows, 50k changes
    python -m benchmarks.raw_events_bench --sizes 100000 --rounds 5

No server: for each of ``--sizes``, a table of that many orders is loaded once (``delta_table_bench``'s
first load), then the same ``--changes`` change events, encoded as the server
sends them (token, operation, cluster and wall time, the ~230-byte order as
``fullDocument``, namespace, key, an update's ``updateDescription``), are fed
to a :class:`~changestream.delta.DeltaSink` on a copy of the table, as
``consume`` feeds it (``save_behind`` every 10,000 changes, then ``flush()``;
the ``finish()`` after it is the same work either way and not timed), in two
ways, alternated over ``--rounds``:

* **decoded**: each event decoded to a dict (what a stream hands a handler by
  default; the decoding is counted, a consumer of decoded events pays it);
* **raw**: each event a ``RawBSONDocument`` (``document_class=RawBSONDocument``,
  what ``mirror`` reads): the sink reads it from its bytes and decodes only
  each key's last document of a batch.

Both are timed from the transport's ``RawBSONDocument`` on. Reported per
workload ((a) 80% updates of the newest 5% of keys plus 20% inserts, (b) uniform
updates): this process's CPU µs per change (every thread: the commits run
behind), the median of the rounds with their range, and raw / decoded; the
tables are checked equal.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import bson
from bson.binary import Binary
from bson.raw_bson import RawBSONDocument

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.delta_table_bench import Tokens, first_load, realistic_changes
from changestream.delta import DeltaSink

_DECODE = getattr(bson, "_bson_to_dict", bson.decode)
_UUID = Binary(bytes(range(16)), 4)


def encoded_events(workload: str, rows: int, count: int) -> list[bytes]:
    """``count`` events of ``workload`` as the server's bytes, in a server's field order."""
    tokens = Tokens()
    tokens.count = rows * 3
    changes, _ = realistic_changes(workload, rows, count, random.Random(2), tokens, rows)
    wall = datetime.datetime(2026, 12, 3, 12, 0)
    events = []
    for change in changes:
        event: dict[str, Any] = {"_id": change["_id"], "operationType": change["operationType"],
                                 "clusterTime": change["clusterTime"], "wallTime": wall,
                                 "collectionUUID": _UUID,
                                 "fullDocument": change["fullDocument"], "ns": change["ns"],
                                 "documentKey": change["documentKey"]}
        if change["operationType"] == "update":
            event["updateDescription"] = {"updatedFields": {"v": change["fullDocument"]["v"]},
                                          "removedFields": [], "truncatedArrays": []}
        events.append(bson.encode(event))
    return events


def feed(table: str, events: list[bytes], raw: bool) -> float:
    """CPU seconds (all threads) of the sink taking ``events`` as ``consume`` hands them."""
    sink = DeltaSink(table, full_document="updateLookup")
    sink.load()
    delivered = [RawBSONDocument(event) for event in events]  # as the transport hands them
    codec = bson.DEFAULT_CODEC_OPTIONS
    started = time.process_time()
    for number, event in enumerate(delivered, 1):
        change = event if raw else _DECODE(event.raw, codec)
        sink(change)
        if number % 10_000 == 0:
            sink.save_behind(change["_id"])
    sink.flush()
    sink.save(delivered[-1]["_id"])
    spent = time.process_time() - started
    sink.finish()  # the same compaction either way: not timed
    return spent


def compare(workdir: str, base: str, events: list[bytes], rounds: int
            ) -> tuple[list[float], list[float]]:
    """µs per change of each round, decoded and raw, alternated, each on a copy of ``base``;
    the two ways' tables are checked equal."""
    spent: dict[bool, list[float]] = {False: [], True: []}
    tables = {}
    for number in range(rounds):
        for raw in ((False, True) if number % 2 == 0 else (True, False)):
            copy = os.path.join(workdir, f"copy{number}{raw}")
            shutil.copytree(base, copy)
            spent[raw].append(feed(copy, events, raw) / len(events) * 1e6)
            tables[raw] = DeltaSink(copy).read_current().sort_by("_key")
            shutil.rmtree(copy)
        assert tables[True].equals(tables[False]), "raw and decoded tables differ"
    return spent[False], spent[True]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000",
                        help="table sizes in rows, comma-separated (each its own first load)")
    parser.add_argument("--changes", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be integers separated by commas, not {args.sizes!r}")
    for name, value in (("sizes", min(sizes)), ("changes", args.changes),
                        ("rounds", args.rounds)):
        if value < 1:
            parser.error(f"--{name} must be >= 1")
    print("| rows | workload | decoded (µs/change) | raw (µs/change) | raw / decoded |\n"
          "|---:|---|---:|---:|---:|", flush=True)
    for rows in sizes:
        workdir = tempfile.mkdtemp(prefix="raw-events-")
        try:
            base = os.path.join(workdir, "base")
            first_load(DeltaSink(base), rows, 10_000)
            for workload in ("a", "b"):
                decoded, raw = compare(workdir, base, encoded_events(workload, rows, args.changes),
                                       args.rounds)
                print(f"| {rows:,} | ({workload}) | {statistics.median(decoded):.1f} "
                      f"({min(decoded):.1f}-{max(decoded):.1f}) | {statistics.median(raw):.1f} "
                      f"({min(raw):.1f}-{max(raw):.1f}) | "
                      f"{statistics.median(raw) / statistics.median(decoded):.2f} |", flush=True)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
