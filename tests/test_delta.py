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

from delta_support import (  # noqa: E402
    assert_mirrors,
    committed_versions,
    plain_state,
    table_state,
    write_mix,
)

from changestream.delta import DeltaSink, DeltaSinkError, DocumentSchemaError  # noqa: E402


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
    sink = DeltaSink(tmp_path / "t", app_id="a", schema=schema, min_log_rows=0)
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


def test_mirror_to_an_object_store_without_credentials_is_one_line(
    rs: ReplicaSet, tmp_path: Path
) -> None:
    """Issue 33 item 10: ``--to s3://...`` without credentials printed the object
    store's error over 11 lines with colour codes. Every endpoint the AWS libraries
    would ask for credentials points at a closed loopback port (no traffic leaves)."""
    import os

    env = {key: value for key, value in os.environ.items() if not key.startswith("AWS_")}
    closed = "http://127.0.0.1:1"
    env.update(HOME=str(tmp_path), AWS_EC2_METADATA_DISABLED="true", AWS_REGION="us-east-1",
               AWS_EC2_METADATA_SERVICE_ENDPOINT=closed, AWS_METADATA_ENDPOINT=closed,
               AWS_ENDPOINT_URL=closed)
    proc = subprocess.run(
        [sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "d", "--coll", "c",
         "--to", "s3://bucket/table", "--no-status"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "\x1b" not in proc.stderr, proc.stderr
    assert lines[0].startswith("changestream: OSError: Generic S3 error: Error performing "), lines
    assert "Connection refused" in lines[0]


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
    kill_9_mid_batch_then_until_idle(coll, rs.uri, tmp_path, transactions=True)


def test_mirror_survives_kill_9_mid_batch_on_a_sharded_cluster(tmp_path: Path) -> None:
    """The same through mongos: the change log of two shards, merged by cluster time."""
    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.1) as cluster:
        admin: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(cluster.uri)
        admin.admin.command("shardCollection", "k.c", key={"_id": "hashed"})
        try:
            kill_9_mid_batch_then_until_idle(admin.k.c, cluster.uri, tmp_path,
                                             transactions=False)  # (the mongos runs none)
        finally:
            admin.close()


def kill_9_mid_batch_then_until_idle(coll: Any, uri: str, tmp_path: Path, *,
                                     transactions: bool) -> None:
    """``mirror`` killed at a random moment while changes come, then run again with
    ``--until-idle``: every batch version applied once, the table equal to the collection."""
    coll.insert_many([{"_id": i, "v": "before"} for i in range(200)])
    target = str(tmp_path / "t")
    args = [uri, "--db", coll.database.name, "--coll", coll.name, "--to", target,
            "--batch", "15", "--batch-seconds", "0.2"]
    writer = threading.Thread(target=write_mix, args=(coll, 500, 2),
                              kwargs={"transactions": transactions})
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
    # --until-idle compacted the change log: read plainly, the table is the collection.
    assert plain_state(target) == {doc["_id"]: doc for doc in coll.find()}


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


# -- the table's layout: a base plus a change log, compacted ---------------------------------
NS = {"db": "d", "coll": "c"}


class Changes:
    """Synthetic change events with resume tokens in order, and the reference state."""

    def __init__(self) -> None:
        self.count = 0
        self.state: dict[Any, Any] = {}

    def token(self) -> dict[str, Any]:
        self.count += 1
        return {"_data": f"82{1_800_000_000 + self.count // 100:08X}{self.count % 100 + 1:08X}"
                         "2B042C0100296E5A1004"}

    def event(self, operation: str, key: Any, value: Any = None) -> dict[str, Any]:
        change: dict[str, Any] = {"_id": self.token(), "operationType": operation, "ns": NS,
                                  "documentKey": {"_id": key}}
        if operation == "delete":
            self.state.pop(key, None)
        else:
            document = {"_id": key, "v": value, "nested": {"at": [value, str(key)]}}
            change["fullDocument"] = document
            self.state[key] = document
        return change

    def snapshot(self, keys: list[Any]) -> list[dict[str, Any]]:
        from bson.timestamp import Timestamp

        records = []
        for key in keys:
            document = {"_id": key, "v": "snap"}
            self.state[key] = document
            records.append({"_id": {"_data": "snapshot", "phase": "copy",
                                    "at": Timestamp(1_800_000_000, 1), "lastId": key},
                            "operationType": "insert", "ns": NS, "documentKey": {"_id": key},
                            "fullDocument": document})
        return records


def current_by_sql(path: Path) -> dict[Any, Any]:
    """CURRENT_SQL run by SQLite over the table's rows (DuckDB and Spark run the same text)."""
    import sqlite3

    from bson import json_util

    from changestream.delta import CURRENT_SQL

    rows = deltalake.DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    with sqlite3.connect(":memory:") as db:
        db.execute("CREATE TABLE t (_key TEXT, _seq INTEGER, _op TEXT, document TEXT)")
        db.executemany("INSERT INTO t VALUES (?, ?, ?, ?)",
                       [(r["_key"], r["_seq"], r["_op"], r["document"]) for r in rows])
        found = db.execute(f"SELECT _key, document FROM ({CURRENT_SQL.format(table='t')})")
        return {json_util.loads(k): json_util.loads(d) for k, d in found.fetchall()}


def apply(sink: DeltaSink, changes: list[dict[str, Any]]) -> None:
    for change in changes:
        sink(change)
    sink.save(changes[-1]["_id"])


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_OPS = st.lists(st.tuples(st.sampled_from(["insert", "update", "replace", "delete"]),
                          st.integers(0, 12)), min_size=1, max_size=14)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(_OPS, min_size=1, max_size=6), fraction=st.sampled_from([0.1, 1.0, 50.0]),
       snapshot=st.integers(0, 8))
