"""``mirror`` end to end through the simulator: does the Delta sink keep up with its stream?

    python -m benchmarks.mirror_e2e                          # 100k and 1M documents
    python -m benchmarks.mirror_e2e --sizes 100000 --changes 50000
    python -m benchmarks.mirror_e2e --against-batch 10000    # the default batch against 10,000

For each size, in one run against one simulator (a child process, so its CPU
is not this process's):

1. **first load**: ``--docs`` orders of about 230 bytes
   (``delta_table_bench.document``) are inserted, then
   ``consume(initial_snapshot=True)`` fills a new table with
   :class:`~changestream.delta.DeltaSink` as handler and store, as ``mirror``
   does (``mirror``'s defaults: ``save_every`` ``BATCH_CHANGES`` (50,000),
   ``save_interval`` ``BATCH_SECONDS`` (5 s) and the sink's ``batch_bytes``;
   ``full_document="updateLookup"``, raw events: ``document_class=RawBSONDocument``),
   until the switch to the stream is committed (:func:`first_load`), as ``mirror
   --until-idle`` ends it; the runs below start from that stream position;
2. a backlog of ``--changes`` changes (80% updates of the newest 5% of keys,
   20% inserts) is written while nothing consumes;
3. **no-op**: the same stream (raw events too: the cheapest a consumer can
   read it), from the table's position, into a handler that does nothing (a memory token store), with the same saves; twice to
   warm the server's caches (not counted: until 5 December once, and the simulator still
   spent 39-42 µs a change on its second pass against 27-32 after, which made the first
   round's "before" slow and its ratio 8-10 points high), then right before and right
   after 4: their mean is the rate 4 is compared with (it brackets 4 in
   time, so a load that drifts favours neither side; the faster of the two,
   as this benchmark took before, favoured the no-op with the noise);
4. **mirror**: the same stream into the ``DeltaSink`` (its compactions
   included, and ``finish()`` at the end, as ``--until-idle`` does), with
   ``consume``'s defaults: the sink commits each batch behind the next
   fetch (``save_behind``). ``--rounds`` times (default 3), each into a copy
   of the table as the first load left it and followed by a no-op run, so
   each round has a no-op run on either side. With ``--against-batch N``,
   each round also runs the mirror with ``save_every=N`` (in alternating
   order, each followed by a no-op run): how the default batch was chosen;
   ``--against-log-fraction F`` does the same for the sink's ``log_fraction``,
   ``--against-no-json-worker`` with the JSON texts made in process, and
   ``--against-worker-niceness N`` with the JSON worker N below this process's
   priority (the default: ``NICENESS``, 10).

Reported: documents/s of the first load, changes/s of 3 and 4 and their
ratio per round and the round of median ratio (target: the sink keeps >= 80%
of the no-op rate; the rounds' range shows the noise of a shared 2-core
machine), the sustained ratio (4's rate to its last change handled, before
that change's batch is committed: what a mirror of an endless stream keeps up
with; the ratio above also pays the last batch's commit, once per run), the
caught-up ratio (4's rate to its last batch committed, before ``finish()``: from
then on the table holds every change, read with ``CURRENT_SQL``), the CPU
per change of this process and of the simulator in 3 and 4 and the cores they
kept busy (steadier than the rates), how much of 4 was
``finish()`` (a fixed cost of the run: at 1M documents it rewrites the base
files the log touches, ~200,000 rows, whatever the number of changes), this
process's peak RSS after each step, and the load average (the machine may be
shared).
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
from collections.abc import Callable
from typing import Any

from bson.raw_bson import RawBSONDocument
from pymongo import InsertOne, MongoClient, UpdateOne

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import changestream
from benchmarks.bench_client import simulator
from benchmarks.delta_table_bench import document, niced, niceness, oid
from changestream.delta import BATCH_CHANGES, BATCH_SECONDS, DeltaSink
from changestream.stores import MemoryTokenStore, StoredToken

WATCH = {"full_document": "updateLookup", "max_await_time_ms": 200, "copy_batch_size": 10_000,
         "document_class": RawBSONDocument}
"""``mirror``'s stream: raw events (the sink reads them from their bytes), for both runs."""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def preload(coll: Any, docs: int) -> None:
    rng = random.Random(1)
    for start in range(0, docs, 10_000):
        coll.insert_many([document(n, 0, rng) for n in range(start, min(docs, start + 10_000))],
                         ordered=False)


