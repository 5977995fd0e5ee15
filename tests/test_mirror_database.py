"""A whole database mirrored into one Delta table per collection, from one change stream.

Every table must equal its collection after concurrent writes to several
collections, with a collection created mid-run (copied while the stream goes
on), a drop (the table is emptied) and a rename (the target's table starts from
the renamed collection), on a replica set and on a sharded cluster, and across a
``kill -9`` of ``changestream mirror`` mid-run: each table's batch versions are
committed once each, 0..n without gaps.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

import changestream
from changestream.testing import ReplicaSet, ShardedCluster

deltalake = pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")

from delta_support import (  # noqa: E402
    assert_mirrors,
    committed_versions,
    plain_state,
    table_state,
    write_mix,
)

from changestream._token import ResumeToken  # noqa: E402
from changestream.delta import DatabaseDroppedError, DatabaseSink, DeltaSink  # noqa: E402


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replica_set:
        yield replica_set


@pytest.fixture
def db(rs: ReplicaSet) -> Iterator[Any]:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    name = f"d_{uuid.uuid4().hex[:8]}"
    yield client[name]
    client.drop_database(name)
    client.close()


def assert_tables(root: Path | str, db: Any, names: list[str], app_id: str) -> None:
    """Each named collection's table equals it (a dropped one: empty), versions 0..n once each."""
    for name in names:
        assert_mirrors(os.path.join(root, name), db[name], app_id)


def run_until_marker(sink: DatabaseSink, write: Any, marker: Any) -> None:
    """consume the database while ``write()`` runs; stop once the marker's insert is handled."""
    stop = threading.Event()
    failure: list[BaseException] = []
    end = f"end-{uuid.uuid4().hex[:6]}"

    def handle(change: Any) -> None:
        sink(change)
        if change.get("ns", {}).get("coll") == marker.name and \
                change.get("documentKey", {}).get("_id") == end:
            stop.set()

    def reader() -> None:
        try:
            changestream.consume(sink.open_stream, handle, sink, save_every=20, stop=stop)
        except BaseException as exc:  # the test fails with it below
            failure.append(exc)
            stop.set()

    sink.load()  # the copies of the collections already there start now
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        write()
        marker.insert_one({"_id": end})
        thread.join(120)
    finally:
        stop.set()
        thread.join(30)
    assert not failure, failure
    assert not thread.is_alive()
    sink.finish()  # waits for the copies, commits what they held, compacts


def test_every_table_equals_its_collection_after_concurrent_writes_create_drop_rename(
    db: Any, tmp_path: Path
) -> None:
    for name, count in (("a", 300), ("b", 120), ("gone", 50), ("old", 80)):
        db[name].insert_many([{"_id": i, "v": name} for i in range(count)])
    sink = DatabaseSink(tmp_path, db, app_id="m", full_document="updateLookup",
                        copy_batch_size=40, watch_options={"max_await_time_ms": 50})

    def write() -> None:
        writers = [threading.Thread(target=write_mix, args=(db[name], 150, seed))
                   for seed, name in enumerate(("a", "b", "later"))]  # "later": created mid-run
        for writer in writers:
            writer.start()
        db.gone.drop()
        db.old.rename("new")
        db.new.update_one({"_id": 1}, {"$set": {"after": "rename"}})
        for writer in writers:
            writer.join()

    run_until_marker(sink, write, db.zz_end)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "gone", "later", "new", "old", "zz_end"]
    assert_tables(tmp_path, db, ["a", "b", "gone", "later", "new", "old"], "m")
    assert table_state(tmp_path / "gone") == {} and table_state(tmp_path / "old") == {}
    assert table_state(tmp_path / "new")[1]["after"] == "rename"
    # finish() compacted every table: read plainly, each is its collection.
    assert plain_state(tmp_path / "a") == {doc["_id"]: doc for doc in db.a.find()}


