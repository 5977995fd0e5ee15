"""First-event latency of a v1 and a v2 change stream on the same 9.0 cluster (issue 32):
two shards, the collection on one of them, the other shard idle.

    python -m benchmarks.v2_latency [--samples 3] [--noop-interval 10]

Both streams are open at once through one mongos and read by PyMongo in two threads; each
sample inserts one document and times how long each stream takes to return it. v1 reads
every shard, so mongos waits for the idle shard's periodic no-op (mongod's default 10 s);
v2 (the 9.0 default) reads only the shard that holds the collection.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import pymongo

from changestream.testing import ShardedCluster


def _reader(cursor: Any, arrived: dict[int, float], done: threading.Event) -> None:
    while not done.is_set():
        event = cursor.try_next()
        if event is not None:
            arrived[int(event["documentKey"]["_id"])] = time.perf_counter()


def measure(samples: int, noop_interval: float) -> tuple[list[float], list[float]]:
    with ShardedCluster("9.0", shards=2, mongoses=1, noop_interval=noop_interval) as cluster:
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(cluster.uri)
        client.admin.command("enableSharding", "bench", primaryShard=cluster.shard_names[0])
        coll = client.bench.c
        coll.insert_one({"_id": -1})
        v1 = coll.aggregate([{"$changeStream": {"version": "v1"}}], maxAwaitTimeMS=200)
        v2 = coll.watch(max_await_time_ms=200)  # no version: mongos picks v2 on 9.0
        arrived: tuple[dict[int, float], dict[int, float]] = ({}, {})
        done = threading.Event()
        threads = [
            threading.Thread(target=_reader, args=(cursor, seen, done), daemon=True)
            for cursor, seen in zip((v1, v2), arrived, strict=True)
        ]
        for thread in threads:
            thread.start()
        sent: list[float] = []
        try:
            for i in range(samples):
                sent.append(time.perf_counter())
                coll.insert_one({"_id": i})
                deadline = time.monotonic() + 3 * noop_interval + 5
                while not all(i in seen for seen in arrived) and time.monotonic() < deadline:
                    time.sleep(0.005)
        finally:
            done.set()
            for thread in threads:
                thread.join()
            v1.close()
            v2.close()
            client.close()
    lat = [[seen[i] - sent[i] for i in range(samples) if i in seen] for seen in arrived]
    return lat[0], lat[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--noop-interval", type=float, default=10.0)
    args = parser.parse_args()
    v1, v2 = measure(args.samples, args.noop_interval)
    print(f"cluster: 9.0, 2 shards, collection on shard0, shard1 idle, "
          f"no-op every {args.noop_interval:g} s; {args.samples} samples")  # fmt: skip
    for name, lat in (("v1", v1), ("v2", v2)):
        if not lat:
            print(f"{name}: no event arrived")
            continue
        print(f"{name} first-event latency: median {statistics.median(lat) * 1000:.0f} ms, "
              f"max {max(lat) * 1000:.0f} ms ({len(lat)} events)")  # fmt: skip
    if v1 and v2:
        print(f"v1 / v2 (medians): {statistics.median(v1) / statistics.median(v2):.0f}x")


if __name__ == "__main__":
    main()
