"""The hub: many subscribers on one cursor, total delivered changes/s and memory.

    python -m benchmarks.hub_bench                       # 20,000 changes, 100 subscribers
    python -m benchmarks.hub_bench --changes 50000 --subscribers 100

The simulator runs in a child process. The changes are written first, then read
from a stream opened before them (``resume_after``), so the rate is the
client's. Modes, each against the same backlog:

* ``stream``: one plain stream, iterated (the floor: what one cursor delivers);
* ``hub-all``: ``changestream.Hub`` (threads) with N subscribers that take every change
  (N x changes delivered);
* ``hub-match``: N subscribers with ``match={"fullDocument.k": i}`` (each 1/N of the
  changes: the client-side ``$match`` cost);
* ``aio-all``: ``changestream.aio.AsyncHub`` with N subscriber tasks taking every change.

Memory: RSS before and after, and the traced peak (``tracemalloc``) of the run; the
queues are bounded (``max_queue``, default 1000 per subscriber), so the peak stays
near N x max_queue x the size of a change.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
import tracemalloc
from typing import Any

from pymongo import AsyncMongoClient, MongoClient

import changestream
import changestream.aio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_client import current_rss_mb, simulator


def backlog(uri: str, changes: int, subscribers: int) -> Any:
    """Write ``changes`` inserts after a token; return the token."""
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    coll = client.bench.hub
    with changestream.watch(coll) as stream:
        stream.try_next()
        token = stream.resume_token
    for offset in range(0, changes, 5000):
        size = min(5000, changes - offset)
        coll.insert_many([{"i": offset + j, "k": (offset + j) % subscribers, "s": "x" * 32}
                          for j in range(size)])
    client.close()
    return token


def measure(name: str, work: Any) -> dict[str, float]:
    rss = current_rss_mb()
    tracemalloc.start()
    wall, cpu = time.perf_counter(), time.process_time()
    read, delivered = work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    row = {"read/s": read / wall, "delivered/s": delivered / wall,
           "cpu us/delivered": cpu / max(delivered, 1) * 1e6, "seconds": wall,
           "rss MB": current_rss_mb(), "rss delta MB": current_rss_mb() - rss,
           "traced peak MB": peak / 2**20}
    print(f"{name:10s} " + "  ".join(f"{k} {v:,.1f}" for k, v in row.items()), flush=True)
    return row


def plain(uri: str, token: Any, changes: int) -> tuple[int, int]:
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    n = 0
    with changestream.watch(client.bench.hub, resume_after=token) as stream:
        while n < changes:
            if stream.try_next() is not None:
                n += 1
    client.close()
    return n, n


def threaded_hub(uri: str, token: Any, changes: int, subscribers: int,
                 match: bool) -> tuple[int, int]:
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    counts = [0] * subscribers
    expected = [changes // subscribers + (1 if i < changes % subscribers else 0) if match
                else changes for i in range(subscribers)]
    with changestream.watch(client.bench.hub, resume_after=token,
                            max_await_time_ms=100) as stream:
        hub = changestream.Hub(stream)
        subs = [hub.subscribe(match={"fullDocument.k": i} if match else None)
                for i in range(subscribers)]

        def read(i: int) -> None:
            for _ in subs[i]:
                counts[i] += 1
                if counts[i] == expected[i]:
                    subs[i].close()
                    return

        readers = [threading.Thread(target=read, args=(i,)) for i in range(subscribers)]
        for r in readers:
            r.start()
        hub.start()
        for r in readers:
            r.join()
        hub.stop()
        hub.join(10)
    client.close()
    return hub.changes, sum(counts)


def async_hub(uri: str, token: Any, changes: int, subscribers: int) -> tuple[int, int]:
    async def main() -> tuple[int, int]:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
        counts = [0] * subscribers
        async with await changestream.aio.watch(client.bench.hub, resume_after=token,
                                                max_await_time_ms=100) as stream:
            hub = changestream.aio.AsyncHub(stream)
            subs = [hub.subscribe() for _ in range(subscribers)]

            async def read(i: int) -> None:
                async for _ in subs[i]:
                    counts[i] += 1
                    if counts[i] == changes:
                        subs[i].close()
                        return

            task = asyncio.create_task(hub.run())
            await asyncio.gather(*(read(i) for i in range(subscribers)))
            hub.stop()
            await task
        await client.close()
        return hub.changes, sum(counts)

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=20_000)
    parser.add_argument("--subscribers", type=int, default=100)
    parser.add_argument("--uri", help="a deployment instead of the simulator child")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.changes:,} changes, "
          f"{args.subscribers} subscribers", flush=True)

    def run(uri: str) -> None:
        token = backlog(uri, args.changes, args.subscribers)
        n, s = args.changes, args.subscribers
        measure("stream", lambda: plain(uri, token, n))
        measure("hub-all", lambda: threaded_hub(uri, token, n, s, match=False))
        measure("hub-match", lambda: threaded_hub(uri, token, n, s, match=True))
        measure("aio-all", lambda: async_hub(uri, token, n, s))

    if args.uri:
        run(args.uri)
    else:
        with simulator("8.0") as (uri, _):
            run(uri)


if __name__ == "__main__":
    main()
