"""Merge-ready batches and the exactly-once Delta Lake sink, read back with deltalake.

The table must equal the collection (every key's last version, no deleted key
left) after concurrent inserts, updates, deletes, re-inserts and a
transaction, across a ``kill -9`` of ``changestream mirror`` mid-batch, on a
replica set and on a sharded cluster; each batch version is committed once.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

import changestream
from changestream.testing import ReplicaSet, ShardedCluster

deltalake = pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")
pa = pytest.importorskip("pyarrow", reason="needs pyarrow (the 'delta' extra)")

from delta_support import assert_mirrors, committed_versions, table_state, write_mix  # noqa: E402

from changestream.delta import DeltaSink, DocumentSchemaError  # noqa: E402


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replica_set:
        yield replica_set


@pytest.fixture
def coll(rs: ReplicaSet) -> Iterator[Any]:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    name = f"t_{uuid.uuid4().hex[:8]}"
    yield client[name]["c"]
    client.drop_database(name)
    client.close()


# -- merge_ready ---------------------------------------------------------------------------
def events_of(coll: Any, write: Callable[[], None], **options: Any) -> list[Any]:
    with changestream.watch(coll, max_await_time_ms=50, **options) as stream:
        write()
        events: list[Any] = []
        while (change := stream.try_next()) is not None or not events:
            if change is not None:
                events.append(change)
    return events


def test_merge_ready_takes_the_last_change_in_token_order_inside_a_transaction(coll: Any) -> None:
    def write() -> None:
        coll.insert_many([{"_id": i, "v": 0} for i in range(4)])
        with coll.database.client.start_session() as session, session.start_transaction():
            coll.update_one({"_id": 0}, {"$set": {"v": "first"}}, session=session)
            coll.update_one({"_id": 0}, {"$set": {"v": "second"}}, session=session)
            coll.delete_one({"_id": 1}, session=session)
            coll.insert_one({"_id": 1, "v": "re-inserted"}, session=session)
            coll.replace_one({"_id": 2}, {"_id": 2, "r": True}, session=session)
            coll.delete_one({"_id": 3}, session=session)

    events = events_of(coll, write, full_document="updateLookup")
    in_txn = [e for e in events if "txnNumber" in e]
    assert len({e["clusterTime"] for e in in_txn}) == 1 < len(in_txn)  # one clusterTime
    batch = changestream.merge_ready(list(reversed(events)), full_document="updateLookup")
    rows = {row.key: row for row in batch.rows}
    assert rows[0].op == "upsert" and rows[0].document["v"] == "second"
    assert rows[1].op == "upsert" and rows[1].document["v"] == "re-inserted"
    assert rows[2].document == {"_id": 2, "r": True}
    assert rows[3].op == "delete" and rows[3].document is None
    assert [row.key for row in batch.rows] == [0, 1, 2, 3]  # in the order of their change
    assert batch.last_token == events[-1]["_id"]
    # The same merge in clusterTime order (stable over the reversed list) would be wrong:
    by_time = sorted(reversed(events), key=lambda e: e["clusterTime"])
    assert [e["operationType"] for e in by_time] != [e["operationType"] for e in events]


def test_an_update_without_its_document_is_refused_naming_the_options(coll: Any) -> None:
    events = events_of(coll, lambda: (coll.insert_one({"_id": 1}),
                                      coll.update_one({"_id": 1}, {"$set": {"a": 1}})))
    with pytest.raises(changestream.MissingDocumentError,
                       match=r"full_document='updateLookup'.*full_document='required'"):
        changestream.merge_ready(events)


def test_an_update_looked_up_after_its_delete_is_a_delete(coll: Any) -> None:
    def write() -> None:
        coll.insert_one({"_id": 7})
        coll.update_one({"_id": 7}, {"$set": {"a": 1}})
        coll.delete_one({"_id": 7})

    events = events_of(coll, write, full_document="updateLookup")
    update = [e for e in events if e["operationType"] == "update"]
    assert update[0]["fullDocument"] is None
    assert changestream.merge_ready(update, full_document="updateLookup").rows[0].op == "delete"
    with pytest.raises(changestream.MissingDocumentError):
        changestream.merge_ready(update)  # whenAvailable or no option: unknown, refused


def test_merge_ready_refuses_two_collections_and_clears_on_drop(coll: Any) -> None:
    other = coll.database["other"]
    events = events_of(coll.database, lambda: (coll.insert_one({"_id": 1}),
                                               other.insert_one({"_id": 2})))
    with pytest.raises(ValueError, match="group the changes by 'ns'"):
        changestream.merge_ready(events)
    dropped = events_of(coll, lambda: (coll.insert_one({"_id": 3}), coll.drop()))
    batch = changestream.merge_ready([e for e in dropped if e["operationType"] != "invalidate"])
    assert batch.cleared and batch.rows == []


# -- the Delta sink ------------------------------------------------------------------------
def test_the_table_equals_the_collection_after_concurrent_writes(coll: Any, tmp_path: Path) -> None:
    coll.insert_many([{"_id": i, "v": "before"} for i in range(30)])
    sink = DeltaSink(tmp_path / "t", app_id="a", full_document="updateLookup")
    stop = threading.Event()

    def handle(change: Any) -> None:
        sink(change)
        if change.get("documentKey", {}).get("_id") == "end":
            stop.set()

    def load(*args: Any) -> None:
        changestream.consume(coll, handle, sink, initial_snapshot=True, save_every=25,
                             watch_options={"full_document": "updateLookup",
                                            "max_await_time_ms": 50}, stop=stop)

    reader = threading.Thread(target=load)
    reader.start()
    try:
        write_mix(coll, 400, seed=1)
        coll.insert_one({"_id": "end"})
        reader.join(60)
    finally:
        stop.set()
    assert not reader.is_alive()
    assert_mirrors(tmp_path / "t", coll, "a")
    assert len(committed_versions(tmp_path / "t", "a")) > 5  # many batches, not one


def test_a_replayed_batch_is_a_no_op(coll: Any, tmp_path: Path) -> None:
    events = events_of(coll, lambda: coll.insert_many([{"_id": i} for i in range(5)]))
    sink = DeltaSink(tmp_path / "t", app_id="spark-query")
    assert sink.write(events, version=0, token=events[-1]["_id"])
    coll.delete_many({})  # what a replay must not resurrect is already deleted downstream
    later = events_of(coll, lambda: coll.insert_one({"_id": 9}))
    assert sink.write(later, version=1)
    assert not sink.write(events, version=0)  # Spark ran batch 0 again
    assert not DeltaSink(tmp_path / "t", app_id="spark-query").write(events, version=1)
    assert set(table_state(tmp_path / "t")) == {0, 1, 2, 3, 4, 9}
    assert committed_versions(tmp_path / "t", "spark-query") == [0, 1]
    # Another app id is another writer: its version 0 is its own.
    assert DeltaSink(tmp_path / "t", app_id="other").write(later, version=0)


def test_columns_from_an_arrow_schema_and_a_field_that_does_not_fit(coll: Any, tmp_path: Path) -> None:
    schema = pa.schema([("_id", pa.int64()), ("name", pa.string()), ("qty", pa.int32())])
    sink = DeltaSink(tmp_path / "t", app_id="a", schema=schema)
    ok = events_of(coll, lambda: coll.insert_many([
        {"_id": 1, "name": "pen", "qty": 3, "extra": "not stored"},
        {"_id": 2, "name": {"nested": True}, "qty": 2.0},      # any value fits a string column
        {"_id": 3},                                            # missing fields are null
    ]))
    for change in ok:
        sink(change)
    sink.save(ok[-1]["_id"])
    rows = deltalake.DeltaTable(str(tmp_path / "t")).to_pyarrow_table().sort_by("_id").to_pylist()
    base = {"_seq": 0, "_op": "upsert"}  # compacted: the first batch of a new table
    assert rows == [
        {"_key": "1", **base, "_id": 1, "name": "pen", "qty": 3},
        {"_key": "2", **base, "_id": 2, "name": '{"nested": true}', "qty": 2},
        {"_key": "3", **base, "_id": 3, "name": None, "qty": None},
    ]
    bad = events_of(coll, lambda: (coll.insert_one({"_id": 4, "qty": 5}),
                                   coll.insert_one({"_id": 5, "qty": "many"})))
    for change in bad:
        sink(change)
    with pytest.raises(DocumentSchemaError, match=r"field 'qty' of the document with _id 5"):
        sink.save(bad[-1]["_id"])
    assert DeltaSink(tmp_path / "t", app_id="a", schema=schema).load().token == ok[-1]["_id"]
    assert len(rows) == len(deltalake.DeltaTable(str(tmp_path / "t")).to_pyarrow_table())
    with pytest.raises(changestream.delta.DeltaSinkError, match="has the columns"):
        DeltaSink(tmp_path / "t", app_id="a").load()  # the JSON layout on a columns table


# -- changestream mirror -------------------------------------------------------------------
def mirror(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_mirror_bad_arguments_exit_2_with_one_line(tmp_path: Path) -> None:
    for args in (["mongodb://x", "--db", "d", "--coll", "c"],
                 ["http://x", "--db", "d", "--coll", "c", "--to", str(tmp_path / "t")],
                 ["mongodb://x", "--db", "d", "--coll", "c", "--to", "/no/such/dir/t"],
                 ["mongodb://x", "--db", "d", "--coll", "c", "--to", "t", "--batch", "0"],
                 ["mongodb://x", "--db", "d", "--coll", "c", "--to", "t", "--schema", "qty INTT"],
                 ["mongodb://x", "--db", "d", "--coll", "c", "--to", "t", "--schema", "@/no/f"]):
        proc = subprocess.run([sys.executable, "-m", "changestream", "mirror", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_mirror_schema_gives_typed_columns_and_a_misfit_stops_with_nothing_written(
    coll: Any, rs: ReplicaSet, tmp_path: Path
) -> None:
    coll.insert_many([{"_id": 1, "name": "pen", "qty": 3, "tags": ["a", "b"], "x": 0},
                      {"_id": 2, "name": "cup", "qty": 1.0}])
    target = str(tmp_path / "t")
    ddl = "_id BIGINT, name STRING, qty INT, tags ARRAY<STRING>"
    args = [rs.uri, "--db", coll.database.name, "--coll", coll.name, "--to", target,
            "--schema", ddl, "--until-idle", "1"]
    first = subprocess.run([sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    table = deltalake.DeltaTable(target)
    assert pa.schema(table.schema().to_arrow()) == pa.schema([
        ("_key", pa.string()), ("_seq", pa.int64()), ("_op", pa.string()),
        ("_id", pa.int64()), ("name", pa.string()), ("qty", pa.int32()),
        ("tags", pa.list_(pa.field("element", pa.string()))),
    ])
    rows = table.to_pyarrow_table().sort_by("_id").to_pylist()
    base = {"_seq": 0, "_op": "upsert"}  # the first load's rows are the base
    assert rows == [{"_key": "1", **base, "_id": 1, "name": "pen", "qty": 3, "tags": ["a", "b"]},
                    {"_key": "2", **base, "_id": 2, "name": "cup", "qty": 1, "tags": None}]
    position = DeltaSink(target, app_id="changestream-mirror", schema=ddl)
    before = position.load()
    coll.insert_many([{"_id": 3, "qty": 4}, {"_id": 4, "qty": "many"}])
    second = subprocess.run([sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 1, second.stderr
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("changestream: DocumentSchemaError: field 'qty' of the document with _id 4 "), last
    assert deltalake.DeltaTable(target).to_pyarrow_table().sort_by("_id").to_pylist() == rows
    assert position.load() == before  # the position did not move: a wider schema resumes here


def test_mirror_survives_kill_9_mid_batch(coll: Any, rs: ReplicaSet, tmp_path: Path) -> None:
    coll.insert_many([{"_id": i, "v": "before"} for i in range(200)])
    target = str(tmp_path / "t")
    args = [rs.uri, "--db", coll.database.name, "--coll", coll.name, "--to", target,
            "--batch", "15", "--batch-seconds", "0.2"]
    writer = threading.Thread(target=write_mix, args=(coll, 500, 2))
    first = mirror(*args)
    try:
        deadline = time.monotonic() + 60
        while not committed_versions_or_empty(target, "changestream-mirror"):
            assert time.monotonic() < deadline and first.poll() is None, first.stderr
            time.sleep(0.05)
        writer.start()
        time.sleep(random.Random(3).uniform(0.3, 1.0))
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        writer.join(120)
    finally:
        first.kill()
    killed_at = len(committed_versions(target, "changestream-mirror"))
    second = mirror(*args, "--until-idle", "2")
    _out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert "from its last commit" in err
    assert len(committed_versions(target, "changestream-mirror")) > killed_at
    assert_mirrors(target, coll, "changestream-mirror")


def committed_versions_or_empty(path: str, app_id: str) -> list[int]:
    try:
        return committed_versions(path, app_id)
    except Exception:  # not a table yet
        return []


def test_mirror_on_a_sharded_cluster(tmp_path: Path) -> None:
    with ShardedCluster("8.0", shards=2, mongoses=2, noop_interval=0.1) as cluster:
        admin: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(cluster.uri)
        admin.admin.command("shardCollection", "m.c", key={"_id": "hashed"})
        coll = admin.m.c
        coll.insert_many([{"_id": i, "v": "before"} for i in range(40)])
        sink = DeltaSink(tmp_path / "t", app_id="a", full_document="updateLookup")
        stop = threading.Event()

        def handle(change: Any) -> None:
            sink(change)
            if change.get("documentKey", {}).get("_id") == "end":
                stop.set()

        reader = threading.Thread(target=lambda: changestream.consume(
            coll, handle, sink, initial_snapshot=True, save_every=20, stop=stop,
            watch_options={"full_document": "updateLookup", "max_await_time_ms": 50}))
        reader.start()
        try:
            write_mix(coll, 200, seed=4, transactions=False)
            coll.insert_one({"_id": "end"})
            reader.join(90)
        finally:
            stop.set()
        assert not reader.is_alive()
        assert_mirrors(tmp_path / "t", coll, "a")
        admin.close()


def test_a_dropped_collection_empties_the_table_and_ends_the_run(coll: Any, tmp_path: Path) -> None:
    coll.insert_many([{"_id": i} for i in range(5)])
    sink = DeltaSink(tmp_path / "t", app_id="a", full_document="updateLookup")
    stop = threading.Event()

    def handle(change: Any) -> None:
        sink(change)
        if change["operationType"] == "insert" and change["documentKey"]["_id"] == 5:
            sink.save(change["_id"])  # the snapshot and the insert are in the table
            assert len(table_state(tmp_path / "t")) == 6
            coll.drop()

    thread = threading.Thread(target=lambda: coll.insert_one({"_id": 5}))
    with pytest.raises(changestream.StreamInvalidatedError):
        thread.start()
        changestream.consume(coll, handle, sink, initial_snapshot=True, stop=stop,
                             watch_options={"full_document": "updateLookup",
                                            "max_await_time_ms": 50})
    thread.join()
    assert table_state(tmp_path / "t") == {}
