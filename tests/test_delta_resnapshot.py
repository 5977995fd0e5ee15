"""Re-snapshot while streaming (DBLog watermarks) and the parallel first copy, under concurrent
writes and ``kill -9``: the table equals the collection, each batch applied once."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

pytest.importorskip("deltalake", reason="the delta extra is not installed")

import deltalake
from delta_support import assert_mirrors, table_state

from changestream import consume
from changestream._delta_resnapshot import STATE, DeltaResnapshot, bson_order_key
from changestream.delta import DeltaSink
from changestream.testing import ReplicaSet


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replica_set:
        yield replica_set


@pytest.fixture
def client(rs: ReplicaSet) -> Iterator[MongoClient[dict[str, Any]]]:
    with MongoClient(rs.uri) as mongo:
        yield mongo


def churn(coll: Any, keys: int, stop: threading.Event, seed: int) -> threading.Thread:
    """Inserts, updates and deletes over the whole key range until ``stop``."""
    rnd = random.Random(seed)

    def run() -> None:
        n = 0
        while not stop.is_set():
            key, roll, n = rnd.randrange(keys + keys // 10), rnd.random(), n + 1
            if roll < 0.2:
                coll.delete_one({"_id": key})
            elif roll < 0.6:
                coll.update_one({"_id": key}, {"$set": {"w": n}}, upsert=True)
            else:
                coll.replace_one({"_id": key}, {"_id": key, "r": n}, upsert=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_for(condition: Callable[[], bool], what: str | Callable[[], str],
             timeout: float = 120) -> None:
    """Wait for ``condition``; ``what`` (or what it returns: the state then) names it on a timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what if isinstance(what, str) else what()}")
        time.sleep(0.05)


def committed_progress(path: Path | str) -> dict[str, Any] | None:
    for commit in deltalake.DeltaTable(str(path)).history(200):
        if STATE in commit:
            return dict(json.loads(commit[STATE]))
    return None


def vandalise(path: Path, coll: Any) -> None:
    """Make the table wrong behind the mirror's back: a phantom row, a lost row, a stale one."""
    keys = [doc["_id"] for doc in coll.find({}, {"_id": 1}).sort("_id", 1).limit(3)]
    other = DeltaSink(str(path), app_id="vandal")
    other.write([
        {"_id": {"_data": "82" + "00" * 20}, "operationType": "insert", "ns": {"db": "db", "coll": coll.name},
         "documentKey": {"_id": 10**9}, "fullDocument": {"_id": 10**9, "phantom": True}},
        {"_id": {"_data": "82" + "00" * 19 + "03"}, "operationType": "insert",
         "ns": {"db": "db", "coll": coll.name},  # a phantom inside a middle chunk's range
         "documentKey": {"_id": 2500.5}, "fullDocument": {"_id": 2500.5, "phantom": True}},
        {"_id": {"_data": "82" + "00" * 19 + "01"}, "operationType": "delete", "ns": {"db": "db", "coll": coll.name},
         "documentKey": {"_id": keys[0]}},
        {"_id": {"_data": "82" + "00" * 19 + "02"}, "operationType": "replace",
         "ns": {"db": "db", "coll": coll.name},
         "documentKey": {"_id": keys[1]}, "fullDocument": {"_id": keys[1], "stale": True}},
    ], 0)