def test_the_table_equals_a_reference_for_random_changes_replays_and_compactions(
    tmp_path_factory: Any, batches: list[list[tuple[str, int]]], fraction: float, snapshot: int
) -> None:
    path = tmp_path_factory.mktemp("t") / "t"
    changes = Changes()
    sink = DeltaSink(path, app_id="a", log_fraction=fraction, min_log_rows=0)
    if snapshot:
        apply(sink, changes.snapshot(list(range(0, 2 * snapshot, 2))))
    written: list[list[dict[str, Any]]] = []
    for n, ops in enumerate(batches):
        batch = [changes.event(op, key, f"{n}.{i}") for i, (op, key) in enumerate(ops)]
        apply(sink, batch)
        written.append(batch)
        assert table_state(path) == changes.state
        assert current_by_sql(path) == changes.state
        first = 1 if snapshot else 0
        assert not sink.write(written[0], version=first)  # a replay changes nothing
        assert table_state(path) == changes.state
    sink.finish()
    assert plain_state(path) == changes.state  # compacted: read plainly
    versions = committed_versions(path, "a")
    assert versions == list(range(len(versions)))


@settings(max_examples=25, deadline=None)
@given(ops=_OPS, seed=st.integers(0, 2**32))
def test_merge_ready_collapses_a_shuffled_batch_as_the_batch_in_token_order(
    ops: list[tuple[str, int]], seed: int
) -> None:
    changes = Changes()
    batch = [changes.event(op, key, i) for i, (op, key) in enumerate(ops)]
    shuffled = random.Random(seed).sample(batch, len(batch))
    expect = changestream.merge_ready(batch, full_document="updateLookup")
    assert changestream.merge_ready(shuffled, full_document="updateLookup") == expect


def test_merge_ready_orders_tokens_by_their_bytes_not_their_texts() -> None:
    # "820B" < "820a" as texts, but 0x0a < 0x0b: the second change below is the earlier one
    later = {"_id": {"_data": "820B"}, "operationType": "insert", "ns": NS,
             "documentKey": {"_id": 1}, "fullDocument": {"_id": 1, "v": "later"}}
    earlier = {**later, "_id": {"_data": "820a"}, "fullDocument": {"_id": 1, "v": "earlier"}}
    for batch in ([later, earlier], [earlier, later]):
        merged = changestream.merge_ready(batch)
        assert merged.rows[0].document == {"_id": 1, "v": "later"}
        assert merged.last_token == {"_data": "820B"}


