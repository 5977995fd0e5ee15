"""Change streams through one mongos over two shards: events/s, simulator CPU per event, and
the delay an idle shard adds to a busy shard's events.

    python -m benchmarks.sharded_cluster [--events 20000] [--noop-interval 10]

Writes go straight into the shards' command layer (not timed); the stream is read with
PyMongo through one mongos. The idle-shard delay is measured with writes on one shard only,
at the given no-op interval (mongod's default 10 s).
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from typing import Any

import pymongo

from changestream.testing import ShardedCluster


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def throughput(events: int) -> tuple[float, float]:
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.2) as cluster:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(cluster.uri)
        client.admin.command("shardCollection", "bench.c", key={"_id": "hashed"})
        coll = client.bench.c
        stream = coll.watch(max_await_time_ms=500)
        for start in range(0, events, 1000):
            coll.insert_many([{"_id": i, "v": "x" * 100} for i in range(start, start + 1000)])
        cpu0, t0 = _cpu(), time.perf_counter()
        seen = 0
        while seen < events:
            if stream.try_next() is not None:
                seen += 1
        elapsed, cpu = time.perf_counter() - t0, _cpu() - cpu0
        stream.close()
        client.close()
    return events / elapsed, cpu / events * 1e6


def idle_shard_delay(noop_interval: float, samples: int) -> tuple[float, float]:
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=noop_interval) as cluster:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(cluster.uri)
        admin = client.admin
        admin.command("shardCollection", "bench.r", key={"x": 1})
        admin.command("split", "bench.r", middle={"x": 0})
        admin.command("moveChunk", "bench.r", find={"x": 1}, to=cluster.shard_names[1])
        admin.command("moveChunk", "bench.r", find={"x": -1}, to=cluster.shard_names[0])
        coll = client.bench.r
        rng = random.Random(12)
        delays = []
        with coll.watch(max_await_time_ms=1000) as stream:
            for i in range(samples):
                time.sleep(rng.uniform(0, noop_interval))  # a random phase of the no-op timer
                t0 = time.perf_counter()
                coll.insert_one({"x": i + 1})  # shard1 only: shard0 stays idle
                while stream.try_next() is None:
                    pass
                delays.append(time.perf_counter() - t0)
        client.close()
    return sum(delays) / len(delays), max(delays)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--noop-interval", type=float, default=10.0)
    parser.add_argument("--samples", type=int, default=3)
    args = parser.parse_args()
    rate, cpu_us = throughput(args.events)
    print(f"events/s through one mongos over 2 shards: {rate:,.0f}")
    print(f"simulator+client CPU per event: {cpu_us:.1f} us")
    mean, worst = idle_shard_delay(args.noop_interval, args.samples)
    print(
        f"delay of a busy shard's event with an idle shard (no-op every "
        f"{args.noop_interval:g} s, {args.samples} writes at random phases): "
        f"mean {mean:.2f} s, max {worst:.2f} s"
    )


if __name__ == "__main__":
    main()