def test_a_restart_opens_at_the_oldest_table_and_applies_each_change_once(
    db: Any, tmp_path: Path
) -> None:
    """Tables at different positions: the stream opens at the oldest; one ahead skips what it holds."""
    db.a.insert_many([{"_id": i, "v": 0} for i in range(20)])
    db.b.insert_many([{"_id": i, "v": 0} for i in range(20)])
    sink = DatabaseSink(tmp_path, db, app_id="m", full_document="updateLookup",
                        watch_options={"max_await_time_ms": 50})
    run_until_marker(sink, lambda: None, db.zz_end)
    db.a.update_many({}, {"$inc": {"v": 1}})
    db.b.update_many({}, {"$inc": {"v": 1}})
    # "a" alone moves on (a sink of that one table): "b" stays behind it.
    only_a = DatabaseSink(tmp_path, db, app_id="m", full_document="updateLookup",
                          include=lambda name: name == "a",
                          watch_options={"max_await_time_ms": 50})
    run_until_marker(only_a, lambda: None, db.a)
    a_versions = committed_versions(tmp_path / "a", "m")
    stored_b = DeltaSink(tmp_path / "b", app_id="m").load()
    stored_a = DeltaSink(tmp_path / "a", app_id="m").load()
    assert stored_a is not None and stored_b is not None
    assert ResumeToken.of(stored_b.token) < ResumeToken.of(stored_a.token)
    db.a.update_many({}, {"$inc": {"v": 10}})
    both = DatabaseSink(tmp_path, db, app_id="m", full_document="updateLookup",
                        watch_options={"max_await_time_ms": 50})
    start = both.load()
    assert start is not None and start.token == stored_b.token  # the oldest table's
    run_until_marker(both, lambda: None, db.zz_end)
    assert_tables(tmp_path, db, ["a", "b"], "m")
    assert {doc["v"] for doc in table_state(tmp_path / "a").values() if not isinstance(doc["_id"], str)} == {11}
    assert len(committed_versions(tmp_path / "a", "m")) > len(a_versions)


def test_a_dropped_database_ends_the_run_with_its_tables_emptied(db: Any, tmp_path: Path) -> None:
    db.a.insert_many([{"_id": i} for i in range(5)])
    db.b.insert_many([{"_id": i} for i in range(5)])
    sink = DatabaseSink(tmp_path, db, app_id="m", full_document="updateLookup",
                        watch_options={"max_await_time_ms": 50})
    sink.load()
    sink.finish()  # the copies are in
    assert len(table_state(tmp_path / "a")) == 5
    threading.Timer(0.3, lambda: db.client.drop_database(db.name)).start()
    with pytest.raises(DatabaseDroppedError, match=f"the database {db.name} was dropped"):
        changestream.consume(sink.open_stream, sink, sink, save_every=1)
    assert table_state(tmp_path / "a") == {} and table_state(tmp_path / "b") == {}


def test_the_database_mirror_on_a_sharded_cluster(tmp_path: Path) -> None:
    # One mongos: a copy's getMore must reach the mongos that holds its cursor, and
    # Database.command (the snapshot copy's transport) does not pin one (see the report).
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.1) as cluster:
        client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(cluster.uri)
        client.admin.command("shardCollection", "m.spread", key={"_id": "hashed"})
        db = client.m
        db.spread.insert_many([{"_id": i, "v": "before"} for i in range(60)])
        db.plain.insert_many([{"_id": i, "v": "before"} for i in range(30)])
        sink = DatabaseSink(tmp_path, db, app_id="s", full_document="updateLookup",
                            copy_batch_size=25, watch_options={"max_await_time_ms": 50})

        def write() -> None:
            writers = [threading.Thread(target=write_mix, args=(db[name], 120, seed),
                                        kwargs={"transactions": False})
                       for seed, name in enumerate(("spread", "plain", "later"))]
            for writer in writers:
                writer.start()
            for writer in writers:
                writer.join()
            db.plain.drop()

        run_until_marker(sink, write, db.zz_end)
        assert_tables(tmp_path, db, ["spread", "plain", "later"], "s")
        assert table_state(tmp_path / "plain") == {}
        client.close()