def test_a_log_below_min_log_rows_waits_for_finish(tmp_path: Path) -> None:
    changes = Changes()
    sink = DeltaSink(tmp_path / "t", app_id="a", log_fraction=0.01)  # due by the fraction
    apply(sink, changes.snapshot(list(range(100))))
    apply(sink, [changes.event("update", k, "x") for k in range(0, 100, 2)])
    assert sink.compactions == []  # 50 log rows: a compaction would be mostly fixed cost
    assert sink.finish() is not None and plain_state(tmp_path / "t") == changes.state
    eager = DeltaSink(tmp_path / "u", app_id="a", log_fraction=0.01, min_log_rows=50)
    apply(eager, changes.snapshot(list(range(100))))
    apply(eager, [changes.event("update", k, "y") for k in range(0, 100, 2)])
    assert [c.log_rows for c in eager.compactions] == [50]
    with pytest.raises(ValueError, match="min_log_rows must be an integer >= 0"):
        DeltaSink(tmp_path / "v", min_log_rows=-1)


def test_a_compaction_the_stream_would_wait_for_is_put_off_until_twice_the_log() -> None:
    from changestream._delta_layout import LogSize

    size = LogSize(log_rows=60, touched_rows=100)
    assert size.due(0.5, 50, 1_000) and not size.due(0.5, 50, 1_000, waited=True)
    assert LogSize(120, 100).due(0.5, 50, 1_000, waited=True)
    assert not LogSize(120, 300).due(0.5, 50, 1_000, waited=True)  # < twice the fraction
    assert LogSize(1_000, 10**9).due(0.5, 50, 1_000, waited=True)  # max_log_rows still holds
    assert not LogSize(0, 0).due(0.5, 0, 1_000)


def test_a_batch_committed_behind_compacts_unless_the_stream_waits_for_it(
    tmp_path: Path
) -> None:
    """A compaction due after a commit behind runs while the stream goes on; while the stream
    waits for that commit (the run's end, ``flush``) it is put off until the log is twice
    as large, so the run's end pays one compaction (the next commit's, or ``finish()``'s)."""
    changes = Changes()
    sink = DeltaSink(tmp_path / "t", app_id="a", log_fraction=0.01, min_log_rows=50)
    apply(sink, changes.snapshot(list(range(200))))

    def stage(value: str) -> None:
        for key in range(0, 120, 2):  # 60 log rows: due alone, not twice
            sink(changes.event("update", key, value))
        sink.save_behind(changes.token())

    stage("a")  # nobody waits: compacted behind the stream
    deadline = time.monotonic() + 30
    while not sink.compactions and time.monotonic() < deadline:
        time.sleep(0.01)
    sink.flush()
    assert [c.log_rows for c in sink.compactions] == [60]

    committing = sink._commit_changes
    waited: list[bool] = []

    def once_waited_for(*args: Any, **kwargs: Any) -> Any:  # the stream waits, then it commits
        deadline = time.monotonic() + 30
        while not sink._awaited() and time.monotonic() < deadline:
            time.sleep(0.01)
        waited.append(sink._awaited())
        return committing(*args, **kwargs)

    sink._commit_changes = once_waited_for  # type: ignore[method-assign]
    stage("b")
    sink.flush()
    assert waited == [True] and len(sink.compactions) == 1  # put off: 60 rows
    assert table_state(tmp_path / "t") == changes.state
    stage("c")
    sink.flush()
    assert waited == [True, True]
    assert [c.log_rows for c in sink.compactions] == [60, 120]  # twice the log: compacted
    assert plain_state(tmp_path / "t") == changes.state
    stage("d")
    sink.flush()
    assert len(sink.compactions) == 2
    assert sink.finish() is not None and plain_state(tmp_path / "t") == changes.state


