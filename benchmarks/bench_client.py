"""Client-side throughput and memory of change-stream consumers, against one server.

    python -m benchmarks.bench_client [--events N] [--memory-events M] [--uri URI] [--json F]
    python -m benchmarks.bench_client --canned [--runs 5] [--events N] [--memory-events M]

``--canned`` replaces the server by :mod:`benchmarks.canned_server`, a tiny wire
server (separate process) answering every ``getMore`` with the same pre-encoded
batch of 1,000 realistic insert events (~490 bytes: nested documents, arrays,
dates, ObjectIds), so no server work is in the numbers; the consumer reads what
an application reads of each event: its type, key, cluster time, namespace and
one field of the full document (a RawBSONDocument consumer forwards the bytes). Rounds are interleaved and the table reports
medians as well as the best run.

Without ``--uri`` the simulator runs in a *separate process* (so it does not
share the client's GIL). N small inserts are preloaded, then every mode reads
the same N events (``start_at_operation_time`` of a marker write made just
before them, same ``batch_size``), best of ``--runs``:

(a) raw ``aggregate``/``getMore`` loop through ``Database.command()`` (dicts):
    the floor any client pays (wire, C decoding, a Python loop);
(b) PyMongo's ``Collection.watch()``;
(c) ``changestream.watch()`` (dicts); (d) ``typed=True``;
(e) ``document_class=RawBSONDocument``.

Wall-clock throughput is capped by the server; client CPU time (process time,
the server being elsewhere) per event is the client's own cost. Then M events
are streamed with one mode while RSS and the tracemalloc peak are sampled every
100,000 events: memory must stay flat.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import bson
import pymongo
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.collection import Collection

import changestream
from changestream.events import ChangeEvent

DATABASE = "changestream_bench"
INSERT_BATCH = 10_000
SAMPLE_EVERY = 100_000
WARM_UP_EVENTS = 20_000
PAYLOAD = "x" * 32


@dataclasses.dataclass(frozen=True)
class Workload:
    """Where the preloaded events are and how every mode reads them."""

    collection: Collection[Any]
    start: Timestamp
    batch_size: int | None
    period: int | None = None
    """Canned server: the events repeat every ``period`` (``fullDocument.i`` restarts at 0)."""

    def expected(self, count: int) -> int:
        """``fullDocument.i`` of the ``count``-th event (0-based)."""
        return count if self.period is None else count % self.period


Consumer = Callable[[Workload], Generator[Any, None, None]]


# ------------------------------------------------------------------------------ the modes
def raw_getmore_loop(work: Workload) -> Generator[Any, None, None]:
    """(a) ``aggregate`` + ``getMore`` through ``Database.command``, replies decoded to dicts."""
    coll = work.collection
    db = coll.database
    cursor_options = {} if work.batch_size is None else {"batchSize": work.batch_size}
    reply = db.command({
        "aggregate": coll.name,
        "pipeline": [{"$changeStream": {"startAtOperationTime": work.start}}],
        "cursor": cursor_options,
    })
    batch: deque[Any] = deque(reply["cursor"]["firstBatch"])
    cursor_id = reply["cursor"]["id"]
    del reply
    getmore: dict[str, Any] = {"getMore": cursor_id, "collection": coll.name, **cursor_options}
    try:
        while True:
            # Drop each event once returned, as drivers do: decoding the next batch
            # while the last one is still alive costs extra GC work.
            while batch:
                yield batch.popleft()
            cursor = db.command(getmore)["cursor"]
            batch, cursor_id = deque(cursor.pop("nextBatch")), cursor["id"]
    finally:
        if cursor_id:
            db.command({"killCursors": coll.name, "cursors": [cursor_id]})


def pymongo_watch(work: Workload) -> Generator[Any, None, None]:
    """(b) PyMongo's own change stream."""
    with work.collection.watch(start_at_operation_time=work.start,
                               batch_size=work.batch_size) as stream:
        yield from stream


def ours(**options: Any) -> Consumer:
    def consume(work: Workload) -> Generator[Any, None, None]:
        with changestream.watch(work.collection, start_at_operation_time=work.start,
                                batch_size=work.batch_size, **options) as stream:
            yield from stream

    return consume


