"""Snapshot, then stream: ``snapshot_then_watch`` and ``consume(..., initial_snapshot=True)``.

A sink applies every record as an upsert keyed by ``documentKey`` while writers
insert, update, replace and delete throughout the copy; it must end equal to the
collection, with every document copied exactly once and every write after T
applied once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from bson.objectid import ObjectId
from bson.timestamp import Timestamp
from pymongo import MongoClient, monitoring
from snapshot_support import Sink, Writer, collection_state, make_collection, wait_for

import changestream
from changestream._snapshot import SnapshotPosition, range_filter, stream_start
from changestream.stores import FileTokenStore, MemoryTokenStore

Client = MongoClient[dict[str, Any]]
WATCH = {"full_document": "required", "max_await_time_ms": 50}


@pytest.fixture
def client(simulator: Any) -> Iterator[Client]:
    c: Client = MongoClient(simulator.uri, serverSelectionTimeoutMS=10000)
    yield c
    c.close()


def _drain(stream: Any, sink: Sink, writer: Writer) -> None:
    """Apply changes until every write's event came."""
    deadline = time.monotonic() + 60
    while len(sink.data_events()) < writer.events:
        assert time.monotonic() < deadline, f"{len(sink.data_events())} of {writer.events} events"
        change = stream.try_next()
        if change is not None:
            sink.apply(change)
    assert stream.try_next() is None  # nothing more than the writes


def _check_exactly_once(sink: Sink, initial: int, writer: Writer, final: dict[Any, Any]) -> None:
    assert sink.docs == final
    assert set(sink.copied) == set(range(initial))
    assert max(sink.copied.values()) == 1, "a document was copied twice"
    (t,) = sink.stream_after
    assert all(e["clusterTime"] > t for e in sink.events), "an event at or before T came"
    assert len(sink.data_events()) == writer.events, "an event after T was lost or doubled"
    tokens = [bytes.fromhex(e["_id"]["_data"]) for e in sink.events]
    assert len(set(tokens)) == len(tokens)


def test_copy_then_stream_with_writers_throughout(client: Client) -> None:
    coll = make_collection(client.test, "c", 300)
    writer = Writer(coll, 300)
    sink = Sink()
    with changestream.snapshot_then_watch(coll, copy_batch_size=7, **WATCH) as stream:
        seen = 0
        while stream.copying:
            record = stream.try_next()
            if record is None:
                break
            sink.apply(record)
            seen += 1
            if seen % 10 == 0:
                writer.write(5)  # inserts, updates, replaces, deletes during the copy
        writer.write(20)
        _drain(stream, sink, writer)
    assert not sink.interrupted
    assert sink.read_times == sink.stream_after  # one read time: T
    _check_exactly_once(sink, 300, writer, collection_state(coll))


def test_restart_mid_copy_continues_at_the_same_time(client: Client) -> None:
    coll = make_collection(client.test, "c", 100)
    writer = Writer(coll, 100)
    sink = Sink()
    stream = changestream.snapshot_then_watch(coll, copy_batch_size=9, **WATCH)
    for _ in range(37):
        sink.apply(stream.try_next())
    position = stream.resume_token
    stream.close()  # the process "stops" here
    parsed = SnapshotPosition.parse(position)
    assert (parsed.phase, parsed.last_id) == ("copy", 36)
    writer.write(30)
    with changestream.snapshot_then_watch(coll, resume_after=position, **WATCH) as again:
        first = again.try_next()
        assert first["documentKey"] == {"_id": 37}  # continues, never starts over
        sink.apply(first)
        while again.copying:
            record = again.try_next()
            if record is None:
                break
            sink.apply(record)
        _drain(again, sink, writer)
    assert len(sink.read_times) == 1
    _check_exactly_once(sink, 100, writer, collection_state(coll))


def test_mixed_type_ids_restart_across_types(client: Client) -> None:
    coll = client.test.mixed
    ids: list[Any] = [3, 1.5, "b", "a", ObjectId(), None, True, {"k": 1}, Timestamp(5, 5), 10**12]
    coll.insert_many([{"_id": i} for i in ids])
    copied: list[Any] = []
    token = None
    for _ in range(len(ids) + 1):  # one record per run
        with changestream.snapshot_then_watch(coll, resume_after=token, copy_batch_size=2,
                                              max_await_time_ms=50) as stream:
            record = stream.try_next()
            if record is None or "snapshot" not in record:
                break
            copied.append(record["documentKey"]["_id"])
            token = stream.resume_token
    assert len(copied) == len(ids)
    expected = [None, 1.5, 3, 10**12, "a", "b", {"k": 1}]
    assert copied[:7] == expected
    assert isinstance(copied[7], ObjectId) and copied[8:] == [True, Timestamp(5, 5)]