def test_compaction_rewrites_only_the_files_whose_key_range_a_change_touches(
    tmp_path: Path
) -> None:
    changes = Changes()
    sink = DeltaSink(tmp_path / "t", app_id="a")
    keys = [f"k{n:04d}" for n in range(300)]
    for start in range(0, 300, 100):  # three first-load files, disjoint key ranges
        apply(sink, changes.snapshot(keys[start:start + 100]))
    assert len(deltalake.DeltaTable(str(tmp_path / "t")).file_uris()) == 3
    apply(sink, [changes.event("update", "k0250", 1), changes.event("delete", "k0251"),
                 changes.event("insert", "k9999", 2)])  # beyond every file: its own range
    assert sink.compactions == []  # 3 log rows: not yet worth rewriting a 100-row file
    done = sink.compact()
    assert done is not None and done.base_rows_read == 100  # one of the three files
    assert done.files_removed == 2  # that file and the log file
    assert plain_state(tmp_path / "t") == changes.state


def test_a_compaction_killed_before_its_commit_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import changestream._delta_layout as layout

    changes = Changes()
    sink = DeltaSink(tmp_path / "t", app_id="a", log_fraction=100.0)  # compacts when told
    apply(sink, changes.snapshot(list(range(50))))
    apply(sink, [changes.event("update", k, "x") for k in range(0, 50, 3)])
    apply(sink, [changes.event("delete", k) for k in range(0, 50, 5)])
    before = deltalake.DeltaTable(str(tmp_path / "t")).version()
    real = layout.write_deltalake

    def killed(table: Any, data: Any, **kwargs: Any) -> None:
        for _ in data:  # the new files are being written ...
            pass
        raise KeyboardInterrupt("killed before the commit")  # ... and the process dies

    monkeypatch.setattr(layout, "write_deltalake", killed)
    with pytest.raises(KeyboardInterrupt):
        sink.finish()
    monkeypatch.setattr(layout, "write_deltalake", real)
    assert deltalake.DeltaTable(str(tmp_path / "t")).version() == before
    restarted = DeltaSink(tmp_path / "t", app_id="a")
    assert table_state(tmp_path / "t") == changes.state
    assert restarted.load().token == sink.load().token
    apply(restarted, [changes.event("insert", 99, "after")])
    restarted.finish()
    assert plain_state(tmp_path / "t") == changes.state
    assert committed_versions(tmp_path / "t", "a") == [0, 1, 2, 3]