def test_resnapshot_under_concurrent_writes_makes_the_table_equal_the_collection(
    client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """Chunks between watermarks while inserts, updates and deletes go on: rows the stream
    changed meanwhile are left to it, deleted documents are removed, wrong rows fixed."""
    coll = client.db.resnap
    coll.insert_many([{"_id": i, "v": i, "pad": "x" * 50} for i in range(6000)])
    path = tmp_path / "t"
    sink = DeltaSink(str(path), full_document="updateLookup")
    mirror = DeltaResnapshot(sink, coll, chunk_size=700, poll_seconds=0.2)
    stop_mirror = threading.Event()
    runner = threading.Thread(target=consume, args=(coll, mirror, mirror), kwargs={
        "initial_snapshot": True, "watch_options": {"full_document": "updateLookup",
                                                    "max_await_time_ms": 100},
        "save_every": 300, "save_interval": 0.2, "stop": stop_mirror}, daemon=True)
    runner.start()
    wait_for(lambda: sink.applied_version is not None and sink.load() is not None
             and sink.load().token.get("phase") != "copy", "the first copy")  # type: ignore[union-attr]
    vandalise(path, coll)
    stop_writes = threading.Event()
    writer = churn(coll, 6000, stop_writes, seed=7)
    try:
        version = sink.request_snapshot()
        wait_for(lambda: mirror.progress.request == version and not mirror.progress.active,
                 "the re-snapshot")
    finally:
        stop_writes.set()
        writer.join()
    last = coll.insert_one({"_id": "end"}).inserted_id
    wait_for(lambda: last in table_state(path), "the stream to catch up")
    stop_mirror.set()
    runner.join(60)
    progress = mirror.progress
    assert progress.chunks >= 8 and progress.keys >= 5000
    assert progress.dropped > 0, "no chunk row met a stream change: the test writes too little"
    assert progress.deleted >= 2  # the phantom rows at least
    assert committed_progress(path) == json.loads(progress.text())
    assert_mirrors(path, coll, "changestream")


def test_a_chunk_row_never_overwrites_a_newer_change(
    client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """The watermark itself: a key updated after the chunk was read keeps the update."""
    coll = client.db.newer
    coll.insert_many([{"_id": i, "v": 0} for i in range(50)])
    path = tmp_path / "t"
    sink = DeltaSink(str(path), full_document="updateLookup")
    mirror = DeltaResnapshot(sink, coll, chunk_size=100, poll_seconds=0)
    consume(coll, mirror, mirror, initial_snapshot=True, save_every=1000,
            watch_options={"max_await_time_ms": 50, "full_document": "updateLookup"}, stop=_after_idle(mirror))
    sink.request_snapshot()
    token = sink.load().token  # type: ignore[union-attr]
    mirror.save(token)  # takes the request up and reads the chunk (v: 0 everywhere)
    assert mirror.progress.active
    with coll.watch(resume_after=token, full_document="updateLookup") as stream:
        coll.update_one({"_id": 3}, {"$set": {"v": 1}})  # after the chunk's read time
        coll.delete_one({"_id": 4})
        mirror(stream.next())  # past the read time (the high mark): the chunk is applied
        assert not mirror.progress.active and mirror.progress.dropped == 1  # at once, no save
        mirror(stream.next())  # the delete, after the chunk: it removes the chunk's row
        mirror.save(stream.resume_token)
    assert table_state(path)[3] == {"_id": 3, "v": 1}
    assert 4 not in table_state(path)
    assert_mirrors(path, coll, "changestream")


def test_history_as_of_after_a_resnapshot_has_one_row_per_key(
    client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """A chunk's rows in the history carry its read time (``valid_from``): as of any later
    time each key has one row, a key changed after the chunk its newest version."""
    from datetime import datetime, timezone

    from bson import json_util

    coll = client.db.history
    coll.insert_many([{"_id": i, "v": 0} for i in range(20)])
    path = tmp_path / "t"
    sink = DeltaSink(str(path), full_document="updateLookup", history=str(tmp_path / "h"))
    mirror = DeltaResnapshot(sink, coll, chunk_size=100, poll_seconds=0)
    consume(coll, mirror, mirror, initial_snapshot=True, save_every=1000,
            watch_options={"max_await_time_ms": 50, "full_document": "updateLookup"},
            stop=_after_idle(mirror))
    sink.request_snapshot()
    token = sink.load().token  # type: ignore[union-attr]
    mirror.save(token)  # reads the chunk
    with coll.watch(resume_after=token, full_document="updateLookup") as stream:
        coll.update_one({"_id": 3}, {"$set": {"v": 1}})
        mirror(stream.next())
        mirror.save(stream.resume_token)  # the chunk applied (3 dropped: in the window)
        assert not mirror.progress.active and mirror.progress.applied == 19
        coll.update_one({"_id": 5}, {"$set": {"v": 2}})  # after the chunk's row of 5
        mirror(stream.next())
        mirror.save(stream.resume_token)
    history = sink.read_history()
    assert history.column("valid_from").null_count == 0
    rows = sink.read_as_of(datetime(2100, 1, 1, tzinfo=timezone.utc)).to_pylist()
    found = {json_util.loads(r["_key"]): json_util.loads(r["document"]) for r in rows}
    assert len(found) == len(rows), "a key twice as of now"
    assert found == {d["_id"]: d for d in coll.find()}
    assert found[5] == {"_id": 5, "v": 2}


def test_a_recopy_during_a_resnapshot_drops_its_pending_chunk(
    client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """A copy after a lost history while a chunk waits: the chunk is read again after the copy
    (its window does not collect the copy's every key, which would drop the whole chunk)."""
    coll = client.db.recopy_during
    coll.insert_many([{"_id": i, "v": 0} for i in range(50)])
    path = tmp_path / "t"
    sink = DeltaSink(str(path), full_document="updateLookup")
    mirror = DeltaResnapshot(sink, coll, chunk_size=100, poll_seconds=0)
    consume(coll, mirror, mirror, initial_snapshot=True, save_every=1000,
            watch_options={"max_await_time_ms": 50, "full_document": "updateLookup"},
            stop=_after_idle(mirror))
    sink.request_snapshot()
    token = sink.load().token  # type: ignore[union-attr]
    mirror.save(token)  # takes the request up and reads the chunk
    assert mirror.progress.active
    at = client.admin.command("ping")["operationTime"]
    position = {"_data": "snapshot", "phase": "copy", "at": at}
    for doc in coll.find().sort("_id", 1):  # the recopy's records and their position
        mirror({"_id": {**position, "lastId": doc["_id"]}, "operationType": "insert",
                "ns": {"db": "db", "coll": coll.name}, "documentKey": {"_id": doc["_id"]},
                "fullDocument": doc})
    mirror.save({**position, "lastId": 49})
    with coll.watch(resume_after=token, full_document="updateLookup") as stream:
        for key in (3, 4):  # each save past the last read time: a chunk read, then applied
            coll.update_one({"_id": key}, {"$set": {"v": key}})
            mirror(stream.next())
            mirror.save(stream.resume_token)
    assert not mirror.progress.active
    assert mirror.progress.dropped <= 1, mirror.progress
    assert mirror.progress.applied >= 49
    assert table_state(path) == {doc["_id"]: doc for doc in coll.find()}


def _after_idle(mirror: DeltaResnapshot) -> threading.Event:
    """A stop event set once the stream is idle and no re-snapshot runs (a watcher thread)."""
    stop = threading.Event()
    sink = mirror.sink

    def watch() -> None:
        seen, quiet = -2, 0
        while quiet < 10:
            time.sleep(0.1)
            version = sink.applied_version if isinstance(sink, DeltaSink) else None
            now = -1 if version is None else version
            quiet = quiet + 1 if now == seen and not mirror.progress.active else 0
            seen = now
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    return stop


@pytest.mark.parametrize(("docs", "chunk"), [
    (4000, 200),  # 20 chunks, killed after 5: the default suite's run
    pytest.param(20000, 500, marks=pytest.mark.slow),  # 40 chunks under longer churn: volume
])
def test_kill_9_mid_resnapshot_then_restart_applies_each_chunk_once(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path, docs: int, chunk: int
) -> None:
    coll = client.db[f"killed{docs}"]
    coll.insert_many([{"_id": i, "v": i, "pad": "y" * 100} for i in range(docs)])
    target = str(tmp_path / "t")
    args = [sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "db", "--coll",
            coll.name, "--to", target, "--no-status", "--resnapshot-chunk", str(chunk),
            "--batch-seconds", "0.2"]
    first = subprocess.run([*args, "--until-idle", "0.3"], capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    stop_writes = threading.Event()
    writer = churn(coll, docs, stop_writes, seed=3)
    running = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        asked = subprocess.run([*args, "--resnapshot"], capture_output=True, text=True,
                               timeout=60)
        assert asked.returncode == 0, asked.stderr
        wait_for(lambda: (committed_progress(target) or {}).get("chunks", 0) >= 5,
                 "some chunks applied")
        running.send_signal(signal.SIGKILL)
        running.wait(30)
        killed_at = committed_progress(target)
        assert killed_at is not None and killed_at["active"], killed_at
    finally:
        if running.poll() is None:
            running.kill()
        stop_writes.set()
        writer.join()
    again = subprocess.run([*args, "--until-idle", "0.5"], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    done = committed_progress(target)
    assert done is not None and not done["active"] and done["chunks"] >= docs * 0.88 // chunk, done
    assert done["keys"] >= docs * 0.85
    assert_mirrors(target, coll, "changestream-mirror")


def test_bson_order_key_orders_mixed_ids_as_mongod() -> None:
    from bson.objectid import ObjectId

    values = [ObjectId("0" * 24), "b", "a", 2.5, 1, None, {"a": 1}, [1], True]
    ordered = sorted(values, key=bson_order_key)
    assert ordered == [None, 1, 2.5, "a", "b", {"a": 1}, [1], ObjectId("0" * 24), True]


@pytest.mark.parametrize("readers", [4])
def test_parallel_first_copy_under_concurrent_writes_has_no_gap_and_no_duplicate(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path, readers: int
) -> None:
    """Ranges read at one cluster time, committed in _id order; writes during the copy come
    by the stream that starts after that time: each key once, none missing."""
    from delta_support import plain_state

    from changestream._parallel_copy import parallel_copy

    coll = client.db[f"par{readers}"]
    coll.insert_many([{"_id": i, "v": i} for i in range(8000)])
    target = tmp_path / "t"
    stop_writes = threading.Event()
    writer = churn(coll, 8000, stop_writes, seed=11)
    try:
        sink = DeltaSink(str(target), full_document="updateLookup")
        result = parallel_copy(coll, sink, readers=readers, batch=1000)
    finally:
        stop_writes.set()
        writer.join()
    assert result.ranges > readers and result.commits >= 8
    copied = table_state(target)
    assert len(copied) == result.documents  # no duplicate among the ranges
    args = [sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "db", "--coll",
            coll.name, "--to", str(target), "--no-status", "--until-idle", "0.3",
            "--snapshot-readers", str(readers), "--app-id", "changestream"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert_mirrors(target, coll, "changestream")  # (the sink's default app id, as above)
    assert plain_state(target) == {doc["_id"]: doc for doc in coll.find()}


def test_parallel_copy_past_the_snapshot_history_goes_on_with_one_reader(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    """A parallel copy stopped mid-way, restarted after the server dropped its cluster time
    (SnapshotTooOld): it stops after its committed prefix and one reader copies the rest."""
    from changestream._parallel_copy import parallel_copy

    coll = client.db.too_old
    coll.insert_many([{"_id": i, "v": i} for i in range(3000)])
    target = tmp_path / "t"
    sink = DeltaSink(str(target), full_document="updateLookup")

    class Killed(Exception):
        pass

    class Dies:  # the sink of a process killed after two commits
        def __init__(self) -> None:
            self.saves = 0

        def __call__(self, change: Any) -> None:
            sink(change)

        def load(self) -> Any:
            return sink.load()

        def save(self, token: Any, *, batch_id: int | None = None) -> None:
            if self.saves == 2:
                raise Killed
            self.saves += 1
            sink.save(token, batch_id=batch_id)

    with pytest.raises(Killed):
        parallel_copy(coll, Dies(), readers=3, batch=500)
    admin = client.admin
    admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 1})
    try:
        time.sleep(2.2)  # the history window (1 s, in whole seconds) passes the copy's time
        coll.insert_one({"_id": "later"})  # a write prunes what is older than the window
        again = DeltaSink(str(target), full_document="updateLookup")
        result = parallel_copy(coll, again, readers=3, batch=500)
    finally:
        admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 300})
    assert result.too_old and result.commits == 0
    args = [sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "db", "--coll",
            coll.name, "--to", str(target), "--no-status", "--until-idle", "0.3",
            "--snapshot-readers", "3", "--app-id", "changestream"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "SnapshotTooOld" in done.stderr and "one reader" in done.stderr
    assert_mirrors(target, coll, "changestream")


def test_mirror_snapshot_readers_end_to_end(
    rs: ReplicaSet, client: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    coll = client.db.par_cli
    coll.insert_many([{"_id": i, "s": str(i)} for i in range(5000)])
    coll.insert_many([{"_id": f"k{i}"} for i in range(500)])  # a second type: ranges across it
    target = str(tmp_path / "t")
    args = [sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "db", "--coll",
            "par_cli", "--to", target, "--no-status", "--until-idle", "0.3",
            "--snapshot-readers", "3", "--batch", "400"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "with 3 readers" in done.stderr
    assert_mirrors(target, coll, "changestream-mirror")


def test_resnapshot_of_a_missing_table_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "changestream", "mirror", "mongodb://127.0.0.1:1", "--db", "d",
         "--coll", "c", "--to", str(tmp_path / "none"), "--resnapshot"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "no Delta table at" in done.stderr and "Traceback" not in done.stderr


def test_a_request_returns_its_own_version_while_the_mirror_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The running mirror commits every few seconds: a commit landing right after the
    request's must not be taken for it (the caller waits for the request by its version;
    the mirror then never reports that version done)."""
    import pyarrow as pa

    import changestream._delta_resnapshot as resnapshot

    path = str(tmp_path / "t")
    deltalake.write_deltalake(path, pa.table({"_key": ["1"]}))
    real = resnapshot.write_deltalake

    def then_the_mirrors_commit(table: Any, data: Any, **options: Any) -> None:
        real(table, data, **options)
        deltalake.write_deltalake(path, pa.table({"_key": ["2"]}), mode="append")

    monkeypatch.setattr(resnapshot, "write_deltalake", then_the_mirrors_commit)
    version = DeltaSink(path).request_snapshot()
    history = {entry["version"]: entry for entry in deltalake.DeltaTable(path).history()}
    assert resnapshot.REQUEST in history[version], (version, history)
    assert max(history) == version + 1


def test_snapshot_readers_must_be_positive(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "changestream", "mirror", "mongodb://127.0.0.1:1", "--db", "d",
         "--coll", "c", "--to", str(tmp_path / "t"), "--snapshot-readers", "0"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--snapshot-readers" in done.stderr


def test_parallel_copy_and_resnapshot_through_mongos(tmp_path: Path) -> None:
    """On the sharded simulator: snapshot reads at one cluster time through mongos, then a
    re-snapshot; the table equals the collection."""
    from changestream._parallel_copy import parallel_copy
    from changestream.testing import ShardedCluster

    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.1) as cluster, \
            MongoClient(cluster.uri) as mongo:
        mongo.admin.command("enableSharding", "s")
        mongo.admin.command("shardCollection", "s.c", key={"_id": "hashed"})
        coll = mongo.s.c
        coll.insert_many([{"_id": i, "v": i} for i in range(3000)])
        path = tmp_path / "t"
        sink = DeltaSink(str(path), full_document="updateLookup")
        result = parallel_copy(coll, sink, readers=3, batch=500)
        assert result.documents == 3000
        mirror = DeltaResnapshot(sink, coll, chunk_size=400, poll_seconds=0)
        stop = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                consume(coll, mirror, mirror, initial_snapshot=True, save_interval=0.2, stop=stop,
                        watch_options={"full_document": "updateLookup", "max_await_time_ms": 100})
            except BaseException as exc:  # shown by the wait below, not lost in the thread
                failed.append(exc)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        try:
            coll.delete_many({"_id": {"$lt": 100}})
            version = sink.request_snapshot()
            coll.update_many({"_id": {"$gte": 2900}}, {"$set": {"late": True}})
            wait_for(lambda: bool(failed) or (mirror.progress.request == version
                     and not mirror.progress.active),
                     lambda: f"the re-snapshot of request {version}: {mirror.progress}, "
                             f"committed {committed_progress(path)}")
            assert not failed, f"consume stopped: {failed[0]!r}"
            wait_for(lambda: table_state(path) == {d["_id"]: d for d in coll.find()},
                     "the table to equal the collection")
        finally:
            stop.set()
            runner.join(60)
        assert mirror.progress.chunks >= 8
        assert_mirrors(path, coll, "changestream")


def test_parallel_copy_follows_the_chunks_of_a_range_sharded_collection(tmp_path: Path) -> None:
    """``_id`` range-sharded into six chunks over two shards (``split``, ``moveChunk``): the
    ranges are the chunks, and four readers under concurrent writes, then ``mirror
    --snapshot-readers 4``, leave the table equal to the collection, each key once."""
    from delta_support import plain_state

    from changestream._parallel_copy import parallel_copy, split_points
    from changestream.testing import ShardedCluster

    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.1) as cluster, \
            MongoClient(cluster.uri) as mongo:
        admin = mongo.admin
        admin.command("shardCollection", "s.r", key={"_id": 1})
        coll = mongo.s.r
        coll.insert_many([{"_id": i, "v": i} for i in range(6000)])
        admin.command("split", "s.r", middle={"_id": 3000})
        for find in (0, 3000, 0, 3000):  # the median of the chunk holding it, twice per half
            admin.command("split", "s.r", find={"_id": find})
        bounds = [c["min"]["_id"] for c in mongo.config.chunks.find({})]
        bounds = sorted(b for b in bounds if isinstance(b, int))
        assert len(bounds) == 5
        for i, low in enumerate(bounds):
            admin.command("moveChunk", "s.r", find={"_id": low}, to=cluster.shard_names[i % 2])
        shards = {c["shard"] for c in mongo.config.chunks.find({})}
        assert shards == set(cluster.shard_names)
        assert split_points(coll, 16) == bounds  # the ranges follow the chunks
        target = tmp_path / "t"
        stop_writes = threading.Event()
        writer = churn(coll, 6000, stop_writes, seed=5)
        try:
            sink = DeltaSink(str(target), full_document="updateLookup")
            result = parallel_copy(coll, sink, readers=4, batch=500)
        finally:
            stop_writes.set()
            writer.join()
        assert result.ranges == len(bounds) + 1
        assert len(table_state(target)) == result.documents  # no key twice among the ranges
        at_t = mongo.s.command({"aggregate": "r", "pipeline": [{"$project": {"_id": 1}}],
                                "cursor": {"batchSize": 100_000},
                                "readConcern": {"level": "snapshot", "atClusterTime": result.at}})
        assert set(table_state(target)) == {d["_id"] for d in at_t["cursor"]["firstBatch"]}
        args = [sys.executable, "-m", "changestream", "mirror", cluster.uri, "--db", "s",
                "--coll", "r", "--to", str(target), "--no-status", "--until-idle", "0.3",
                "--snapshot-readers", "4", "--app-id", "changestream"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert plain_state(target) == {doc["_id"]: doc for doc in coll.find()}
        assert_mirrors(target, coll, "changestream")