def test_window_overrun_copies_the_rest_at_a_new_time(simulator: Any, client: Client) -> None:
    coll = make_collection(client.test, "c", 60)
    writer = Writer(coll, 60)
    sink = Sink()
    client.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 1})
    history = simulator.deployment.history
    with changestream.snapshot_then_watch(coll, copy_batch_size=5, **WATCH) as stream:
        for _ in range(20):
            sink.apply(stream.try_next())
        _overrun_the_window(stream, coll, sink, writer,
                            lambda t: history.oldest() > t, "T to leave the history window")


def _overrun_the_window(stream: Any, coll: Any, sink: Sink, writer: Writer,
                        t_left: Callable[[Any], bool], what: str) -> None:
    """After 20 copied records, let the read time T leave the history window, then check
    the rest is copied once at a new time, flagged as maybe repeated, and the stream
    catches the collection up from T."""
    (t,) = sink.read_times
    writer.write(15)  # events between T and the new read time
    wait_for(lambda: t_left(t), what)
    while stream.copying:
        record = stream.try_next()
        if record is None:
            break
        sink.apply(record)
    writer.write(10)
    # documents copied at the new time may see their events after T again: drain by time
    deadline = time.monotonic() + 60
    while sink.docs != collection_state(coll):
        assert time.monotonic() < deadline, "the sink never caught up"
        change = stream.try_next()
        if change is not None:
            sink.apply(change)
    assert len(sink.read_times) == 2 and sink.stream_after == {t}
    assert sink.repeat_flags[:20] == [False] * 20
    assert all(sink.repeat_flags[20:]), "records read at the new time must say events may repeat"
    assert max(sink.copied.values()) == 1 and set(range(20)) <= set(sink.copied)
    assert all(e["clusterTime"] > t for e in sink.events)


@pytest.mark.parametrize("how", ["rename", "drop"])
def test_rename_or_drop_during_the_copy_is_reported(client: Client, how: str) -> None:
    coll = make_collection(client.test, "c", 30)
    sink = Sink()
    with changestream.snapshot_then_watch(coll, copy_batch_size=4, max_await_time_ms=50) as stream:
        for _ in range(6):
            sink.apply(stream.try_next())
        if how == "rename":
            coll.rename("moved")
        else:
            coll.drop()
        deadline = time.monotonic() + 30
        while stream.alive:
            assert time.monotonic() < deadline
            record = stream.try_next()
            if record is not None:
                sink.apply(record)
    (report,) = sink.interrupted
    assert report["ns"] == {"db": "test", "coll": "c"}
    assert report["snapshot"]["lastId"] == max(sink.copied)
    assert "renamed" in report["snapshot"]["reason"] if how == "rename" else "dropped" in report[
        "snapshot"]["reason"]
    ops = [e["operationType"] for e in sink.events]
    assert ops == [how, "invalidate"]


def test_restart_after_a_rename_reports_instead_of_copying_nothing(client: Client) -> None:
    coll = make_collection(client.test, "c", 10)
    with changestream.snapshot_then_watch(coll, copy_batch_size=2) as stream:
        stream.try_next()
        position = stream.resume_token
    coll.rename("moved")
    with changestream.snapshot_then_watch(coll, resume_after=position, max_await_time_ms=50) as again:
        record = again.try_next()
    assert record["operationType"] == "snapshotInterrupted"
    assert "dropped or renamed" in record["snapshot"]["reason"] or "dropped" in record["snapshot"]["reason"]


