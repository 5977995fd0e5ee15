"""The first copy with 1 and N readers, and a re-snapshot while writes go on (issue 30, 4 and 5).

    python -m benchmarks.resnapshot_bench --docs 200000 --readers 4 --writes 1000

The simulator runs in a child process. ``N`` documents ``{_id: i, s: <32 chars>, v: 0}``
are preloaded; then, each a ``changestream mirror`` process as users run it:

* **copy 1** / **copy N**: ``mirror --until-idle 0.5 --snapshot-readers 1`` (the single
  reader of ``consume``'s snapshot) and ``--snapshot-readers N`` into new tables: wall time;
* **re-snapshot**: a mirror runs on the copy-N table; 8 writer threads make ``--writes`` updates,
  replaces, inserts and deletes a second (paced); ``mirror --resnapshot`` asks, and the time
  until the committed progress says done is measured, with the writes achieved meanwhile;
  then the writes stop, the mirror catches up and the table is compared with the collection.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import deltalake
from bson import json_util
from pymongo import MongoClient

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_client import simulator

PAYLOAD = "x" * 32
INSERT_BATCH = 10_000
WRITERS = 8
"""Writer threads, each paced at an eighth of ``--writes``: a paced thread that fell behind
catches up, but one round trip at a time, and the simulator (one process, one lock) holds
its writes ~0.5 s while it reads a chunk of a 1M-document collection; 4 threads caught up
too slowly to keep 1,000 writes/s, as many application threads would."""


def mirror_args(uri: str, coll: str, target: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "changestream", "mirror", uri, "--db", "bench", "--coll", coll,
            "--to", target, "--no-status", *extra]


def first_copy(uri: str, target: str, readers: int) -> float:
    began = time.perf_counter()
    done = subprocess.run(mirror_args(uri, "c", target, "--until-idle", "0.5",
                                      "--snapshot-readers", str(readers), "--batch", "10000"),
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr)
    return time.perf_counter() - began


def progress(target: str) -> dict[str, Any] | None:
    for commit in deltalake.DeltaTable(target).history(50):
        if "changestream.resnapshot" in commit:
            return dict(json.loads(commit["changestream.resnapshot"]))
    return None


def writer(coll: Any, keys: int, rate: float, stop: threading.Event, done: list[int],
           seed: int = 1) -> None:
    rnd = random.Random(seed)
    began = time.perf_counter()
    n = 0
    while not stop.is_set():
        key, roll = rnd.randrange(keys + keys // 20), rnd.random()
        if roll < 0.1:
            coll.delete_one({"_id": key})
        elif roll < 0.7:
            coll.update_one({"_id": key}, {"$inc": {"v": 1}}, upsert=True)
        else:
            coll.replace_one({"_id": key}, {"_id": key, "s": PAYLOAD, "v": -n}, upsert=True)
        n += 1
        ahead = n / rate - (time.perf_counter() - began)
        if ahead > 0:
            time.sleep(ahead)
    done.append(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--docs", type=int, default=200_000)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--writes", type=float, default=1000.0, help="writes per second")
    parser.add_argument("--chunk", type=int, default=10_000)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with simulator("8.0") as (uri, _pid), tempfile.TemporaryDirectory() as tmp:
        client: MongoClient[dict[str, Any]] = MongoClient(uri)
        coll = client.bench.c
        try:  # a copy of many documents by many readers may outlast the default 300 s
            client.admin.command("setParameter", 1, minSnapshotHistoryWindowInSeconds=3600)
        except Exception as exc:  # a server that refuses: the default then
            print(f"minSnapshotHistoryWindowInSeconds stays: {exc}")
        began = time.perf_counter()
        for offset in range(0, args.docs, INSERT_BATCH):
            size = min(INSERT_BATCH, args.docs - offset)
            coll.insert_many([{"_id": offset + k, "s": PAYLOAD, "v": 0} for k in range(size)],
                             ordered=False)
        print(f"preloaded {args.docs:,} documents in {time.perf_counter() - began:.1f} s")
        one = first_copy(uri, f"{tmp}/one", 1)
        print(f"copy, 1 reader:  {one:7.1f} s  {args.docs / one:9,.0f} docs/s", flush=True)
        many = first_copy(uri, f"{tmp}/many", args.readers)
        print(f"copy, {args.readers} readers: {many:7.1f} s  {args.docs / many:9,.0f} docs/s  "
              f"({one / many:.2f}x)  load average {os.getloadavg()[0]:.1f}", flush=True)

        target = f"{tmp}/many"
        running = subprocess.Popen(
            mirror_args(uri, "c", target, "--resnapshot-chunk", str(args.chunk),
                        "--batch-seconds", "1"),
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stop, written = threading.Event(), []
        threads = [threading.Thread(target=writer, args=(coll, args.docs,
                                                         args.writes / WRITERS, stop, written,
                                                         seed)) for seed in range(WRITERS)]
        for thread in threads:
            thread.start()
        time.sleep(3)  # the mirror is streaming the writes
        asked = time.perf_counter()
        subprocess.run(mirror_args(uri, "c", target, "--resnapshot"), check=True,
                       capture_output=True)
        while True:
            state = progress(target)
            if state is not None and state["chunks"] and not state["active"]:
                break
            if running.poll() is not None:
                raise RuntimeError(running.stderr.read() if running.stderr else "mirror died")
            time.sleep(0.5)
        took = time.perf_counter() - asked
        stop.set()
        for thread in threads:
            thread.join()
        total = time.perf_counter() - asked + 3
        running.terminate()
        running.wait(30)
        print(f"re-snapshot of {state['keys']:,} documents in {args.chunk:,}-document chunks: "
              f"{took:.1f} s ({state['keys'] / took:,.0f} docs/s) while "
              f"{sum(written) / total:,.0f} writes/s went on; {state['dropped']:,} chunk rows "
              f"left to the stream, {state['deleted']:,} deleted; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        caught = subprocess.run(mirror_args(uri, "c", target, "--until-idle", "0.5"),
                                capture_output=True, text=True)
        if caught.returncode:
            raise RuntimeError(caught.stderr)
        rows = deltalake.DeltaTable(target).to_pyarrow_table(columns=["_key", "document"])
        table = {row["_key"]: json_util.loads(row["document"]) for row in rows.to_pylist()}
        same = table == {json_util.dumps(doc["_id"]): doc for doc in coll.find()}
        print(f"table equals the collection after catching up: {same}")
        client.close()


if __name__ == "__main__":
    main()
