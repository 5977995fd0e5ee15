"""What a token store's durability costs: per save, and for the sequential ``consume`` loop.

    python -m benchmarks.store_bench                    # 2,000 saves, 5,000 changes
    python -m benchmarks.store_bench --saves 5000 --changes 20000 --dir /mnt/data

Two measurements, each store in the same run (ratios, not absolute speed, carry over
to another machine; the directory's file system decides the fsync cost):

* ``save``: microseconds per ``store.save(token)`` of a real resume token, for
  ``MemoryTokenStore``, ``FileTokenStore`` (fsync every save, the default) and
  ``FileTokenStore(fsync_interval=1)`` (an fsync at most once a second);
* ``consume``: changes/s of the sequential loop (``workers=1``, ``save_every=1``, the
  defaults: a save after every change) with a no-op handler over a backlog written
  first to the simulator (in a child process), for the same three stores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from pymongo import MongoClient

import changestream
from changestream.stores import FileTokenStore, MemoryTokenStore

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_client import simulator

TOKEN = {"_data": "8267A1B2C3000000012B042C0100296E5A1004" + "AB" * 16 + "463C6F7065726174696F6E"
         "54797065003C696E736572740046646F63756D656E744B65790046645F6964006467A1B2C3D4E5F6"
         "0004"}


def stores(directory: str) -> dict[str, Callable[[], Any]]:
    return {
        "memory": MemoryTokenStore,
        "file, fsync every save": lambda: FileTokenStore(
            tempfile.mktemp(dir=directory, suffix=".token")),
        "file, fsync_interval=1": lambda: FileTokenStore(
            tempfile.mktemp(dir=directory, suffix=".token"), fsync_interval=1.0),
    }


def per_save(make: Callable[[], Any], saves: int) -> float:
    store = make()
    store.save(TOKEN)  # the first save creates the file (and fsyncs it)
    started = time.perf_counter()
    for n in range(saves):
        store.save(TOKEN, batch_id=n)
    return (time.perf_counter() - started) / saves * 1e6


def consume_rate(uri: str, make: Callable[[], Any], changes: int) -> float:
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    coll = client.bench[f"store_{time.monotonic_ns()}"]
    start = changestream.watch(coll)
    token = start.resume_token
    start.close()
    coll.insert_many([{"i": i, "pad": "x" * 200} for i in range(changes)])
    stop = threading.Event()
    handled = 0

    def handle(change: Any) -> None:
        nonlocal handled
        handled += 1
        if handled == changes:
            stop.set()

    store = make()
    store.save(token)
    started = time.perf_counter()
    changestream.consume(lambda t: changestream.watch(coll, resume_after=t), handle, store,
                         stop=stop)
    seconds = time.perf_counter() - started
    client.close()
    return changes / seconds


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=2000)
    parser.add_argument("--changes", type=int, default=5000)
    parser.add_argument("--dir", default=None, help="where the token files go (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        made = stores(directory)
        print(f"save ({args.saves} saves, in {directory}):")
        saves = {name: per_save(make, args.saves) for name, make in made.items()}
        for name, micros in saves.items():
            print(f"  {name:<26} {micros:9.1f} us/save")
        with simulator("8.0") as (uri, _):
            print(f"consume, sequential, save_every=1 ({args.changes} changes, no-op handler):")
            # Twice, interleaved: the first round warms the client and the simulator up.
            rates: dict[str, float] = {}
            for _ in range(2):
                rates = {name: consume_rate(uri, make, args.changes) for name, make in made.items()}
        floor = rates["memory"]
        for name, rate in rates.items():
            print(f"  {name:<26} {rate:9.0f} changes/s  ({rate / floor:.2f} x memory)")


if __name__ == "__main__":
    main(sys.argv[1:])