def backlog(coll: Any, docs: int, changes: int) -> int:
    """80% updates of the newest 5% of keys, 20% inserts of new keys; the new key count."""
    rng = random.Random(2)
    next_key = docs
    ops: list[Any] = []
    for _ in range(changes):
        if rng.random() < 0.2:
            ops.append(InsertOne(document(next_key, 0, rng)))
            next_key += 1
        else:
            key = next_key - 1 - rng.randrange(max(1, next_key // 20))
            ops.append(UpdateOne({"_id": oid(key)}, {"$inc": {"v": 1}, "$set": {"status": "paid"}}))
        if len(ops) == 5_000:
            coll.bulk_write(ops, ordered=False)
            ops = []
    if ops:
        coll.bulk_write(ops, ordered=False)
    return next_key


def run(coll: Any, handler: Callable[[Any], None], store: Any, count: int, **options: Any
        ) -> tuple[float, float]:
    """Seconds until ``count`` changes were handled and stored, and until the last of them
    was handed to ``handler`` (before the final commit)."""
    stop = threading.Event()
    seen = [0]
    handled = [0.0]

    def handle(change: Any) -> None:
        handler(change)
        seen[0] += 1
        if seen[0] >= count:
            handled[0] = time.perf_counter()
            stop.set()

    began = time.perf_counter()
    options.setdefault("save_every", BATCH_CHANGES)
    changestream.consume(coll, handle, store, stop=stop, save_interval=BATCH_SECONDS,
                         watch_options=WATCH, **options)
    return time.perf_counter() - began, handled[0] - began


def first_load(coll: Any, path: str, docs: int) -> float:
    """Seconds until the first load is over: ``docs`` snapshot records handled and the
    switch to the stream committed (the table's position is no longer the copy's), as
    ``mirror --until-idle`` ends it. Stopped at the last record instead, the table's position
    would still be in the copy, and every run from it would first copy the backlog's new
    documents again (as snapshot records) and then replay the stream from the copy's start."""
    sink = DeltaSink(path, full_document="updateLookup")
    copied, stop = threading.Event(), threading.Event()
    seen = [0]

    def handle(change: Any) -> None:
        sink(change)
        seen[0] += 1
        if seen[0] >= docs:
            copied.set()

    def switched() -> None:
        copied.wait()
        reader = DeltaSink(path, full_document="updateLookup")
        while not stop.wait(0.1):
            stored = reader.load()
            if stored is not None and stored.token.get("phase") != "copy":
                stop.set()

    watcher = threading.Thread(target=switched, daemon=True)
    watcher.start()
    began = time.perf_counter()
    changestream.consume(coll, handle, sink, stop=stop, save_every=BATCH_CHANGES,
                         save_interval=BATCH_SECONDS, watch_options=WATCH,
                         initial_snapshot=True)
    watcher.join()
    return time.perf_counter() - began


def cpu_seconds() -> float:
    """This process's CPU (all its threads: the stream, the commits, delta-rs)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def helper_seconds() -> float:
    """The CPU of this process's helpers that ended (the sink's JSON worker, which
    ``finish()`` stops; the simulator ends last)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int | None) -> float:
    """Another process's CPU seconds (the simulator's; 0 where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_line(changes: int, seconds: float, client: float, server: float,
             helper: float = 0.0) -> str:
    """CPU per change of this process, its JSON worker and the simulator, and the cores they
    kept busy."""
    return (f"µs of CPU a change: {client / changes * 1e6:.0f} here"
            + (f" + {helper / changes * 1e6:.0f} in the JSON worker" if helper else "")
            + f", {server / changes * 1e6:.0f} in the simulator; cores busy "
            f"{(client + helper + server) / seconds:.2f} of {os.cpu_count()}")


DEFAULT = {"save_every": BATCH_CHANGES}
"""The mirror's options as ``mirror`` runs it (``save_every``, and the sink's defaults)."""


def label(variant: dict[str, Any]) -> str:
    return ", ".join(f"{name} {value}" for name, value in variant.items())


def upper_median(values: list[float]) -> float:
    """The middle value (of an even count, the upper of the two middle ones), as the
    rounds' median is picked."""
    return sorted(values)[len(values) // 2]


def one_size(uri: str, docs: int, changes: int, workdir: str, rounds: int,
             against: dict[str, Any] | None = None, server_pid: int | None = None
             ) -> dict[str, float]:
    with MongoClient(uri) as client:
        coll = client.bench[f"orders_{docs}"]
        began = time.perf_counter()
        preload(coll, docs)
        print(f"[{docs:,}] preloaded in {time.perf_counter() - began:.0f} s", flush=True)
        base = os.path.join(workdir, f"t{docs}")
        load_seconds = first_load(coll, base, docs)
        print(f"[{docs:,}] first load: {docs / load_seconds:,.0f} docs/s "
              f"(peak RSS {peak_rss_mb():.0f} MB)", flush=True)
        stored = DeltaSink(base, full_document="updateLookup").load()
        assert stored is not None and stored.token.get("phase") != "copy", stored
        start = StoredToken(stored.token, None, stored.saved_at)
        backlog(coll, docs, changes)

        def noop(label: str) -> float:
            cpu, server = cpu_seconds(), process_cpu(server_pid)
            seconds, _ = run(coll, lambda change: None, MemoryTokenStore(start), changes,
                             initial_snapshot=True)
            rate = changes / seconds
            print(f"[{docs:,}] no-op consumer ({label}): {rate:,.0f} changes/s ("
                  + cpu_line(changes, seconds, cpu_seconds() - cpu,
                             process_cpu(server_pid) - server) + ")", flush=True)
            return rate

        for _ in range(2):  # the simulator's third pass over the backlog is its steady one
            noop("warm-up")
        noops = [noop("before")]
        mirrors, ratios, sustained, caught_up = [], [], [], []
        others: list[float] = []  # --against-*: its ratios, alternated with the default's
        arounds: list[float] = []  # the no-op rate around each default round
        for number in range(rounds):  # each round: the table as the first load left it
            variants = [DEFAULT] if against is None else (
                [DEFAULT, against] if number % 2 == 0 else [against, DEFAULT])
            for index, variant in enumerate(variants):
                copy = os.path.join(workdir, f"t{docs}-{number}-{index}")
                shutil.copytree(base, copy)
                options = niced(variant)
                batch = options.pop("save_every", BATCH_CHANGES)
                sink = DeltaSink(copy, full_document="updateLookup", **options)
                began, cpu, server = time.perf_counter(), cpu_seconds(), process_cpu(server_pid)
                helper = helper_seconds()
                committed, handled = run(coll, sink, sink, changes, initial_snapshot=True,
                                         save_every=batch)
                finishing = time.perf_counter()
                sink.finish()
                ended = time.perf_counter()
                rate = changes / (ended - began)
                print(f"[{docs:,}] DeltaSink, {label(variant)}: {rate:,.0f} changes/s (of its "
                      f"{ended - began:.1f} s, the last change handled at {handled:.1f} s, "
                      f"finish() took {ended - finishing:.1f} s; "
                      + cpu_line(changes, ended - began, cpu_seconds() - cpu,
                                 process_cpu(server_pid) - server, helper_seconds() - helper)
                      + ")", flush=True)
                noops.append(noop("after"))
                around = (noops[-2] + noops[-1]) / 2
                if variant is DEFAULT:
                    mirrors.append(rate)
                    ratios.append(rate / around)
                    sustained.append(changes / handled / around)
                    caught_up.append(changes / committed / around)
                    arounds.append(around)
                else:
                    others.append(rate / around)
                    print(f"[{docs:,}] {label(variant)}: sustained "
                          f"{changes / handled / around:.0%}", flush=True)
                state = sink.read_current().num_rows
                assert state == coll.estimated_document_count(), (
                    state, coll.estimated_document_count())
                shutil.rmtree(copy)
        if others:
            print(f"[{docs:,}] {label(against or {})}: ratios "
                  f"{', '.join(f'{r:.0%}' for r in others)}; median "
                  f"{upper_median(others):.0%}; the default ({label(DEFAULT)}): "
                  f"{', '.join(f'{r:.0%}' for r in ratios)}", flush=True)
        middle = sorted(range(rounds), key=ratios.__getitem__)[rounds // 2]
        print(f"[{docs:,}] DeltaSink (mirror) / no-op around it, by round: "
              f"{', '.join(f'{r:.0%}' for r in ratios)}; median {ratios[middle]:.0%}; "
              f"sustained (to the last change handled, before its batch's commit): "
              f"{', '.join(f'{r:.0%}' for r in sustained)}; median "
              f"{upper_median(sustained):.0%}; caught up (to the last batch "
              f"committed, before finish()): {', '.join(f'{r:.0%}' for r in caught_up)}; "
              f"median {upper_median(caught_up):.0%} "
              f"(peak RSS {peak_rss_mb():.0f} MB; load average {os.getloadavg()[0]:.1f})",
              flush=True)
        coll.drop()
        return {"load": docs / load_seconds, "noop": arounds[middle],
                "mirror": mirrors[middle], "low": min(ratios), "high": max(ratios),
                "sustained": upper_median(sustained), "caught_up": upper_median(caught_up)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--changes", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3,
                        help="mirror runs per size, each between two no-op runs (the median "
                             "ratio is reported)")
    parser.add_argument("--against-batch", type=int, metavar="N",
                        help="also run each round's mirror with save_every N (alternated with "
                             "the default, each between two no-op runs) and print both ratios")
    parser.add_argument("--against-log-fraction", type=float, metavar="F",
                        help="as --against-batch, for the sink's log_fraction (how big its "
                             "change log grows before a compaction)")
    parser.add_argument("--against-no-json-worker", action="store_true",
                        help="as --against-batch, with the sink's JSON texts made in process "
                             "(json_worker=False)")
    parser.add_argument("--against-worker-niceness", type=niceness, metavar="N",
                        help="as --against-batch, with the JSON worker N (0-19) below this "
                             "process's priority")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, not {args.rounds}")
    if args.against_batch is not None and args.against_batch < 1:
        parser.error(f"--against-batch must be >= 1, not {args.against_batch}")
    if args.against_log_fraction is not None and not args.against_log_fraction > 0:
        parser.error(f"--against-log-fraction must be > 0, not {args.against_log_fraction}")
    against: dict[str, Any] = {}
    if args.against_batch is not None:
        against["save_every"] = args.against_batch
    if args.against_log_fraction is not None:
        against["log_fraction"] = args.against_log_fraction
    if args.against_no_json_worker:
        against["json_worker"] = False
    if args.against_worker_niceness is not None:
        against["json_worker_niceness"] = args.against_worker_niceness
    workdir = tempfile.mkdtemp(prefix="mirror-e2e-")
    rows = []
    try:
        with simulator("8.0", ("--event-cache-mb", "512")) as (uri, pid):
            for docs in (int(size) for size in args.sizes.split(",")):
                rows.append((docs, one_size(uri, docs, args.changes, workdir, args.rounds,
                                            against or None, pid)))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("\n| documents | first load (docs/s) | no-op (changes/s) | DeltaSink (changes/s) | "
          "ratio (median) | rounds' range | caught up (median) | sustained (median) |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|")
    for docs, r in rows:
        print(f"| {docs:,} | {r['load']:,.0f} | {r['noop']:,.0f} | {r['mirror']:,.0f} | "
              f"{r['mirror'] / r['noop']:.0%} | {r['low']:.0%}-{r['high']:.0%} | "
              f"{r['caught_up']:.0%} | {r['sustained']:.0%} |")
    print(f"peak RSS {peak_rss_mb():.0f} MB; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