MODES: dict[str, tuple[str, Consumer]] = {
    "a": ("raw getMore loop (dicts)", raw_getmore_loop),
    "b": ("pymongo watch() (dicts)", pymongo_watch),
    "c": ("changestream (dicts)", ours()),
    "d": ("changestream typed=True", ours(typed=True)),
    "e": ("changestream RawBSONDocument", ours(document_class=RawBSONDocument)),
    "f": ("changestream typed over raw", ours(typed=True, document_class=RawBSONDocument)),
}


def sequence_number(change: Any) -> int:
    """The ``i`` of the inserted document, whatever the mode returned."""
    full_document = getattr(change, "full_document", None)
    if full_document is None:
        full_document = change["fullDocument"]
    return int(full_document["i"])


def read_like_an_application(change: Any) -> int | None:
    """Type, key, time and namespace of the event, and ``fullDocument.i``; returns ``i``.

    A ``RawBSONDocument`` consumer forwards the event's bytes, as to a queue or a
    file (why one asks for raw events), and reads nothing; ``None`` then (the run
    still checks the last event).
    """
    if type(change) is RawBSONDocument:
        if len(change.raw) < 5:
            raise RuntimeError(f"empty event {change!r:.200}")
        return None
    if isinstance(change, ChangeEvent):
        if (change.operation_type is None or change.document_key is None
                or change.cluster_time is None or change.ns is None):
            raise RuntimeError(f"incomplete event {change!r:.200}")
        full_document = change.full_document
    else:
        if (change["operationType"] is None or change["documentKey"] is None
                or change["clusterTime"] is None or change["ns"] is None):
            raise RuntimeError(f"incomplete event {change!r:.200}")
        full_document = change["fullDocument"]
    assert full_document is not None
    return int(full_document["i"])


# ------------------------------------------------------------------------------ measuring
@dataclasses.dataclass
class Run:
    wall: float
    cpu: float
    server_cpu: float | None = None
    """CPU seconds of the simulator process during the run (``None`` with ``--uri``)."""


class ServerClock:
    """CPU time of the simulator process, read from ``/proc`` (Linux); ``None`` elsewhere."""

    def __init__(self, pid: int | None) -> None:
        self._path = None if pid is None else f"/proc/{pid}/stat"

    def seconds(self) -> float | None:
        if self._path is None:
            return None
        try:
            with open(self._path) as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def timed_run(consume: Consumer, work: Workload, limit: int, server: ServerClock,
              read: bool = False) -> Run:
    """Read ``limit`` events; check they are exactly the preloaded ones, in order.

    ``read``: the consumer also reads ``fullDocument.i`` of every event (and
    checks it), as a consumer that uses the events does; otherwise it only counts.
    """
    count, last = 0, None
    stream = consume(work)
    gc.collect()
    server_cpu = server.seconds()
    reader = read_like_an_application if work.period is not None else sequence_number
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        for change in stream:
            last = change
            if read and reader(change) not in (work.expected(count), None):
                raise RuntimeError(f"event {count} is {change!r:.200}")
            count += 1
            if count == limit:
                break
    finally:
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        server_end = server.seconds()
        stream.close()
    if count != limit or sequence_number(last) != work.expected(limit - 1):
        raise RuntimeError(f"read {count} events ending at {last!r:.200}; expected {limit}")
    if server_cpu is not None and server_end is not None:
        return Run(wall, cpu, server_end - server_cpu)
    return Run(wall, cpu)


def measure(work: Workload, modes: list[str], events: int, runs: int,
            server: ServerClock, read: bool = False) -> dict[str, list[Run]]:
    """Interleave the modes run by run, so noise from other processes hits all of them."""
    results: dict[str, list[Run]] = {mode: [] for mode in modes}
    for mode in modes:  # warm-up: imports, connection pools, the server's first scan
        timed_run(MODES[mode][1], work, min(events, WARM_UP_EVENTS), server, read)
    for index in range(runs):
        for mode in modes:
            run = timed_run(MODES[mode][1], work, events, server, read)
            results[mode].append(run)
            server_note = "" if run.server_cpu is None else (
                f"  server {run.server_cpu / events * 1e6:5.1f} µs CPU/ev")
            print(f"  run {index + 1}/{runs} ({mode}) {MODES[mode][0]:<30} "
                  f"{events / run.wall:>9,.0f} ev/s  {run.cpu / events * 1e6:6.2f} µs CPU/ev"
                  f"{server_note}", flush=True)
    return results