def test_consume_initial_snapshot_stop_and_restart(client: Client, tmp_path: Path) -> None:
    coll = make_collection(client.test, "c", 120)
    writer = Writer(coll, 120)
    sink = Sink()
    store = FileTokenStore(tmp_path / "token.json")
    stop = threading.Event()

    def handler(record: dict[str, Any]) -> None:
        sink.apply(record)
        if len(sink.copied) == 50:
            stop.set()  # stop mid-copy

    changestream.consume(coll, handler, store, initial_snapshot=True, stop=stop,
                         watch_options={**WATCH, "batch_size": 10})
    saved = store.load()
    assert saved is not None
    position = SnapshotPosition.parse(saved.token)
    assert position.phase == "copy" and position.last_id == 49
    writer.write(40)
    stop.clear()

    def handler2(record: dict[str, Any]) -> None:
        sink.apply(record)
        if len(sink.data_events()) >= writer.events and len(sink.copied) == 120:
            stop.set()

    changestream.consume(coll, handler2, store, initial_snapshot=True, stop=stop,
                         watch_options=WATCH)
    _check_exactly_once(sink, 120, writer, collection_state(coll))
    assert not changestream._snapshot.is_snapshot_position(store.load().token)  # type: ignore[union-attr]


CHILD = r"""
import sys, changestream
from pymongo import MongoClient
from changestream.stores import FileTokenStore
uri, token_path, out_path = sys.argv[1:4]
coll = MongoClient(uri).test.c
out = open(out_path, "a", buffering=1)
def handler(record):
    if "snapshot" in record:
        out.write(repr(record["documentKey"]["_id"]) + "\n")
        out.flush()
        if int(record["documentKey"]["_id"]) >= 60:
            import time; time.sleep(600)   # killed here, mid-copy
changestream.consume(coll, handler, FileTokenStore(token_path), initial_snapshot=True,
                     watch_options={"max_await_time_ms": 50})
"""


def test_kill_9_mid_copy_then_restart(simulator: Any, client: Client, tmp_path: Path) -> None:
    coll = make_collection(client.test, "c", 150)
    token_path, out_path = tmp_path / "token.json", tmp_path / "copied.txt"
    script = CHILD
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}
    child = subprocess.Popen(
        [sys.executable, "-c", script, simulator.uri, str(token_path), str(out_path)], env=env
    )
    try:
        wait_for(lambda: out_path.exists() and out_path.read_text().count("\n") >= 61,
                 "the child to copy 61 documents")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    first_run = [int(line) for line in out_path.read_text().split()]
    store = FileTokenStore(token_path)
    saved = store.load()
    assert saved is not None
    position = SnapshotPosition.parse(saved.token)
    assert position.phase == "copy" and position.last_id in (59, 60)
    sink = Sink()
    stop = threading.Event()

    def handler(record: dict[str, Any]) -> None:
        sink.apply(record)
        if 149 in sink.copied:
            stop.set()

    changestream.consume(coll, handler, store, initial_snapshot=True, stop=stop,
                         watch_options={"max_await_time_ms": 50})
    second_run = sorted(sink.copied)
    assert second_run[0] == position.last_id + 1  # continued, not restarted
    union = first_run + second_run
    assert set(union) == set(range(150))
    assert len(union) - len(set(union)) <= 1  # at most the handled-but-unsaved record again
    assert sink.read_times == {position.read_at}


def test_argument_errors(client: Client) -> None:
    coll = client.test.c
    with pytest.raises(TypeError, match="start_at_operation_time"):
        changestream.snapshot_then_watch(coll, start_at_operation_time=Timestamp(1, 1))
    with pytest.raises(TypeError, match="typed"):
        changestream.snapshot_then_watch(coll, typed=True)
    with pytest.raises(TypeError, match="pymongo Collection"):
        changestream.snapshot_then_watch(client.test)
    with pytest.raises(ValueError, match="copy_batch_size"):
        changestream.snapshot_then_watch(coll, copy_batch_size=0)
    with pytest.raises(TypeError, match="collection itself"):
        changestream.consume(lambda t: None, print, MemoryTokenStore(), initial_snapshot=True)


def test_range_filters_follow_bson_order() -> None:
    assert range_filter() == {}
    assert range_filter(1, 5, has_lower=True, has_upper=True) == {"_id": {"$gt": 1, "$lt": 5}}
    mixed = range_filter(1, "b", has_lower=True, has_upper=True, lower_inclusive=True)
    assert mixed == {"$or": [{"_id": {"$gte": 1}}, {"_id": {"$lt": "b"}}]}
    after = range_filter("a", has_lower=True)
    assert after["$or"][0] == {"_id": {"$gt": "a"}}
    assert "objectId" in after["$or"][1]["_id"]["$type"] and "int" not in after["$or"][1]["_id"]["$type"]
    assert stream_start(Timestamp(7, 3)) == Timestamp(7, 4)
    assert stream_start(Timestamp(7, 0xFFFFFFFF)) == Timestamp(8, 0)


