"""Keeping up: ``consume(workers=N)`` with an I/O-like handler, threads and asyncio tasks.

    python -m benchmarks.workers_bench [--seconds 3] [--sleep-ms 5] [--baseline /path/to/tree]

The server is :mod:`benchmarks.canned_server` (a child process answering
every ``getMore`` with the same 1,000 realistic insert events, 1,000 distinct
``_id`` s), so the numbers are the client's. The handler sleeps ``--sleep-ms``
per change (a write to another store, an HTTP call): ``time.sleep`` on
threads, ``await asyncio.sleep`` in tasks (on asyncio's loop, and on uvloop's when
installed). Each configuration runs for
``--seconds``, ``--runs`` times (interleaved), and reports the median changes/s, the client's CPU time per change
(process time: the server is elsewhere), the server's CPU time per change (it
must stay far below the client's, else the server is the limit) and the RSS at
the end; ratios are
against the sequential loop (``workers=1``) measured in the same run. Every
handler reads a field of the change (``fullDocument._id``).

The ``floor`` rows are what asyncio and the decode cost alone (:func:`run_floor`): a
hand-written consumer with the largest ``--tasks`` count, raw ``getMore`` replies
decoded to dicts and put on an ``asyncio.Queue`` that the tasks take from, with no
per-key order, no checkpoint and no resume.

The overhead rows run a handler that does nothing: CPU per change of
``workers=1`` in this tree and, with ``--baseline TREE``, in another checkout
(e.g. the ``main`` branch before the workers existed), each in a child
process with ``PYTHONPATH=TREE``, interleaved, median of ``--overhead-runs``.

``--compare TREE`` (or ``--compare gc-freeze``) instead runs 1,000 asyncio workers on
small events (or ``--events realistic``) in child processes, this tree against TREE (or against itself with
``gc.freeze()`` after start-up), interleaved ``--runs`` times; each child warms up
1 s first. A/B pairs in fresh processes show a change through this VM's speed swings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import bson
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient, MongoClient

try:
    from benchmarks.bench_client import canned_server
except ImportError:  # python benchmarks/workers_bench.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.bench_client import canned_server
import changestream
import changestream.aio
from benchmarks.canned_server import COLLECTION, DATABASE, CannedServer
from changestream.stores import MemoryTokenStore


def small_events(count: int) -> list[dict[str, Any]]:
    """``count`` small insert events (``{_id: i, v: 1}``): decoding them is cheap, so what
    remains is the loop and the scheduling."""
    events = []
    for i in range(count):
        seconds = 1_700_000_000 + i // 10
        token = f"82{seconds:08X}{i % 10 + 1:08X}2B042C0100296E5A1004463C5F6964002B{i:08X}0004"
        events.append({
            "_id": {"_data": token}, "operationType": "insert",
            "clusterTime": Timestamp(seconds, i % 10 + 1),
            "fullDocument": {"_id": i, "v": 1}, "ns": {"db": DATABASE, "coll": COLLECTION},
            "documentKey": {"_id": i},
        })
    return events


def serve_small() -> None:
    """The canned server with :func:`small_events` (a child process; prints its URI)."""
    server = CannedServer(small_events(1000))
    print(f"mongodb://127.0.0.1:{server.port}/?directConnection=true "
          f"{server.event_bytes:.0f}", flush=True)
    server.serve_forever()


@contextlib.contextmanager
def server(kind: str) -> Iterator[tuple[str, int | None]]:
    """The canned server in a child process: its URI and pid."""
    if kind == "realistic":
        with canned_server(1000) as (uri, pid, _):
            yield uri, pid
        return
    process = subprocess.Popen(
        [sys.executable, "-c", "from benchmarks.workers_bench import serve_small; serve_small()"],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert process.stdout is not None
        uri = process.stdout.readline().split()[0]
        yield uri, process.pid
    finally:
        process.terminate()
        process.wait(10)


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int | None) -> float:
    """CPU seconds used so far by process ``pid`` (the server: it must not be the limit)."""
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def stop_after(seconds: float, stop: Any, set_stop: Callable[[], object]) -> threading.Timer:
    timer = threading.Timer(seconds, set_stop)
    timer.daemon = True
    timer.start()
    return timer


def run_threads(uri: str, workers: int, seconds: float, sleep: float) -> dict[str, Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    coll = client[DATABASE][COLLECTION]
    stop = threading.Event()

    def handle(change: Any) -> None:
        change["fullDocument"]["_id"]  # a consumer that uses the change
        if sleep:
            time.sleep(sleep)

    started_cpu, started = cpu(), time.perf_counter()
    stop_after(seconds, stop, stop.set)
    result = changestream.consume(
        lambda token: changestream.watch(coll, resume_after=token), handle, MemoryTokenStore(),
        stop=stop, workers=workers, save_every=100,
    )
    elapsed, used = time.perf_counter() - started, cpu() - started_cpu
    client.close()
    return {"mode": "threads", "workers": workers, "handled": result.handled,
            "per_second": result.handled / elapsed, "cpu_us": 1e6 * used / max(result.handled, 1),
            "rss_mb": rss_mb()}


def run_tasks(uri: str, workers: int, seconds: float, sleep: float,
              loop_name: str = "asyncio") -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
        coll = client[DATABASE][COLLECTION]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def handle(change: Any) -> None:
            change["fullDocument"]["_id"]  # a consumer that uses the change
            if sleep:
                await asyncio.sleep(sleep)

        started_cpu, started = cpu(), time.perf_counter()
        stop_after(seconds, stop, lambda: loop.call_soon_threadsafe(stop.set))
        result = await changestream.aio.consume(
            lambda token: changestream.aio.watch(coll, resume_after=token), handle,
            MemoryTokenStore(), stop=stop, workers=workers, save_every=100,
        )
        elapsed, used = time.perf_counter() - started, cpu() - started_cpu
        await client.close()
        return {"mode": loop_name, "workers": workers, "handled": result.handled,
                "per_second": result.handled / elapsed,
                "cpu_us": 1e6 * used / max(result.handled, 1), "rss_mb": rss_mb()}

    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


def run_floor(uri: str, workers: int, seconds: float, sleep: float,
              loop_name: str = "asyncio") -> dict[str, Any]:
    """The hand-written floor: ``aggregate``/``getMore`` through ``Database.command``, each
    event decoded to a dict and put on an ``asyncio.Queue`` (as many places as
    ``consume``'s default ``max_in_flight``) that ``workers`` tasks take from. No
    per-key order, no checkpoint, no resume: what asyncio and the decode cost alone."""
    raw = CodecOptions(document_class=RawBSONDocument)

    async def main() -> dict[str, Any]:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
        db = client[DATABASE]
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(max(64, 4 * workers))
        handled = 0

        async def work() -> None:
            nonlocal handled
            while True:
                change = await queue.get()
                change["fullDocument"]["_id"]
                if sleep:
                    await asyncio.sleep(sleep)
                handled += 1

        tasks = [asyncio.create_task(work()) for _ in range(workers)]
        reply = await db.command({"aggregate": COLLECTION, "pipeline": [{"$changeStream": {}}],
                                  "cursor": {}}, codec_options=raw)
        cursor_id = reply["cursor"]["id"]
        started_cpu, started = cpu(), time.perf_counter()
        while time.perf_counter() - started < seconds:
            reply = await db.command({"getMore": cursor_id, "collection": COLLECTION},
                                     codec_options=raw)
            for event in reply["cursor"]["nextBatch"]:
                await queue.put(bson.decode(event.raw))
        elapsed, used = time.perf_counter() - started, cpu() - started_cpu
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        return {"mode": f"{loop_name} floor", "workers": workers, "handled": handled,
                "per_second": handled / elapsed, "cpu_us": 1e6 * used / max(handled, 1),
                "rss_mb": rss_mb()}

    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


def overhead_child(uri: str, seconds: float) -> None:
    """One no-op-handler run of ``workers=1`` (the default call, so any tree can run it)."""
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    coll = client[DATABASE][COLLECTION]
    stop = threading.Event()
    stop_after(seconds, stop, stop.set)
    started_cpu, started = cpu(), time.perf_counter()
    result = changestream.consume(lambda token: changestream.watch(coll, resume_after=token),
                                  lambda change: None, MemoryTokenStore(), stop=stop,
                                  save_every=100)
    used, elapsed = cpu() - started_cpu, time.perf_counter() - started
    print(json.dumps({"cpu_us": 1e6 * used / result.handled,
                      "per_second": result.handled / elapsed}))


def tasks_child(uri: str, seconds: float, freeze: bool) -> None:
    """One ``--compare`` run: 1,000 asyncio workers, after a 1 s warm-up."""
    run_tasks(uri, 1000, 1.0, 0.005)
    if freeze:
        gc.freeze()
    print(json.dumps(run_tasks(uri, 1000, seconds, 0.005)))


def compare(uri: str, other: str, seconds: float, runs: int,
            kind: str = "small") -> dict[str, list[dict[str, Any]]]:
    """``--compare``: this tree against ``other`` (a tree, or ``gc-freeze``), interleaved."""
    here = os.getcwd()
    sides = {"this tree": (here, False)}
    sides.update({"gc.freeze()": (here, True)} if other == "gc-freeze" else {"other": (other, False)})
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for _ in range(runs):
        for name, (tree, freeze) in sides.items():
            output = subprocess.run(
                [sys.executable, "-c", "from benchmarks.workers_bench import tasks_child; "
                 f"tasks_child({uri!r}, {seconds}, {freeze})"],
                env={**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{here}"},
                capture_output=True, text=True, check=True, cwd=here,
            ).stdout
            results[name].append(json.loads(output.strip().splitlines()[-1]))
    print(f"\n1,000 asyncio workers, {kind} events, {runs} interleaved child processes "
          f"(median; each run)")
    for name, rows in results.items():
        rates = [r["per_second"] for r in rows]
        cpu_us = [r["cpu_us"] for r in rows]
        print(f"  {name:12} {statistics.median(rates):>8,.0f}/s {statistics.median(cpu_us):6.1f} "
              f"µs/chg  ({', '.join(f'{r:,.0f}' for r in rates)})")
    return results


def overhead(uri: str, tree: str, seconds: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    output = subprocess.run(
        [sys.executable, "-c", "import sys; from benchmarks.workers_bench import overhead_child; "
         f"overhead_child({uri!r}, {seconds})"],
        env={**env, "PYTHONPATH": f"{tree}{os.pathsep}{os.getcwd()}"}, capture_output=True,
        text=True, check=True, cwd=os.getcwd(),
    ).stdout
    return json.loads(output.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.workers_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per configuration (3)")
    parser.add_argument("--sleep-ms", type=float, default=5.0, help="handler time (5)")
    parser.add_argument("--threads", default="1,8,32,128", help="thread worker counts")
    parser.add_argument("--tasks", default="1,100,1000", help="asyncio worker counts")
    parser.add_argument("--baseline", metavar="TREE",
                        help="also measure workers=1 overhead with this source tree")
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration (3)")
    parser.add_argument("--overhead-runs", type=int, default=5)
    parser.add_argument("--events", choices=("small", "realistic", "both"), default="both",
                        help="small {_id, v} inserts, the canned realistic orders (~490 bytes), "
                        "or both (default)")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--compare", metavar="TREE|gc-freeze",
                        help="only an A/B of 1,000 asyncio workers: this tree against TREE, "
                        "or against gc.freeze() after start-up")
    args = parser.parse_args(argv)
    sleep = args.sleep_ms / 1000
    if args.compare:
        if args.compare != "gc-freeze" and not os.path.isdir(args.compare):
            parser.error(f"--compare: {args.compare!r} is neither a directory nor gc-freeze")
        kind = "realistic" if args.events == "realistic" else "small"
        with server(kind) as (uri, _):
            results = compare(uri, args.compare, args.seconds, args.runs, kind)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(results, out, indent=1)
        return 0
    rows: list[dict[str, Any]] = []
    print(f"# {platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; handler sleeps "
          f"{args.sleep_ms:g} ms; {args.seconds:g} s per row", flush=True)
    kinds = ("small", "realistic") if args.events == "both" else (args.events,)
    loops = ["asyncio"]
    if importlib.util.find_spec("uvloop") is not None:
        loops.append("uvloop")
    else:
        print("# uvloop not installed (pip install 'changestream[uvloop]'): asyncio rows only")
    samples: dict[str, list[float]] = {}
    for kind in kinds:
        with server(kind) as (uri, server_pid):
            configs: list[tuple[str, int]] = [
                ("threads", w) for w in map(int, args.threads.split(","))]
            configs += [(loop_name, w) for loop_name in loops
                        for w in map(int, args.tasks.split(","))]
            floor_workers = max(map(int, args.tasks.split(",")))
            configs += [(f"{loop_name} floor", floor_workers) for loop_name in loops]
            runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
            for _ in range(args.runs):  # interleaved: load changes hit every configuration
                for mode, workers in configs:
                    server_cpu = process_cpu(server_pid)
                    if mode == "threads":
                        run = run_threads(uri, workers, args.seconds, sleep)
                    elif mode.endswith(" floor"):
                        run = run_floor(uri, workers, args.seconds, sleep, mode.split()[0])
                    else:
                        run = run_tasks(uri, workers, args.seconds, sleep, mode)
                    run["server_us"] = (1e6 * (process_cpu(server_pid) - server_cpu)
                                        / max(run["handled"], 1))
                    runs[(mode, workers)].append(run)
            table = []
            for (mode, workers), results in runs.items():
                rates = sorted(r["per_second"] for r in results)
                table.append({"mode": mode, "workers": workers, "events": kind,
                              "per_second": statistics.median(rates), "best": rates[-1],
                              "cpu_us": statistics.median(r["cpu_us"] for r in results),
                              "rss_mb": max(r["rss_mb"] for r in results),
                              "server_us": statistics.median(r["server_us"] for r in results)})
            sequential = next(row["per_second"] for row in table
                              if row["mode"] == "threads" and row["workers"] == 1)
            print(f"\n{kind} events (median of {args.runs}; best in parentheses)")
            print(f"{'mode':13} {'workers':>7} {'changes/s':>18} {'x seq':>7} "
                  f"{'CPU us/chg':>10} {'RSS MB':>7} {'server us/chg':>13}")
            for row in table:
                row["ratio"] = row["per_second"] / sequential
                rate = f"{row['per_second']:,.0f} ({row['best']:,.0f})"
                print(f"{row['mode']:13} {row['workers']:>7} {rate:>18} "
                      f"{row['ratio']:>7.1f} {row['cpu_us']:>10.1f} {row['rss_mb']:>7.0f} "
                      f"{row['server_us']:>13.1f}",
                      flush=True)
            rows.extend(table)
            if kind != kinds[0] or not args.overhead_runs:
                continue
            trees = {"this tree": os.getcwd()}
            if args.baseline:
                trees["baseline"] = args.baseline
            samples = {name: [] for name in trees}
            for _ in range(args.overhead_runs):
                for name, tree in trees.items():
                    samples[name].append(overhead(uri, tree, min(args.seconds, 2.0))["cpu_us"])
            print(f"\nno-op handler, workers=1, {kind} events (CPU us per change, median of "
                  f"{args.overhead_runs}):")
            medians = {name: statistics.median(values) for name, values in samples.items()}
            for name, value in medians.items():
                listed = ", ".join(f"{v:.2f}" for v in samples[name])
                print(f"  {name:10} {value:6.2f}  (runs: {listed})")
            if "baseline" in medians:
                print(f"  this tree / baseline: {medians['this tree'] / medians['baseline']:.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": rows, "overhead": samples}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