def current_rss_mb() -> float:
    """Resident set size now (Linux ``/proc``), else the peak from ``getrusage``."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak_kb) / 1024


def memory_profile(work: Workload, mode: str, events: int) -> list[dict[str, float]]:
    """Stream ``events`` with ``mode``; every SAMPLE_EVERY events record RSS and traced memory."""
    samples: list[dict[str, float]] = []
    tracemalloc.start()
    started = time.perf_counter()
    count, last = 0, None
    stream = MODES[mode][1](work)
    try:
        for change in stream:
            last = change
            count += 1
            if count % SAMPLE_EVERY == 0 or count == events:
                current, peak = tracemalloc.get_traced_memory()
                tracemalloc.reset_peak()
                samples.append({
                    "events": count,
                    "rss_mb": round(current_rss_mb(), 1),
                    "traced_mb": round(current / 2**20, 2),
                    "traced_peak_mb": round(peak / 2**20, 2),
                    "seconds": round(time.perf_counter() - started, 1),
                })
                print(f"  {count:>9,} events  RSS {samples[-1]['rss_mb']:7.1f} MB  traced "
                      f"{samples[-1]['traced_mb']:6.2f} MB (peak {samples[-1]['traced_peak_mb']:6.2f}"
                      " MB)", flush=True)
            if count == events:
                break
        if count != events or sequence_number(last) != work.expected(events - 1):
            raise RuntimeError(f"memory run read {count} events; expected {events}")
    finally:
        stream.close()
        tracemalloc.stop()
    return samples


# ------------------------------------------------------------------------------ the server
@contextlib.contextmanager
def simulator(
    version: str, extra: Sequence[str] = ("--event-cache-mb", "512")
) -> Iterator[tuple[str, int | None]]:
    """``python -m changestream.testing serve`` (and ``extra`` options) in a child process;
    yields its URI and pid."""
    process = subprocess.Popen(
        [sys.executable, "-m", "changestream.testing", "serve", "--port", "0",
         *extra,
         "--version", version],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        uri = process.stdout.readline().strip()
        if not uri.startswith("mongodb://"):
            raise RuntimeError(f"the simulator did not start (exit code {process.poll()})")
        yield uri, process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def canned_server(events_per_batch: int) -> Iterator[tuple[str, int | None, float]]:
    """``python -m benchmarks.canned_server`` in a child process; yields URI, pid, event size."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.canned_server",
         "--events-per-batch", str(events_per_batch)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        uri, size = [*process.stdout.readline().split(), "", ""][:2]
        if not uri.startswith("mongodb://"):
            raise RuntimeError(f"the canned server did not start (exit code {process.poll()})")
        yield uri, process.pid, float(size)
    finally:
        process.terminate()
        process.wait(10)


def preload(client: MongoClient[Any], count: int, batch_size: int | None) -> Workload:
    """Insert ``count`` small documents after a marker write whose time starts every stream."""
    db = client[DATABASE]
    collection = db[f"events_{os.getpid()}_{int(time.time())}"]
    with client.start_session(causal_consistency=False) as session:
        db["marker"].insert_one({"at": time.time()}, session=session)
        start = session.operation_time
    if not isinstance(start, Timestamp):
        raise RuntimeError("the server reported no operationTime: a replica set is required")
    began = time.perf_counter()
    for offset in range(0, count, INSERT_BATCH):
        size = min(INSERT_BATCH, count - offset)
        collection.insert_many([{"i": offset + k, "s": PAYLOAD} for k in range(size)])
    print(f"preloaded {count:,} inserts in {time.perf_counter() - began:.1f} s", flush=True)
    return Workload(collection, start, batch_size)


# ------------------------------------------------------------------------------ reporting
def redact(uri: str) -> str:
    return re.sub(r"//[^@/]*@", "//<credentials>@", uri)


