"""The Delta sink where the client is the bound: a stream's raw changes replayed, no server.

    python -m benchmarks.sink_replay                          # 1M rows, 300,000 changes
    python -m benchmarks.sink_replay --rows 100000 --against-no-json-worker
    python -m benchmarks.sink_replay --against-unshared
    python -m benchmarks.sink_replay --against-eager-compaction
    python -m benchmarks.sink_replay --against-worker-niceness 0

In production the server runs on a machine of its own, so a mirror's rate is set by its
own process: ``benchmarks.mirror_e2e`` runs the simulator on the same two cores, where the
two share them. Here a table of ``--rows`` orders is filled by a first load
(``delta_table_bench.first_load``), then ``--changes`` changes (80% updates of the newest
5% of keys, 20% inserts, as ``mirror_e2e``'s backlog) are made into raw events as a server
sends them (``RawBSONDocument``: token, ``operationType``, ``clusterTime``, ``wallTime``,
the looked-up ``fullDocument``, ``ns``, ``documentKey``, an update's
``updateDescription``) and handed to :class:`~changestream.delta.DeltaSink` on the main
thread as ``consume`` does, with ``save_behind`` every ``BATCH_CHANGES`` (the batch
commits on the sink's thread while the next is staged), then ``flush()`` and
``finish()``. Each round replays into a copy of the loaded table. With
``--against-no-json-worker``, rounds alternate with the sink's JSON texts made in process
(``json_worker=False``); with ``--against-unshared``, with a worker that makes every text
itself, its caller never helping (the default: while the caller waits for the commit, as at
the end of the run, its thread makes parts of the batch in process beside the worker);
with ``--against-eager-compaction``, with a sink that compacts after a batch behind as soon
as a compaction is due, even while the stream waits for that batch (the default puts it off
until twice the log: ``LogSize.due``); with ``--against-worker-niceness N``, with the JSON
worker N below this process's priority (the default: ``NICENESS``, 10).

Reported per run: changes/s over the whole run and up to the last change handed over
(before its batch's commit), and the CPU per change of this process and of the sink's JSON
worker. What it leaves out: the stream's own loop (~10 µs a change at 1M, the no-op
consumer's in ``mirror_e2e``) runs on the same main thread in ``consume``.
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bson
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

from benchmarks.delta_table_bench import Tokens, first_load, niced, niceness, realistic_changes
from changestream._delta_rows import json_texts
from changestream.delta import BATCH_CHANGES, DeltaSink, JsonWorker

_WALL = datetime.datetime(2026, 12, 4, tzinfo=datetime.timezone.utc)


def raw_events(rows: int, count: int, seed: int = 3) -> list[RawBSONDocument]:
    """``count`` skewed changes on a table of ``rows`` keys, as a server's raw events."""
    tokens = Tokens()
    tokens.count = rows * 3
    changes, _ = realistic_changes("a", rows, count, random.Random(seed), tokens, rows)
    events = []
    for n, change in enumerate(changes, start=1):
        document = change["fullDocument"]
        event: dict[str, Any] = {
            "_id": change["_id"], "operationType": change["operationType"],
            "clusterTime": Timestamp(1_800_000_000 + n // 10_000, n % 10_000 + 1),
            "wallTime": _WALL + datetime.timedelta(microseconds=n * 40),
            "fullDocument": document, "ns": change["ns"],
            "documentKey": {"_id": document["_id"]}}
        if change["operationType"] == "update":
            event["updateDescription"] = {
                "updatedFields": {"v": document["v"], "status": document["status"]},
                "removedFields": [], "truncatedArrays": []}
        events.append(RawBSONDocument(bson.encode(event)))
    return events


def cpu(who: int = resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class Unshared(JsonWorker):
    """The JSON worker as it was before 5 December: it makes a batch's every text, its
    caller waiting even when the stream has nothing else to run."""

    def __call__(self, documents: Any, json_options: Any, *,
                 idle: Any = None) -> list[str | None]:
        return super().__call__(documents, json_options)


class Eager(DeltaSink):
    """The sink as it was before 5 December (late): a compaction due after a batch committed
    behind runs even while the stream waits for that batch."""

    def _maybe_compact(self, table: Any = None, *, waited: bool = False) -> None:
        super()._maybe_compact(table)


def replay(path: str, events: list[RawBSONDocument], **options: Any) -> dict[str, float]:
    """Hand ``events`` to a sink on ``path`` as ``consume`` does; the rates and CPU."""
    if options.get("json_worker") == "unshared":
        options["json_worker"] = Unshared(json_texts)
    options = niced(options)
    kind = Eager if options.pop("compaction", None) == "eager" else DeltaSink
    sink = kind(path, full_document="updateLookup", **options)
    sink.load()
    own, helpers = cpu(), cpu(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    for start in range(0, len(events), BATCH_CHANGES):
        batch = events[start:start + BATCH_CHANGES]
        for event in batch:
            sink(event)
        sink.save_behind(batch[-1]["_id"])
    handled = time.perf_counter() - began
    sink.flush()
    sink.finish()  # stops the JSON worker: its CPU is then this process's children's
    whole = time.perf_counter() - began
    count = len(events)
    return {"whole": count / whole, "handled": count / handled,
            "cpu": (cpu() - own) / count * 1e6,
            "worker": (cpu(resource.RUSAGE_CHILDREN) - helpers) / count * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--changes", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--against-no-json-worker", action="store_true",
                        help="alternate each round with json_worker=False")
    parser.add_argument("--against-unshared", action="store_true",
                        help="alternate each round with a worker whose caller never helps")
    parser.add_argument("--against-eager-compaction", action="store_true",
                        help="alternate each round with a sink that compacts even while the "
                        "stream waits for the batch")
    parser.add_argument("--against-worker-niceness", type=niceness, metavar="N",
                        help="alternate each round with the JSON worker N (0-19) below this "
                        "process's priority")
    args = parser.parse_args()
    for name in ("rows", "changes", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, not {getattr(args, name)}")
    variants: list[dict[str, Any]] = [{}]
    if args.against_no_json_worker:
        variants.append({"json_worker": False})
    if args.against_unshared:
        variants.append({"json_worker": "unshared"})
    if args.against_eager_compaction:
        variants.append({"compaction": "eager"})
    if args.against_worker_niceness is not None:
        variants.append({"json_worker_niceness": args.against_worker_niceness})
    workdir = tempfile.mkdtemp(prefix="sink-replay-")
    try:
        base = os.path.join(workdir, "base")
        rate, _ = first_load(DeltaSink(base, app_id="changestream"), args.rows, 65_536)
        print(f"[{args.rows:,}] first load: {rate:,.0f} docs/s", flush=True)
        events = raw_events(args.rows, args.changes)
        results: dict[str, list[dict[str, float]]] = {}
        for number in range(args.rounds):
            for variant in variants if number % 2 == 0 else variants[::-1]:
                name = ", ".join(f"{k}={v}" for k, v in variant.items()) or "defaults"
                copy = os.path.join(workdir, f"r{number}")
                shutil.copytree(base, copy)
                got = replay(copy, events, **variant)
                shutil.rmtree(copy)
                results.setdefault(name, []).append(got)
                print(f"[{args.rows:,}] {name}: {got['whole']:,.0f} changes/s over the run, "
                      f"{got['handled']:,.0f} to the last change handed over; µs of CPU a "
                      f"change: {got['cpu']:.1f} here + {got['worker']:.1f} in the JSON worker",
                      flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n| sink | changes/s, whole run (median) | to the last change (median) | "
          "µs a change here | in the worker |\n|---|---:|---:|---:|---:|")
    for name, runs in results.items():
        def middle(key: str, runs: list[dict[str, float]] = runs) -> float:
            return sorted(run[key] for run in runs)[len(runs) // 2]
        print(f"| {name} | {middle('whole'):,.0f} | {middle('handled'):,.0f} | "
              f"{middle('cpu'):.1f} | {middle('worker'):.1f} |")


if __name__ == "__main__":
    main()