def test_position_round_trips_through_a_file_store(tmp_path: Path) -> None:
    position = SnapshotPosition("copy", Timestamp(9, 2), Timestamp(11, 1), "ab" * 16, ObjectId(), True)
    store = FileTokenStore(tmp_path / "t.json")
    store.save(position.document())
    loaded = store.load()
    assert loaded is not None
    assert SnapshotPosition.parse(loaded.token) == position


def test_the_pipeline_filters_records_like_events(client: Client) -> None:
    coll = make_collection(client.test, "c", 0)
    coll.insert_many([{"_id": i, "v": i} for i in range(10)])
    pipeline = [{"$match": {"fullDocument.v": {"$gte": 7}}}, {"$project": {"fullDocument.v": 0}}]
    with changestream.snapshot_then_watch(coll, pipeline, copy_batch_size=2,
                                          max_await_time_ms=50) as stream:
        records = []
        while stream.copying:
            record = stream.try_next()
            if record is None:
                break
            records.append(record)
        coll.insert_one({"_id": 20, "v": 20})
        coll.insert_one({"_id": 21, "v": 1})
        wait_for(lambda: (change := stream.try_next()) is not None and records.append(change) is None,
                 "the insert event")
    assert [r["documentKey"]["_id"] for r in records] == [7, 8, 9, 20]
    assert all("v" not in r["fullDocument"] for r in records)


def test_servers_before_5_0_refuse(start_rs_44: Any) -> None:
    from pymongo.errors import OperationFailure

    with MongoClient(start_rs_44.uri) as c:
        c.test.c.insert_one({})
        with pytest.raises(OperationFailure) as exc:
            changestream.snapshot_then_watch(c.test.c).try_next()
    assert exc.value.code == 72


@pytest.fixture
def start_rs_44() -> Iterator[Any]:
    from changestream.testing import ReplicaSet

    with ReplicaSet("4.4") as rs:
        yield rs


def test_consume_with_writers_throughout_and_a_window_overrun(
    simulator: Any, client: Client
) -> None:
    coll = make_collection(client.test, "c", 80)
    writer = Writer(coll, 80)
    sink = Sink()
    store = MemoryTokenStore()
    stop = threading.Event()
    history = simulator.deployment.history
    client.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 1})

    def handler(record: dict[str, Any]) -> None:
        sink.apply(record)
        copied = sum(sink.copied.values())
        if "snapshot" in record and copied % 10 == 0:
            writer.write(4)  # writes during the copy
        if copied == 30 and "snapshot" in record:
            (t,) = sink.stream_after
            wait_for(lambda: history.oldest() > t, "T to leave the history window")
        if copied >= 80 and len(sink.data_events()) >= writer.events:
            stop.set()  # the copy is over and every write's event came

    changestream.consume(coll, handler, store, initial_snapshot=True, stop=stop,
                         watch_options={**WATCH, "copy_batch_size": 10})
    assert sink.docs == collection_state(coll)
    assert len(sink.read_times) >= 2, "the rest of the copy is read at a new time"
    assert max(sink.copied.values()) == 1
    assert sink.repeat_flags[:30] == [False] * 30 and all(sink.repeat_flags[30:])
    (t,) = sink.stream_after
    assert all(e["clusterTime"] > t for e in sink.events)



@contextlib.contextmanager
def _sharded_collection(n: int, split: int) -> Iterator[tuple[Any, Client, Any]]:
    """A 2-shard cluster with ``test.c`` sharded on ``_id``: ``_id < split`` on shard0, the rest
    on shard1; ``n`` documents."""
    from changestream.testing import ShardedCluster

    with ShardedCluster("8.0", shards=2, mongoses=1, noop_interval=0.2) as cluster:
        client: Client = MongoClient(cluster.uri, serverSelectionTimeoutMS=10000)
        try:
            admin = client.admin
            coll = make_collection(client.test, "c", 0)
            admin.command("shardCollection", "test.c", key={"_id": 1})
            admin.command("split", "test.c", middle={"_id": split})
            admin.command("moveChunk", "test.c", find={"_id": split}, to=cluster.shard_names[1])
            admin.command("moveChunk", "test.c", find={"_id": 0}, to=cluster.shard_names[0])
            coll.insert_many([{"_id": i, "v": 0} for i in range(n)])
            for rs in cluster.shards:
                state = rs.deployment.catalog.get("test", "c")
                assert state is not None and any(True for _ in state.documents())
            yield cluster, client, coll
        finally:
            client.close()