def test_a_first_load_killed_between_batches_resumes_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import changestream._delta_sink as sink_module

    changes = Changes()
    records = changes.snapshot(list(range(300)))
    sink = DeltaSink(tmp_path / "t", app_id="a")
    real = sink_module.write_deltalake
    calls = [0]

    def dies_on_the_third(table: Any, data: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt("killed mid-commit")
        real(table, data, **kwargs)

    monkeypatch.setattr(sink_module, "write_deltalake", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        for start in range(0, 300, 100):
            apply(sink, records[start:start + 100])
    monkeypatch.setattr(sink_module, "write_deltalake", real)
    restarted = DeltaSink(tmp_path / "t", app_id="a")
    position = restarted.load()
    assert position is not None and position.token["lastId"] == 199  # where the copy resumes
    apply(restarted, records[200:])  # the copy continues after lastId ...
    apply(restarted, [changes.event("update", 5, "streamed"), changes.event("delete", 6),
                      changes.event("insert", 6, "again")])  # ... then the stream, on top
    assert table_state(tmp_path / "t") == changes.state
    restarted.finish()
    assert plain_state(tmp_path / "t") == changes.state
    assert committed_versions(tmp_path / "t", "a") == [0, 1, 2, 3]


def test_load_refuses_a_damaged_token_naming_the_table(tmp_path: Path) -> None:
    from changestream.stores import TokenStoreError

    sink = DeltaSink(tmp_path / "t", app_id="a")
    changes = Changes()
    apply(sink, [changes.event("insert", 1, "x")])
    table = deltalake.DeltaTable(str(tmp_path / "t"))
    for bad in ('{"_data": 5}', "not json", '{"no": "data"}'):
        deltalake.write_deltalake(
            table, table.schema().to_arrow().empty_table(), mode="append",
            commit_properties=deltalake.CommitProperties(custom_metadata={
                "changestream.app_id": "a", "changestream.token": bad}))
        with pytest.raises(TokenStoreError, match=f"the Delta table at {tmp_path / 't'}"):
            DeltaSink(tmp_path / "t", app_id="a").load()


def test_writers_with_other_app_ids_retry_a_conflicting_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import changestream._delta_layout as layout

    first, second = Changes(), Changes()
    a = DeltaSink(tmp_path / "t", app_id="a", log_fraction=100.0)
    b = DeltaSink(tmp_path / "t", app_id="b", log_fraction=100.0)
    apply(a, first.snapshot(list(range(20))))
    apply(a, [first.event("update", 3, "a")])
    real = layout.write_deltalake
    calls = [0]

    def another_writer_commits_first(table: Any, data: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:  # b appends while a compacts: a's commit conflicts
            apply(b, [second.event("insert", 100 + calls[0], "b")])
        real(table, data, **kwargs)

    monkeypatch.setattr(layout, "write_deltalake", another_writer_commits_first)
    a.finish()
    assert calls[0] == 2  # the compaction was planned again and committed
    monkeypatch.setattr(layout, "write_deltalake", real)
    assert table_state(tmp_path / "t") == {**first.state, **second.state}
    a.finish()
    assert plain_state(tmp_path / "t") == {**first.state, **second.state}


def test_a_second_writer_with_the_same_app_id_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import changestream._delta_sink as sink_module

    changes = Changes()
    one = DeltaSink(tmp_path / "t", app_id="a")
    apply(one, [changes.event("insert", 1, "x")])
    two = DeltaSink(tmp_path / "t", app_id="a")
    apply(two, [changes.event("insert", 2, "y")])
    with pytest.raises(DeltaSinkError, match=r"another writer holds the Delta table at .* "
                                                   r"with app id 'a'"):
        apply(one, [changes.event("insert", 3, "z")])
    # The race: both read version 1, the other one commits first.
    three = DeltaSink(tmp_path / "t", app_id="a")
    three.load()
    four = DeltaSink(tmp_path / "t", app_id="a")
    four.load()
    real = sink_module.write_deltalake
    calls = [0]

    def the_other_commits_first(table: Any, data: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            apply(four, [changes.event("insert", 4, "w")])
        real(table, data, **kwargs)

    monkeypatch.setattr(sink_module, "write_deltalake", the_other_commits_first)
    with pytest.raises(DeltaSinkError, match="another writer holds"):
        apply(three, [changes.event("insert", 5, "v")])
    monkeypatch.setattr(sink_module, "write_deltalake", real)
    versions = committed_versions(tmp_path / "t", "a")
    assert versions == list(range(len(versions)))  # no version twice


from bson import json_util  # noqa: E402
from bson.binary import Binary  # noqa: E402
from bson.decimal128 import Decimal128  # noqa: E402
from bson.int64 import Int64  # noqa: E402
from bson.objectid import ObjectId  # noqa: E402

_LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(), st.text(max_size=8),
    st.builds(ObjectId), st.builds(Int64, st.integers(-(2**63), 2**63 - 1)),
    st.datetimes(min_value=__import__("datetime").datetime(1, 1, 1)).map(
        lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000)),
    st.datetimes(timezones=st.just(__import__("datetime").timezone.utc)),
    st.builds(Decimal128, st.sampled_from(["1.5", "-0", "NaN"])), st.binary(max_size=4).map(Binary),
)
_DOCS = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(document=st.dictionaries(st.text(max_size=5), _DOCS, max_size=5), key=_LEAVES)
def test_the_fast_relaxed_json_is_json_utils_byte_for_byte(document: Any, key: Any) -> None:
    from changestream._delta_json import relaxed_dumps, relaxed_key

    relaxed = json_util.RELAXED_JSON_OPTIONS
    assert relaxed_dumps(document) == json_util.dumps(document, json_options=relaxed)
    assert relaxed_key(key) == json_util.dumps(key, json_options=relaxed, separators=(",", ":"))


@pytest.mark.slow
def test_a_million_row_first_load_then_skewed_changes(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.delta_table_bench import Tokens, first_load, realistic_changes

    sink = DeltaSink(tmp_path / "t", app_id="a")
    first_load(sink, 1_000_000, 50_000)
    rng, tokens, latest, next_key = random.Random(5), Tokens(), {}, 1_000_000
    tokens.count = 10_000_000
    for _ in range(6):
        batch, next_key = realistic_changes("a", 1_000_000, 10_000, rng, tokens, next_key)
        apply(sink, batch)
        latest.update({json_util.dumps(c["documentKey"]["_id"], separators=(",", ":")):
                       c["fullDocument"] for c in batch})
    sink.finish()
    table = deltalake.DeltaTable(str(tmp_path / "t")).to_pyarrow_table()
    assert table.num_rows == next_key
    assert pa.compute.count_distinct(table.column("_key")).as_py() == next_key
    changed = table.filter(pa.compute.is_in(table.column("_key"),
                                            value_set=pa.array(list(latest))))
    for row in changed.to_pylist():
        assert json_util.loads(row["document"]) == json_util.loads(
            json_util.dumps(latest[row["_key"]]))


def test_keys_with_quotes_and_backslashes_survive_compaction(tmp_path: Path) -> None:
    changes = Changes()
    keys = ["a'b", "c\\", "d\\'", 'e"f', "é", "z''", "\\\\"]
    sink = DeltaSink(tmp_path / "t", app_id="a", log_fraction=100.0)
    apply(sink, changes.snapshot(sorted(keys)))
    apply(sink, [changes.event("update", key, "new") for key in keys[::2]]
          + [changes.event("delete", keys[1]), changes.event("insert", "b\\'x", "n")])
    done = sink.finish()
    assert done is not None and done.log_rows == 6
    assert plain_state(tmp_path / "t") == changes.state


def test_a_first_load_merges_its_small_files_and_keeps_the_log(tmp_path: Path) -> None:
    changes, other = Changes(), Changes()
    sink = DeltaSink(tmp_path / "t", app_id="a")
    sink.file_rows = 200  # files under 100 rows are small; runs of at most 200 rows
    keys = [f"k{n:04d}" for n in range(400)]
    for n, start in enumerate(range(0, 400, 10)):
        apply(sink, changes.snapshot(keys[start:start + 10]))
        if n == 5:  # another writer's log rows, in the key range of the files merged next
            DeltaSink(tmp_path / "t", app_id="b").write(
                [other.event("update", "k0001", "b"), other.event("insert", "k0005x", "b")], 0)
    sink._merger.wait()  # merges run beside the load, one at a time
    merges = [c for c in sink.compactions if c.log_rows == 0]
    # a run is merged once it has 16 files or half of file_rows (10 files of 10 rows here)
    assert merges and all(m.files_removed >= 10 and m.base_rows_read >= 100 for m in merges)
    files = deltalake.DeltaTable(str(tmp_path / "t")).file_uris()
    assert len(files) < 40 // 2  # 40 first-load commits, far fewer files
    assert table_state(tmp_path / "t") == {**changes.state, **other.state}
    sink.finish()
    assert plain_state(tmp_path / "t") == {**changes.state, **other.state}
    assert committed_versions(tmp_path / "t", "a") == list(range(40))


def test_a_failed_small_file_merge_loses_nothing_and_the_next_merges_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Merges run on a worker thread beside the load; one that fails is logged, the small
    files stay (the table's content is unchanged) and a later pass merges them."""
    import threading

    import changestream._delta_sink as sink_module

    real = sink_module.merge_small
    threads: list[str] = []
    failures = [1]

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        if failures[0]:
            failures[0] -= 1
            raise OSError("disk hiccup")
        return real(*args, **kwargs)

    monkeypatch.setattr(sink_module, "merge_small", failing_once)
    changes = Changes()
    sink = DeltaSink(tmp_path / "t", app_id="a")
    sink.file_rows = 200  # files under 100 rows are small; runs of at most 200 rows
    keys = [f"k{n:04d}" for n in range(400)]
    with caplog.at_level("WARNING", logger="changestream.delta"):
        for start in range(0, 400, 10):
            apply(sink, changes.snapshot(keys[start:start + 10]))
        sink._merger.wait()
    assert "disk hiccup" in caplog.text
    assert threads and all(name.startswith("changestream-delta-merge") for name in threads)
    assert [c for c in sink.compactions if c.log_rows == 0]  # later passes merged
    assert table_state(tmp_path / "t") == changes.state
    sink.finish()
    assert plain_state(tmp_path / "t") == changes.state
    assert committed_versions(tmp_path / "t", "a") == list(range(40))