def summarise(results: dict[str, list[Run]], events: int) -> list[dict[str, Any]]:
    best = {mode: (min(r.wall for r in runs), min(r.cpu for r in runs))
            for mode, runs in results.items()}
    rows = []
    for mode, (wall, cpu) in best.items():
        row: dict[str, Any] = {
            "mode": mode,
            "name": MODES[mode][0],
            "wall_events_per_s": round(events / wall),
            "cpu_us_per_event": round(cpu / events * 1e6, 3),
            "cpu_us_per_event_median": round(
                statistics.median(r.cpu for r in results[mode]) / events * 1e6, 3),
            "cpu_events_per_s": round(events / cpu),
            "runs": [dataclasses.asdict(r) for r in results[mode]],
        }
        server = [r.server_cpu for r in results[mode] if r.server_cpu is not None]
        if server:
            row["server_cpu_us_per_event"] = round(min(server) / events * 1e6, 2)
        for base in ("a", "b"):
            if base in best:
                row[f"wall_vs_{base}"] = round(best[base][0] / wall, 3)
                row[f"cpu_vs_{base}"] = round(best[base][1] / cpu, 3)
                row[f"cpu_vs_{base}_median"] = round(
                    statistics.median(r.cpu for r in results[base])
                    / statistics.median(r.cpu for r in results[mode]), 3)
                row[f"cpu_vs_{base}_per_round"] = [
                    round(b.cpu / r.cpu, 3) for b, r in zip(results[base], results[mode], strict=True)]
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'mode':<34} {'ev/s wall':>10} {'CPU µs/ev':>10} {'(median)':>9} "
              f"{'ev/s CPU':>10} {'wall/a':>7} {'CPU/a':>7} {'wall/b':>7} {'CPU/b':>7} "
              f"{'server µs/ev':>13}")
    print(header)
    print("-" * len(header))
    for row in rows:
        ratios = " ".join(f"{row.get(key, float('nan')):>7.2f}"
                          for key in ("wall_vs_a", "cpu_vs_a", "wall_vs_b", "cpu_vs_b"))
        server = row.get("server_cpu_us_per_event")
        print(f"({row['mode']}) {row['name']:<30} {row['wall_events_per_s']:>10,} "
              f"{row['cpu_us_per_event']:>10.2f} {row['cpu_us_per_event_median']:>9.2f} "
              f"{row['cpu_events_per_s']:>10,} {ratios} "
              f"{'-' if server is None else f'{server:.1f}':>13}")
    print("best of the runs (median in brackets); ratios of the best > 1: faster than (a) / (b).")
    if any("cpu_vs_b_median" in row for row in rows):
        print("CPU vs (b) PyMongo watch(), median of the rounds and each round:")
        for row in rows:
            rounds = " ".join(f"{ratio:.2f}" for ratio in row.get("cpu_vs_b_per_round", []))
            print(f"  ({row['mode']}) {row['name']:<30} median {row['cpu_vs_b_median']:.2f}x"
                  f"  rounds: {rounds}")
    print("CPU: the client process's CPU time (the server runs elsewhere); server: the server "
          "process's CPU time over the same run (simulator only)")


def print_memory(samples: list[dict[str, float]]) -> dict[str, float]:
    first, last = samples[0], samples[-1]
    summary = {
        "rss_growth_mb": round(last["rss_mb"] - first["rss_mb"], 1),
        "traced_growth_mb": round(last["traced_mb"] - first["traced_mb"], 2),
        "max_traced_peak_mb": max(s["traced_peak_mb"] for s in samples),
    }
    print(f"RSS {first['rss_mb']:.1f} MB after {first['events']:,.0f} events -> "
          f"{last['rss_mb']:.1f} MB after {last['events']:,.0f} "
          f"(growth {summary['rss_growth_mb']:+.1f} MB); traced memory growth "
          f"{summary['traced_growth_mb']:+.2f} MB, largest peak between samples "
          f"{summary['max_traced_peak_mb']:.2f} MB")
    return summary


