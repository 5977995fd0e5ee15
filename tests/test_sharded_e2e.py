"""End to end on a simulated sharded cluster: consume and the CLI across a mongos failure.

Writes spread over both shards (hashed shard key); the mongos a reader uses is
killed mid-stream; every event must still arrive exactly once, in token order.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

import changestream
from changestream.stores import FileTokenStore, MemoryTokenStore
from changestream.testing import ShardedCluster

TOTAL = 120


@pytest.fixture
def cluster() -> Iterator[ShardedCluster]:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.1) as c:
        admin = pymongo.MongoClient(c.mongos_uri(0), directConnection=True)
        admin.admin.command("shardCollection", "e2e.c", key={"_id": "hashed"})
        admin.close()
        yield c


def _holder(cluster: ShardedCluster) -> int:
    """The mongos holding the (single) open change-stream cursor."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for i in range(2):
            if cluster.mongos(i).deployment.cursors.ids():
                return i
        time.sleep(0.02)
    raise AssertionError("no mongos holds a cursor")


def _shards_have_documents(cluster: ShardedCluster) -> bool:
    counts = []
    for rs in cluster.shards:
        state = rs.deployment.catalog.get("e2e", "c")
        counts.append(0 if state is None else len(state))
    return min(counts) > 0


def test_consume_delivers_every_event_once_in_order_across_a_killed_mongos(
    cluster: ShardedCluster,
) -> None:
    reader: pymongo.MongoClient[Any] = pymongo.MongoClient(
        cluster.uri, serverSelectionTimeoutMS=2000
    )
    coll = reader.e2e.c
    handled: list[Any] = []
    tokens: list[str] = []
    stop = threading.Event()

    def handler(change: Any) -> None:
        handled.append(change["documentKey"]["_id"])
        tokens.append(change["_id"]["_data"])
        if len(handled) == TOTAL:
            stop.set()

    def run() -> None:
        changestream.consume(
            lambda token: changestream.watch(coll, resume_after=token, max_await_time_ms=100),
            handler, MemoryTokenStore(), stop=stop, retry_for=60, backoff_initial=0.05,
        )  # fmt: skip

    consumer = threading.Thread(target=run, daemon=True)
    consumer.start()
    victim = _holder(cluster)
    survivor = pymongo.MongoClient(cluster.mongos_uri(1 - victim), directConnection=True)
    survivor.e2e.c.insert_many([{"_id": i} for i in range(TOTAL // 2)])
    deadline = time.monotonic() + 30
    while len(handled) < 10:
        assert time.monotonic() < deadline, "no events before the kill"
        time.sleep(0.02)
    cluster.kill_mongos(victim)
    survivor.e2e.c.insert_many([{"_id": i} for i in range(TOTAL // 2, TOTAL)])
    consumer.join(90)
    assert not consumer.is_alive(), f"consume did not finish: {len(handled)} of {TOTAL}"
    assert _shards_have_documents(cluster), "the writes spread over both shards"
    assert sorted(handled) == list(range(TOTAL)), "every event exactly once"
    assert tokens == sorted(tokens), "in resume-token order"
    survivor.close()
    reader.close()


def _cli(*args: str) -> tuple[subprocess.Popen[str], queue.Queue[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "changestream", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out: queue.Queue[str] = queue.Queue()
    err: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None
    threading.Thread(target=lambda: [out.put(x) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    threading.Thread(target=lambda: [err.append(x) for x in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
    deadline = time.monotonic() + 30
    while not any("watching" in line for line in err):
        assert proc.poll() is None, "".join(err)
        assert time.monotonic() < deadline, "".join(err)
        time.sleep(0.02)
    return proc, out, err


def _lines(out: queue.Queue[str], count: int) -> list[dict[str, Any]]:
    return [json.loads(out.get(timeout=30)) for _ in range(count)]


def test_cli_watch_restarts_against_the_other_mongos_from_its_token_file(
    cluster: ShardedCluster, tmp_path: Path
) -> None:
    token_file = tmp_path / "token.json"
    writer = pymongo.MongoClient(cluster.mongos_uri(1), directConnection=True)
    args = ("--db", "e2e", "--coll", "c", "--token-file", str(token_file), "--max-await-ms", "100")
    first, out, first_err = _cli("watch", cluster.mongos_uri(0), *args)
    try:
        writer.e2e.c.insert_many([{"_id": i} for i in range(4)])
        events = _lines(out, 4)
        seen = [e["documentKey"]["_id"] for e in events]
        deadline = time.monotonic() + 20  # the file follows each printed change
        while True:
            stored = FileTokenStore(token_file).load()
            if stored is not None and stored.token == events[-1]["_id"]:
                break
            assert time.monotonic() < deadline, f"token file not current: {stored}"
            time.sleep(0.02)
    finally:
        first.send_signal(signal.SIGINT)
        assert first.wait(30) == 0, "".join(first_err)
    final = FileTokenStore(token_file).load()
    assert final is not None
    cluster.kill_mongos(0)
    writer.e2e.c.insert_many([{"_id": i} for i in range(4, 8)])  # while nobody watches
    second, out, err = _cli("watch", cluster.mongos_uri(1), *args)
    try:
        assert "after the token in" in "".join(err)
        writer.e2e.c.insert_one({"_id": 8})
        seen += [e["documentKey"]["_id"] for e in _lines(out, 5)]
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    assert sorted(seen) == list(range(9)) and len(seen) == 9
    writer.close()
