"""The simulator under load: many change streams and concurrent writers, in its own process.

Two measurements, each against ``python -m changestream.testing serve`` in a
child process (so its RSS and CPU are its own):

* ``load``: S streams (collection, database and cluster scope, some with a
  ``$match``) read with PyMongo's own ``watch()`` while W writer threads (in a
  second child process, so they do not share the readers' GIL) insert, update
  and delete at a target rate for D seconds. Checked per stream: no error,
  every expected event delivered exactly once (by namespace, operation and
  ``_id``), and the longest silence while writes flow. Sampled: the server's
  RSS before the streams open, its peak, and after they close.
* ``throughput``: total delivered events/s for 1, 5 and 20 streams reading
  the same backlog of inserts (a fresh backlog per stream count).

Run: ``python -m benchmarks.sim_load`` (options: ``--help``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import multiprocessing
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pymongo
from bson.timestamp import Timestamp
from pymongo import MongoClient

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_client import simulator

Client = MongoClient[dict[str, Any]]
Key = tuple[str, str, str]
"""(namespace, operationType, _id) of one expected or delivered event."""

DBS = ("load1", "load2")
COLLS = ("a", "b")
UPDATE_LAG = 100
"""A writer updates the document it inserted this many steps earlier..."""
DELETE_LAG = 200
"""...and deletes the one from this many steps earlier: the data set stays bounded."""


# -- the server -------------------------------------------------------------------------------------
@contextlib.contextmanager
def server(version: str, extra: list[str]) -> Iterator[tuple[str, int]]:
    """The simulator in a child process (``bench_client.simulator``); yields its URI and pid."""
    with simulator(version, extra) as (uri, pid):
        assert pid is not None
        yield uri, pid


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RssSampler(threading.Thread):
    """Samples the server's RSS every ``interval`` seconds; ``peak`` is the largest seen."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.peak = 0.0
        self.samples: list[tuple[float, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            value = rss_mb(self.pid)
            self.peak = max(self.peak, value)
            self.samples.append((time.monotonic(), value))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


# -- the streams ------------------------------------------------------------------------------------
@dataclass
class StreamSpec:
    """One stream: where it watches, its ``$match`` and what it must therefore deliver."""

    name: str
    db: str | None
    """None: the whole cluster."""
    coll: str | None
    pipeline: list[dict[str, Any]]
    wants: Callable[[Key], bool]


def stream_specs(count: int) -> list[StreamSpec]:
    """``count`` streams cycling through collection, database and cluster scope, with and
    without a ``$match``."""
    kinds: list[StreamSpec] = []
    for db in DBS:
        for coll in COLLS:
            ns = f"{db}.{coll}"
            kinds.append(StreamSpec(f"coll {ns}", db, coll, [], lambda k, ns=ns: k[0] == ns))
    for db in DBS:
        kinds.append(StreamSpec(f"db {db}", db, None, [], lambda k, db=db: k[0].startswith(db + ".")))
    kinds.append(StreamSpec("cluster", None, None, [], lambda k: True))
    for db in DBS:
        ns = f"{db}.a"
        kinds.append(
            StreamSpec(f"coll {ns} inserts", db, "a", [{"$match": {"operationType": "insert"}}],
                       lambda k, ns=ns: k[0] == ns and k[1] == "insert")
        )  # fmt: skip
        kinds.append(
            StreamSpec(f"db {db} coll b", db, None, [{"$match": {"ns.coll": "b"}}],
                       lambda k, db=db: k[0] == f"{db}.b")
        )  # fmt: skip
    kinds.append(
        StreamSpec("cluster no deletes", None, None,
                   [{"$match": {"operationType": {"$in": ["insert", "update"]}}}],
                   lambda k: k[1] != "delete")
    )  # fmt: skip
    return [kinds[i % len(kinds)] for i in range(count)]


@dataclass
class StreamResult:
    spec: StreamSpec
    keys: collections.Counter[Key] = field(default_factory=collections.Counter)
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None


def event_key(event: dict[str, Any]) -> Key:
    ns = event["ns"]
    return f"{ns['db']}.{ns['coll']}", event["operationType"], str(event["documentKey"]["_id"])


def open_stream(client: Client, spec: StreamSpec, start: Timestamp) -> Any:
    options: dict[str, Any] = {"start_at_operation_time": start, "max_await_time_ms": 250}
    if spec.db is None:
        return client.watch(spec.pipeline, **options)
    if spec.coll is None:
        return client[spec.db].watch(spec.pipeline, **options)
    return client[spec.db][spec.coll].watch(spec.pipeline, **options)


def read_stream(stream: Any, result: StreamResult, done: Callable[[StreamResult], bool]) -> None:
    """Read until ``done(result)``; record each event's key and arrival time."""
    try:
        with stream:
            while not done(result):
                event = stream.try_next()
                if event is not None:
                    result.arrivals.append(time.monotonic())
                    result.keys[event_key(event)] += 1
    except Exception as exc:  # reported per stream, never hidden
        result.error = f"{type(exc).__name__}: {exc}"


# -- the writers (a child process) --------------------------------------------------------------------
def writer_process(uri: str, writers: int, rate: float, seconds: float, out: Any) -> None:
    """``writers`` threads sharing ``rate`` writes/s for ``seconds``; sends every write's key."""
    client: Client = MongoClient(uri)
    logs: list[list[Key]] = [[] for _ in range(writers)]
    start_at = time.monotonic() + 0.2

    def write(w: int) -> None:
        coll_name = f"{DBS[w % len(DBS)]}.{COLLS[(w // len(DBS)) % len(COLLS)]}"
        db_name, name = coll_name.split(".")
        coll = client[db_name][name]
        interval = writers / rate if rate > 0 else 0.0
        log = logs[w]
        due = start_at
        end = start_at + seconds
        k = 0
        while True:
            for op in ("insert", "update", "delete"):
                if (op == "update" and k < UPDATE_LAG) or (op == "delete" and k < DELETE_LAG):
                    continue
                if rate > 0:
                    pause = due - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    due += interval
                if time.monotonic() >= end:
                    return
                if op == "insert":
                    _id = f"{w}-{k}"
                    coll.insert_one({"_id": _id, "w": w, "k": k, "s": "x" * 200})
                elif op == "update":
                    _id = f"{w}-{k - UPDATE_LAG}"
                    coll.update_one({"_id": _id}, {"$inc": {"n": 1}, "$set": {"t": time.time()}})
                else:
                    _id = f"{w}-{k - DELETE_LAG}"
                    coll.delete_one({"_id": _id})
                log.append((coll_name, op, _id))
            k += 1

    while time.monotonic() < start_at:
        time.sleep(0.01)
    started = time.monotonic()
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    client.close()
    out.send((started, elapsed, [key for log in logs for key in log]))
    out.close()


# -- the load run ----------------------------------------------------------------------------------
def run_load(args: argparse.Namespace) -> bool:
    ctx = multiprocessing.get_context("spawn")
    with server(args.version, args.serve_args) as (uri, pid):
        client: Client = MongoClient(uri, maxPoolSize=args.streams + 8)
        client.admin.command("ping")
        for db in DBS:
            for coll in COLLS:
                client[db].create_collection(coll)
        time.sleep(1.0)
        baseline = rss_mb(pid)
        cpu_before = cpu_seconds(pid)
        sampler = RssSampler(pid)
        sampler.start()
        start = client.admin.command("ping")["operationTime"]
        specs = stream_specs(args.streams)
        results = [StreamResult(spec) for spec in specs]
        writes_done = threading.Event()
        expected: dict[int, collections.Counter[Key]] = {}
        drain_deadline = [float("inf")]

        def done(result: StreamResult) -> bool:
            if result.error is not None:
                return True
            if not writes_done.is_set():
                return False
            want = expected[id(result)]
            return sum(result.keys.values()) >= want.total() or time.monotonic() > drain_deadline[0]

        readers = [
            threading.Thread(target=read_stream, args=(open_stream(client, r.spec, start), r, done))
            for r in results
        ]
        for reader in readers:
            reader.start()
        receive, send = ctx.Pipe(duplex=False)
        writer = ctx.Process(
            target=writer_process, args=(uri, args.writers, args.rate, args.seconds, send)
        )
        writer.start()
        send.close()
        started, elapsed, keys = receive.recv()
        writer.join()
        for result in results:
            expected[id(result)] = collections.Counter(k for k in keys if result.spec.wants(k))
        drain_deadline[0] = time.monotonic() + args.drain
        writes_done.set()
        for reader in readers:
            reader.join()
        drained = time.monotonic()
        peak_open = sampler.peak
        client.close()  # kills the cursors
        time.sleep(args.settle)
        sampler.stop()
        after = rss_mb(pid)
        cpu = cpu_seconds(pid) - cpu_before

    ends = started + elapsed
    print(f"load: {args.streams} streams, {args.writers} writers, target {args.rate:g} writes/s, "
          f"{args.seconds:g} s, simulator {args.version}")  # fmt: skip
    print(f"  writes: {len(keys):,} in {elapsed:.1f} s = {len(keys) / elapsed:,.0f} writes/s; "
          f"streams drained {drained - ends:.1f} s after the last write")  # fmt: skip
    print(f"  {'stream':<24} {'expected':>9} {'got':>9} {'missing':>8} {'dup':>6} "
          f"{'extra':>6} {'max silence':>12}  error")  # fmt: skip
    ok = True
    total = 0
    worst_silence = 0.0
    for result in results:
        want = expected[id(result)]
        got = result.keys
        missing = sum((want - got).values())
        dup = sum(max(0, n - 1) for n in got.values())
        extra = sum(1 for k in got if k not in want)
        total += sum(got.values())
        # silence while writes flow: gaps between arrivals (and from the start) before the end
        times = [started] + [t for t in result.arrivals if t <= ends] + [ends]
        silence = max(b - a for a, b in itertools.pairwise(times))
        worst_silence = max(worst_silence, silence)
        bad = bool(missing or dup or extra or result.error or silence > 2.0)
        ok = ok and not bad
        print(f"  {result.spec.name:<24} {want.total():>9,} {got.total():>9,} {missing:>8,} "
              f"{dup:>6,} {extra:>6,} {silence:>11.2f}s  {result.error or ''}"
              f"{'  <-- FAIL' if bad else ''}")  # fmt: skip
    print(f"  delivered {total:,} events ({total / elapsed:,.0f}/s while writing); "
          f"worst silence {worst_silence:.2f} s")  # fmt: skip
    print(f"  server RSS: {baseline:.1f} MB before the streams, peak {peak_open:.1f} MB, "
          f"{after:.1f} MB {args.settle:g} s after they closed; server CPU {cpu:.1f} s")  # fmt: skip
    ok = ok and peak_open < args.rss_limit
    print(f"  result: {'PASS' if ok else 'FAIL'} (no errors, each event once, silence <= 2 s, "
          f"RSS < {args.rss_limit:g} MB)")  # fmt: skip
    return ok


# -- the throughput run ------------------------------------------------------------------------------
def run_throughput(args: argparse.Namespace) -> None:
    print(f"throughput: streams reading the same backlog of {args.backlog:,} inserts "
          f"(~380-byte events), simulator {args.version}")  # fmt: skip
    print(f"  {'streams':>7} {'events':>10} {'wall s':>8} {'events/s':>10} {'server CPU s':>13} "
          f"{'server µs/event':>16} {'RSS peak MB':>12}")  # fmt: skip
    for count in args.stream_counts:
        with server(args.version, args.serve_args) as (uri, pid):
            client: Client = MongoClient(uri, maxPoolSize=count + 4)
            coll = client.tp.c
            start = client.admin.command("ping")["operationTime"]
            for k in range(0, args.backlog, 10_000):
                n = min(10_000, args.backlog - k)
                coll.insert_many([{"i": i, "s": "x" * 200} for i in range(k, k + n)])
            sampler = RssSampler(pid)
            sampler.start()
            results = [StreamResult(StreamSpec("tp", "tp", "c", [], lambda k: True))
                       for _ in range(count)]  # fmt: skip

            def done(result: StreamResult) -> bool:
                return result.error is not None or result.keys.total() >= args.backlog

            streams = [open_stream(client, r.spec, start) for r in results]
            cpu_before = cpu_seconds(pid)
            began = time.monotonic()
            readers = [
                threading.Thread(target=read_stream, args=(s, r, done))
                for s, r in zip(streams, results, strict=True)
            ]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join()
            wall = time.monotonic() - began
            cpu = cpu_seconds(pid) - cpu_before
            sampler.stop()
            client.close()
        errors = [r.error for r in results if r.error]
        delivered = sum(r.keys.total() for r in results)
        print(f"  {count:>7} {delivered:>10,} {wall:>8.2f} {delivered / wall:>10,.0f} "
              f"{cpu:>13.2f} {cpu / delivered * 1e6:>16.1f} {sampler.peak:>12.1f}"
              f"{'  errors: ' + '; '.join(errors) if errors else ''}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["load", "throughput", "both"], default="both")
    parser.add_argument("--version", default="8.0", help="emulated server version")
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=1000.0,
                        help="total target writes/s (0: as fast as the writers go)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--drain", type=float, default=60.0,
                        help="how long streams may take to catch up after the last write")  # fmt: skip
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds between closing the streams and reading RSS again")  # fmt: skip
    parser.add_argument("--rss-limit", type=float, default=150.0, help="MB")
    parser.add_argument("--backlog", type=int, default=30_000)
    parser.add_argument("--stream-counts", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                        help="extra argument for `changestream.testing serve` (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    print(f"python {platform.python_version()}, pymongo {pymongo.version}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    ok = True
    if args.mode in ("load", "both"):
        ok = run_load(args)
    if args.mode in ("throughput", "both"):
        run_throughput(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
