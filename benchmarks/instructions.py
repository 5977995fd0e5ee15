"""Instructions per change, counted by valgrind: an A/B that this VM's speed swings cannot blur.

    python -m benchmarks.instructions [--trees A,B] [--events realistic|small] [--runs 2]

Wall-clock and CPU time on this machine move by up to 2x between minutes, so a
5% change hides in them. The number of instructions the client executes per
change does not: two runs of the same tree agree to about 0.1%. Each
measurement runs a child Python under ``valgrind --tool=cachegrind`` twice, for
``--short`` and ``--long`` changes, and divides the difference (start-up and
imports cancel out) by the difference in changes.

The consumer is :func:`changestream.aio.consume` with 1,000 workers whose handler
reads a field and sleeps 5 ms (as in :mod:`benchmarks.workers_bench`), or with
``--consumer sequential`` :func:`changestream.consume` with ``workers=1`` and a
no-op handler (the plain loop's own cost per change), against
:mod:`benchmarks.canned_server` (not under valgrind). ``floor`` is the
hand-written asyncio consumer of :func:`benchmarks.workers_bench.run_floor`: raw
``getMore`` replies decoded to dicts on an ``asyncio.Queue``, no per-key order, no
checkpoint. Under valgrind the client runs about 30x slower, so fewer handlers
overlap than at full speed and the collector's share is smaller than in
``workers_bench``: compare trees with it, not absolute speeds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys

CHILD = r"""
import asyncio, sys
tree, uri, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, tree)
import bson
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from pymongo import AsyncMongoClient

DATABASE, COLLECTION = "shop", "orders"


async def consume() -> None:
    import changestream.aio
    from changestream.stores import MemoryTokenStore

    client = AsyncMongoClient(uri)
    coll = client[DATABASE][COLLECTION]
    stop = asyncio.Event()
    handled = 0

    async def handle(change):
        nonlocal handled
        change["fullDocument"]["_id"]
        await asyncio.sleep(0.005)
        handled += 1
        if handled >= count:
            stop.set()

    await changestream.aio.consume(
        lambda token: changestream.aio.watch(coll, resume_after=token), handle,
        MemoryTokenStore(), stop=stop, workers=1000, save_every=100)
    await client.close()


async def floor() -> None:
    raw = CodecOptions(document_class=RawBSONDocument)
    client = AsyncMongoClient(uri)
    db = client[DATABASE]
    queue = asyncio.Queue(4000)
    stop = asyncio.Event()
    handled = 0

    async def work():
        nonlocal handled
        while True:
            change = await queue.get()
            change["fullDocument"]["_id"]
            await asyncio.sleep(0.005)
            handled += 1
            if handled >= count:
                stop.set()

    tasks = [asyncio.create_task(work()) for _ in range(1000)]
    reply = await db.command({"aggregate": COLLECTION, "pipeline": [{"$changeStream": {}}],
                              "cursor": {}}, codec_options=raw)
    cursor_id = reply["cursor"]["id"]
    while not stop.is_set():
        reply = await db.command({"getMore": cursor_id, "collection": COLLECTION},
                                 codec_options=raw)
        for event in reply["cursor"]["nextBatch"]:
            await queue.put(bson.decode(event.raw))
    for task in tasks:
        task.cancel()
    await client.close()


def sync_noop() -> None:
    import threading

    from pymongo import MongoClient

    import changestream
    from changestream.stores import MemoryTokenStore

    client = MongoClient(uri)
    coll = client[DATABASE][COLLECTION]
    stop = threading.Event()
    handled = 0

    def handle(change):
        nonlocal handled
        handled += 1
        if handled >= count:
            stop.set()

    changestream.consume(lambda token: changestream.watch(coll, resume_after=token), handle,
                         MemoryTokenStore(), stop=stop, save_every=100)
    client.close()


if mode == "sync-noop":
    sync_noop()
else:
    asyncio.run(consume() if mode == "consume" else floor())
"""


def _child_path(tree: str) -> str:
    """The child's ``PYTHONPATH``: ``tree``, then this interpreter's site-packages (valgrind
    starts the real binary, which does not know a virtual environment's)."""
    sites = [path for path in sys.path if path.endswith("site-packages")]
    return os.pathsep.join([tree, *sites])


def instructions(python: str, tree: str, uri: str, count: int, mode: str) -> int:
    """Instructions valgrind counts for one child run of ``count`` changes."""
    result = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         python, "-c", CHILD, tree, uri, str(count), mode],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _child_path(tree)},
        check=False,
    )
    found = re.search(r"I\s+refs:\s+([\d,]+)", result.stderr)
    if result.returncode or found is None:
        raise RuntimeError(f"the child under valgrind failed (exit {result.returncode}):\n"
                           f"{result.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default=".",
                        help="comma-separated source trees to measure (default: this one)")
    parser.add_argument("--no-floor", action="store_true", help="skip the hand-written floor")
    parser.add_argument("--events", choices=("realistic", "small"), default="realistic")
    parser.add_argument("--short", type=int, default=2000, help="changes of the short run")
    parser.add_argument("--long", type=int, default=12000, help="changes of the long run")
    parser.add_argument("--runs", type=int, default=1, help="measurements per tree (median)")
    parser.add_argument("--consumer", choices=("workers", "sequential"), default="workers",
                        help="workers: aio.consume(workers=1000), 5 ms handler (default); "
                        "sequential: consume() with workers=1 and a no-op handler, the "
                        "per-change overhead of the plain loop (no floor row)")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not installed (apt install valgrind)")
    if args.long <= args.short:
        parser.error("--long must be more changes than --short")
    trees = [os.path.abspath(tree) for tree in args.trees.split(",")]
    for tree in trees:
        if not os.path.isdir(os.path.join(tree, "changestream")):
            parser.error(f"--trees: {tree} has no changestream package")
    # pyenv and virtualenv launchers are scripts or re-exec: valgrind must start the real one
    python = os.path.realpath(sys.executable)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.workers_bench import server

    mode = "consume" if args.consumer == "workers" else "sync-noop"
    sides = [(tree, mode) for tree in trees]
    if not args.no_floor and args.consumer == "workers":
        sides.append((trees[0], "floor"))
    with server(args.events) as (uri, _):
        for tree, mode in sides:
            per_change = []
            for _ in range(args.runs):
                short = instructions(python, tree, uri, args.short, mode)
                long = instructions(python, tree, uri, args.long, mode)
                per_change.append((long - short) / (args.long - args.short))
            label = "hand-written floor" if mode == "floor" else tree
            runs = ", ".join(f"{value:,.0f}" for value in per_change)
            print(f"{label:40} {statistics.median(per_change):>10,.0f} instructions/change "
                  f"({runs})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
