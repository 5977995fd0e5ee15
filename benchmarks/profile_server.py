"""Where the simulator spends its time per change event (for the simulator's owner).

    python -m benchmarks.profile_server [--events N] [--batch-size B] [--top K]

Runs the simulator in this process and preloads N inserts; a client in a
child process (so it does not compete for this process's GIL) then streams
them with ``changestream.watch()`` while every simulator connection thread
runs under cProfile. Prints the top functions by own and cumulative time, in
µs per event. Profiling inflates the absolute numbers (about 2x): compare
shares, and see the "server" column of ``bench_client`` for the unprofiled
server CPU per event.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import threading
import time
from typing import Any

from bson.timestamp import Timestamp
from pymongo import MongoClient

from changestream.testing import ReplicaSet

_CLIENT = """
import sys
from bson.timestamp import Timestamp
from pymongo import MongoClient
import changestream
uri, seconds, inc, events, batch_size = sys.argv[1:]
with MongoClient(uri) as client, changestream.watch(
    client["changestream_bench"]["events"], batch_size=int(batch_size),
    start_at_operation_time=Timestamp(int(seconds), int(inc))) as stream:
    for count, _ in enumerate(stream, 1):
        if count == int(events):
            break
"""
"""The streaming client, run in a child process."""

_WAITS = ("recv_into", "recv", "accept", "acquire", "wait", "select", "poll", "sleep")
"""Blocking built-ins: their (wall-clock) time is waiting for the client, not work."""
_profiles: list[cProfile.Profile] = []
_original_run = threading.Thread.run


def _profiled_run(self: threading.Thread) -> None:
    """``Thread.run`` under a per-thread CPU-time profiler, for the simulator's threads."""
    if not self.name.startswith("sim-conn"):
        _original_run(self)
        return
    profile = cProfile.Profile()
    _profiles.append(profile)
    profile.enable()
    try:
        _original_run(self)
    finally:
        profile.disable()


def _short(filename: str) -> str:
    """``changestream/testing/x.py`` rather than an absolute path."""
    for marker in ("/changestream/", "/site-packages/", "/lib/python"):
        if marker in filename:
            return filename[filename.index(marker) + 1:]
    return filename


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--version", default="8.0")
    args = parser.parse_args(argv)

    with ReplicaSet(args.version, noop_interval=0) as rs:
        writer: MongoClient[dict[str, Any]] = MongoClient(rs.uri)
        with writer, writer.start_session() as session:
            coll = writer["changestream_bench"]["events"]
            writer["changestream_bench"]["marker"].insert_one({}, session=session)
            start = session.operation_time
            assert isinstance(start, Timestamp)
            for offset in range(0, args.events, 10_000):
                coll.insert_many([{"i": offset + k, "s": "x" * 32}
                                  for k in range(min(10_000, args.events - offset))])
        # New connections (new server threads) from here on are profiled.
        threading.Thread.run = _profiled_run  # type: ignore[method-assign]
        try:
            began = time.perf_counter()
            subprocess.run([sys.executable, "-c", _CLIENT, rs.uri, str(start.time),
                            str(start.inc), str(args.events), str(args.batch_size)], check=True)
            elapsed = time.perf_counter() - began
        finally:
            threading.Thread.run = _original_run  # type: ignore[method-assign]
    count = args.events
    if not _profiles:
        print("no simulator connection thread was profiled", file=sys.stderr)
        return 1
    stats: dict[Any, Any] = pstats.Stats(*_profiles).stats  # type: ignore[attr-defined]
    waits = {key for key in stats if any(f"'{name}'" in key[2] for name in _WAITS)}
    total = sum(entry[2] for key, entry in stats.items() if key not in waits)
    print(f"{count:,} events, batch_size {args.batch_size}, streamed in {elapsed:.1f} s")
    print(f"profiled server time, socket and lock waits excluded: {total / count * 1e6:.1f} "
          "µs/event (the thread/_serve/_handle entries below include those waits)")
    for index, title in ((2, "own time"), (3, "cumulative time")):
        print(f"\n== top {args.top} simulator functions by {title} ==")
        print(f"{'µs/event':>9} {'share':>6} {'calls/event':>12}  function")
        ranked = sorted((item for item in stats.items() if item[0] not in waits),
                        key=lambda item: item[1][index], reverse=True)
        for (filename, line, name), entry in ranked[: args.top]:
            where = name if filename == "~" else f"{_short(filename)}:{line}({name})"
            print(f"{entry[index] / count * 1e6:9.2f} {entry[index] / total:6.1%} "
                  f"{entry[1] / count:12.2f}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