# -- the command ---------------------------------------------------------------------------
def mirror(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def versions_or_empty(path: Path, app_id: str) -> list[int]:
    try:
        return committed_versions(path, app_id)
    except Exception:  # not a table yet
        return []


def test_mirror_a_database_survives_kill_9_and_keeps_every_table_exactly_once(
    rs: ReplicaSet, db: Any, tmp_path: Path
) -> None:
    for name in ("a", "b"):
        db[name].insert_many([{"_id": i, "v": "before"} for i in range(150)])
    db.skip_me.insert_one({"_id": 1})
    args = [rs.uri, "--db", db.name, "--to", str(tmp_path), "--batch", "15",
            "--batch-seconds", "0.2", "--exclude", "skip_.*"]
    first = mirror(*args)

    def write() -> None:
        writers = [threading.Thread(target=write_mix, args=(db[name], 300, seed))
                   for seed, name in enumerate(("a", "b", "c"))]
        for writer in writers:
            writer.start()
        db.b.rename("b2")
        for writer in writers:
            writer.join()

    try:
        deadline = time.monotonic() + 60
        while not versions_or_empty(tmp_path / "a", "changestream-mirror"):
            assert time.monotonic() < deadline and first.poll() is None, first.stderr
            time.sleep(0.05)
        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(random.Random(5).uniform(0.3, 1.0))
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        writer.join(120)
    finally:
        first.kill()
        first.communicate()
    second = mirror(*args, "--until-idle", "1")
    _out, err = second.communicate(timeout=180)
    assert second.returncode == 0, err
    assert "from their last commit" in err
    assert "skip_me" not in os.listdir(tmp_path)
    assert_tables(tmp_path, db, ["a", "b", "b2", "c"], "changestream-mirror")
    assert plain_state(tmp_path / "b2") == {doc["_id"]: doc for doc in db.b2.find()}


def test_a_database_sink_refuses_history_and_uris(tmp_path: Path) -> None:
    """One history for every collection, or a URI it cannot list: one clear error each."""
    with pytest.raises(ValueError, match="one history table for every collection"):
        DatabaseSink(tmp_path, object(), history=tmp_path / "h")
    with pytest.raises(ValueError, match="is a URI; a whole database is mirrored into a local"):
        DatabaseSink("s3://bucket/shop", object())
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize(("extra", "says"), [
    (["--coll", "c", "--exclude", "x"], "leave out --coll"),
    (["--coll-regex", "("], "--coll-regex: not a regular expression"),
    (["--schema", "a INT"], "--schema types one collection's documents: give --coll"),
    (["--verify"], "--verify works on one collection's table: give --coll"),
    (["--history", "/tmp/h"], "--history works on one collection's table: give --coll"),
    (["--on-history-lost", "resnapshot"],
     "--on-history-lost resnapshot works on one collection's table: give --coll"),
    (["--snapshot-readers", "1"], "--snapshot-readers works on one collection's table"),
    (["--resnapshot"], "--resnapshot works on one collection's table: give --coll"),
    (["--resnapshot-chunk", "10000"], "--resnapshot-chunk works on one collection's table"),
])
def test_mirror_a_database_bad_arguments_exit_2_with_one_line(
    tmp_path: Path, extra: list[str], says: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "changestream", "mirror", "mongodb://localhost:1", "--db", "d",
         "--to", str(tmp_path / "t"), *extra], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr.strip().splitlines()[-1]


# -- Spark's foreachBatch path: a batch routed by collection (as Arrow, no JVM) ---------------
def change_rows(events: list[Any]) -> Any:
    """Change events as the Spark paths' rows (the columns the Delta writers read), in Arrow."""
    import pyarrow as pa
    from bson import json_util

    def text(value: Any) -> str | None:
        return None if value is None else json_util.dumps(
            value, json_options=json_util.RELAXED_JSON_OPTIONS)

    return pa.table({
        "resume_token": [e["_id"]["_data"] for e in events],
        "operation_type": [e["operationType"] for e in events],
        "database": [e.get("ns", {}).get("db") for e in events],
        "collection": [e.get("ns", {}).get("coll") for e in events],
        "document_key": [text(e.get("documentKey")) for e in events],
        "full_document": [text(e.get("fullDocument")) for e in events],
    })


def test_merge_into_tables_routes_each_batch_by_collection_once(db: Any, tmp_path: Path) -> None:
    pytest.importorskip("pyspark", reason="the Spark adapter needs pyspark (no JVM is started)")
    from changestream.spark_adapter import merge_into_tables

    with changestream.watch(db, full_document="updateLookup", max_await_time_ms=50) as stream:
        for seed, name in enumerate(("a", "b", "c")):
            write_mix(db[name], 80, seed)
        db.c.drop()
        db.a.insert_one({"_id": "last"})
        events: list[Any] = []
        while not events or events[-1].get("documentKey", {}).get("_id") != "last":
            change = stream.try_next()
            if change is not None:
                events.append(change)
    func = merge_into_tables(str(tmp_path), app_id="spark", full_document="updateLookup",
                             include=lambda name: name != "b")
    half = len(events) // 2
    func(change_rows(events[:half]), 0)
    func(change_rows(events[half:]), 1)
    func(change_rows(events[half:]), 1)  # Spark runs a batch again: every table skips it
    assert sorted(os.listdir(tmp_path)) == ["a", "c"]
    for name in ("a", "c"):
        assert table_state(tmp_path / name) == {d["_id"]: d for d in db[name].find()}
        versions = committed_versions(tmp_path / name, "spark")  # the batch ids touching it
        assert versions == sorted(set(versions)) and versions[-1] == 1, versions
    assert committed_versions(tmp_path / "a", "spark") == [0, 1]
    assert func.sinks["a"].skipped == 1 and func.sinks["c"].skipped == 1
    for name in ("a", "c"):  # each table's position: its collection's last event
        last = [e for e in events if e.get("ns", {}).get("coll") == name][-1]
        stored = DeltaSink(str(tmp_path / name), app_id="spark").load()
        assert stored is not None and stored.token["_data"] == last["_id"]["_data"], name



class Crash(Exception):
    """The process dies here (before or after a table's commit)."""


class CrashingSink:
    """A table sink that dies at the ``at``-th save of a run (counted over every table)."""

    def __init__(self, sink: DeltaSink, counter: list[int], at: int, after: bool) -> None:
        self.sink, self.path, self.counter, self.at, self.after = sink, sink.path, counter, at, after

    def __call__(self, change: Any) -> None:
        self.sink(change)

    def load(self) -> Any:
        return self.sink.load()

    def finish(self) -> Any:
        return self.sink.finish()

    def batch_full(self) -> bool:
        return self.sink.batch_full()

    def save(self, token: Any, *, batch_id: int | None = None) -> None:
        self.counter[0] += 1
        if self.counter[0] == self.at and not self.after:
            raise Crash(f"died before save {self.at}")
        self.sink.save(token, batch_id=batch_id)
        if self.counter[0] == self.at:
            raise Crash(f"died after save {self.at}")


@pytest.mark.parametrize("after", [False, True], ids=["before-commit", "after-commit"])
def test_a_crash_at_any_commit_around_a_rename_and_a_new_collection_resumes_exactly_once(
    db: Any, tmp_path: Path, after: bool
) -> None:
    """Each save of the run (the target's emptying, its copy, the source's emptying, the
    stream's batches) is a place the process may die: the next run ends with every table
    equal to its collection, each version committed once."""
    from changestream._delta_database import DatabaseTables

    options = {"app_id": "m", "full_document": "updateLookup"}
    db.x.insert_many([{"_id": i, "v": "x"} for i in range(30)])
    db.y.insert_many([{"_id": i, "v": "y"} for i in range(100, 140)])
    first = DatabaseSink(tmp_path, db, **options)  # type: ignore[arg-type]
    first.load()
    first.finish()
    db.y.update_one({"_id": 100}, {"$set": {"w": 1}})
    db.x.rename("y", dropTarget=True)
    db.y.update_many({}, {"$set": {"w": 2}})
    db.z.insert_many([{"_id": i} for i in range(25)])
    db.x.insert_one({"_id": "again"})
    for crash_at in range(1, 40):
        root = tmp_path / f"run{crash_at}"
        shutil.copytree(tmp_path, root, ignore=shutil.ignore_patterns("run*"))
        counter = [0]

        def sink_for(path: str, counter: list[int] = counter, at: int = crash_at) -> Any:
            return CrashingSink(DeltaSink(path, **options), counter, at, after)  # type: ignore[arg-type]

        crashing = DatabaseTables(
            root, db, sink_for,
            watch_options={"full_document": "updateLookup", "max_await_time_ms": 50},
            copy_batch_size=10)
        try:
            run_until_marker(crashing, lambda: None, db.marker)  # type: ignore[arg-type]
        except (AssertionError, Crash):
            pass
        finally:
            crashing.close()
        if counter[0] < crash_at:
            break  # the run made fewer saves: every place was tried
        again = DatabaseSink(root, db, watch_options={"max_await_time_ms": 50}, **options)  # type: ignore[arg-type]
        run_until_marker(again, lambda: None, db.marker)
        assert_tables(root, db, ["x", "y", "z"], "m")
    print(f"{crash_at - 1} crash points tried")
    assert crash_at > 5