# ------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_client",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000,
                        help="events per throughput run (default 200,000)")
    parser.add_argument("--memory-events", type=int, default=1_000_000,
                        help="events streamed for the memory profile (0: skip; default 1,000,000)")
    parser.add_argument("--memory-mode", choices=sorted(MODES), default="c",
                        help="mode of the memory profile (default c)")
    parser.add_argument("--runs", type=int, default=3, help="runs per mode; best is kept")
    parser.add_argument("--batch-size", type=int, default=1000,
                        help="batch_size of every mode (0: the server's default)")
    parser.add_argument("--modes", default="abcde", help="modes to measure (default abcde)")
    parser.add_argument("--uri", help="use this replica set instead of starting the simulator "
                        f"(writes to database {DATABASE!r})")
    parser.add_argument("--version", default="8.0", help="simulated server version (default 8.0)")
    parser.add_argument("--read", action="store_true",
                        help="the consumer reads fullDocument.i of every event instead of "
                        "only counting (shows the cost of decoding on access)")
    parser.add_argument("--canned", action="store_true",
                        help="replay one realistic batch from benchmarks.canned_server (no "
                        "server cost); the consumer reads type, key, time, namespace and "
                        "fullDocument.i of every event")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.events < 1 or args.runs < 1 or args.memory_events < 0 or args.batch_size < 0:
        parser.error("--events and --runs must be >= 1, --memory-events and --batch-size >= 0")
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes takes letters from {''.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join([os.path.basename(sys.executable), "-m", "benchmarks.bench_client",
                        *(sys.argv[1:] if argv is None else argv)])
    versions = {
        "python": platform.python_version(),
        "pymongo": pymongo.version,
        "pymongo_c_extensions": pymongo.has_c() and bson.has_c(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    print(f"command: {command}")
    print("versions: " + ", ".join(f"{k}={v}" for k, v in versions.items()))
    if args.canned:
        return main_canned(args, command, versions)
    server = contextlib.nullcontext((args.uri, None)) if args.uri else simulator(args.version)
    with server as (uri, pid):
        print(f"server: {redact(uri)}" + ("" if args.uri else
                                          f" (simulator {args.version}, separate process)"))
        client: MongoClient[Any]
        with MongoClient(uri) as client:
            work = preload(client, max(args.events, args.memory_events),
                           args.batch_size or None)
            try:
                print(f"throughput: {args.events:,} events per run, batch_size "
                      f"{args.batch_size or 'server default'}, best of {args.runs}, consumer "
                      + ("reads fullDocument.i of each event" if args.read else "counts"))
                results = measure(work, list(args.modes), args.events, args.runs,
                                  ServerClock(pid), args.read)
                rows = summarise(results, args.events)
                memory: list[dict[str, float]] = []
                memory_summary: dict[str, float] = {}
                if args.memory_events:
                    print(f"memory: streaming {args.memory_events:,} events with mode "
                          f"({args.memory_mode}) {MODES[args.memory_mode][0]} under tracemalloc")
                    memory = memory_profile(work, args.memory_mode, args.memory_events)
            finally:
                work.collection.drop()
    print()
    print(f"command: {command}")
    print("versions: " + ", ".join(f"{k}={v}" for k, v in versions.items()))
    print_table(rows)
    if memory:
        memory_summary = print_memory(memory)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": command, "versions": versions,
                       "server": "uri" if args.uri else f"simulator {args.version}",
                       "events": args.events, "batch_size": args.batch_size or None,
                       "runs": args.runs, "throughput": rows,
                       "memory": {"mode": args.memory_mode, "samples": memory,
                                  **memory_summary}}, out, indent=2)
    return 0


def main_canned(args: argparse.Namespace, command: str, versions: dict[str, Any]) -> int:
    """``--canned``: every mode against the canned wire server, medians of interleaved rounds."""
    per_batch = 1000
    with canned_server(per_batch) as (uri, pid, event_bytes):
        print(f"server: canned ({per_batch} realistic insert events of {event_bytes:.0f} bytes "
              "on average, replayed; separate process)")
        client: MongoClient[Any]
        with MongoClient(uri) as client:
            work = Workload(client["shop"]["orders"], Timestamp(1, 1), per_batch, per_batch)
            print(f"throughput: {args.events:,} events per run, {args.runs} interleaved rounds, "
                  "consumer reads type, key, time, namespace and fullDocument.i")
            results = measure(work, list(args.modes), args.events, args.runs, ServerClock(pid),
                              read=True)
            rows = summarise(results, args.events)
            memory: list[dict[str, float]] = []
            if args.memory_events:
                print(f"memory: streaming {args.memory_events:,} events with mode "
                      f"({args.memory_mode}) {MODES[args.memory_mode][0]} under tracemalloc")
                memory = memory_profile(work, args.memory_mode, args.memory_events)
    print()
    print(f"command: {command}")
    print("versions: " + ", ".join(f"{k}={v}" for k, v in versions.items()))
    print_table(rows)
    memory_summary = print_memory(memory) if memory else {}
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": command, "versions": versions, "server": "canned",
                       "event_bytes": event_bytes, "events": args.events,
                       "runs": args.runs, "throughput": rows,
                       "memory": {"mode": args.memory_mode, "samples": memory,
                                  **memory_summary}}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