def test_through_mongos_a_sharded_collection_is_copied_once_then_streamed() -> None:
    with _sharded_collection(300, 150) as (_, _, coll):
        writer = Writer(coll, 300)
        sink = Sink()
        with changestream.snapshot_then_watch(coll, copy_batch_size=7, **WATCH) as stream:
            seen = 0
            while stream.copying:
                record = stream.try_next()
                if record is None:
                    break
                sink.apply(record)
                seen += 1
                if seen % 10 == 0:
                    writer.write(5)  # writes on both shards during the copy
            writer.write(20)
            _drain(stream, sink, writer)
        assert not sink.interrupted
        assert sink.read_times == sink.stream_after  # one read time: T
        _check_exactly_once(sink, 300, writer, collection_state(coll))


def test_through_mongos_a_shard_window_overrun_copies_the_rest_at_a_new_time() -> None:
    with _sharded_collection(60, 30) as (cluster, _, coll):
        for rs in cluster.shards:
            with MongoClient(rs.uri, serverSelectionTimeoutMS=10000) as direct:
                direct.admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 1})
        writer = Writer(coll, 60)
        sink = Sink()
        with changestream.snapshot_then_watch(coll, copy_batch_size=5, **WATCH) as stream:
            for _ in range(20):
                sink.apply(stream.try_next())
            _overrun_the_window(
                stream, coll, sink, writer,
                lambda t: all(rs.deployment.history.oldest() > t for rs in cluster.shards),
                "T to leave every shard's history window",
            )


def test_the_copy_runs_inside_a_client_side_timeout(client: Client) -> None:
    """Under CSOT the copy's plain getMores carry no ``maxTimeMS`` (mongod refuses it there).

    PyMongo's ``Database.command`` would write the remaining timeout into every
    command; the copy's getMores must go without it, as PyMongo's own cursors do.
    """
    import pymongo

    coll = make_collection(client.test, "c", 40)
    copied = []
    with pymongo.timeout(30), changestream.snapshot_then_watch(
        coll, copy_batch_size=7, **WATCH
    ) as stream:
        while stream.copying:
            record = stream.try_next()
            if record is None:
                break
            copied.append(record["documentKey"]["_id"])
    assert sorted(copied) == list(range(40))


class _GetMores(monitoring.CommandListener):
    """Sets ``sent`` when a getMore goes out once ``watching``."""

    def __init__(self) -> None:
        self.sent = threading.Event()
        self.watching = False

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "getMore" and self.watching:
            self.sent.set()

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def test_interrupt_leaves_the_copy_alone_and_ends_a_waiting_stream(simulator: Any) -> None:
    """The sync stop watcher interrupts from its own thread. During the copy the copy's
    session is in use by its getMores: an interrupt must not end it (a close did: "Cannot
    use ended session", and a stream opened after it was never closed). Once streaming, it
    ends a getMore waiting on the server at once."""
    listener = _GetMores()
    with MongoClient(simulator.uri, event_listeners=[listener]) as client:
        coll = make_collection(client.test, "c", 30)
        with changestream.snapshot_then_watch(coll, copy_batch_size=7, full_document="required",
                                              max_await_time_ms=30_000) as stream:
            records = [stream.try_next() for _ in range(3)]
            aside = threading.Thread(target=stream.interrupt)
            aside.start()
            aside.join()
            assert stream.alive and stream.copying
            coll.insert_one({"_id": 100, "v": 0})  # after the copy's time: a change
            while True:
                record = stream.try_next()
                if "snapshot" not in record:
                    break
                records.append(record)
            assert {r["documentKey"]["_id"] for r in records} == set(range(30))
            assert record["documentKey"] == {"_id": 100} and stream.alive
            polled: list[Any] = []
            poll = threading.Thread(target=lambda: polled.append(stream.try_next()))
            listener.watching = True
            poll.start()
            assert listener.sent.wait(10), "the poll's getMore went out"
            started = time.monotonic()
            stream.interrupt()
            poll.join(10)
            assert not poll.is_alive() and time.monotonic() - started < 5
            assert polled == [None] and not stream.alive
