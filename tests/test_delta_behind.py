"""The Delta sink commits a batch while ``consume`` fetches the next (write-behind).

``consume`` (sync and async) calls the sink's ``save_behind``: batch N's commit
runs on a thread of its own while the handler already receives batch N+1. A
commit that fails there is raised by the sink's next call: the run ends with it,
no token past the failed batch is stored, and the next run loses nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow
import pymongo
import pytest
from bson import json_util
from bson.binary import Binary
from bson.code import Code
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.regex import Regex
from bson.timestamp import Timestamp
from pymongo import AsyncMongoClient

import changestream
import changestream.aio
from changestream.testing import ReplicaSet

deltalake = pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")

from delta_support import assert_mirrors, committed_versions, table_state  # noqa: E402

import changestream._delta_sink as delta_sink  # noqa: E402
from changestream._delta_resnapshot import DeltaResnapshot  # noqa: E402
from changestream._delta_rows import staged_change  # noqa: E402
from changestream._merge import RELAXED, MissingDocumentError, merge_columns  # noqa: E402
from changestream._snapshot import SNAPSHOT_MARK  # noqa: E402
from changestream.delta import DeltaSink  # noqa: E402
from changestream.stores import BackgroundTokenStore  # noqa: E402

BATCH = 10
CHANGES = 35


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replica_set:
        yield replica_set


@pytest.fixture
def names(rs: ReplicaSet) -> Iterator[tuple[str, str]]:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    name = f"t_{uuid.uuid4().hex[:8]}"
    yield name, "c"
    client.drop_database(name)
    client.close()


class DiskFull(OSError):
    pass


class Commits:
    """``write_deltalake`` of the sink's batch commits, watched: the first waits until the
    handler holds a change of the next batch; the ``fail``-th fails (a full disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: int | None) -> None:
        self.real: Callable[..., Any] = delta_sink.write_deltalake
        self.next_batch_seen = threading.Event()
        self.threads: list[str] = []
        self.fail = fail
        monkeypatch.setattr(delta_sink, "write_deltalake", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        if len(self.threads) == 1 and not self.next_batch_seen.wait(30):
            raise AssertionError("the next batch was not fetched while this one committed")
        if len(self.threads) == self.fail:
            raise DiskFull(28, "No space left on device")
        return self.real(*args, **kwargs)


def run_consume(uri: str, names: tuple[str, str], store: Any, commits: Commits | None,
                seen: list[Any], start: Any, mode: str, raw: bool = False) -> None:
    """``consume`` with ``store`` as handler and store, in batches of ``BATCH``, until the
    last change; ``seen``: the tokens of the changes handled (``raw``: as ``mirror`` reads
    them, ``RawBSONDocument`` events)."""
    options: dict[str, Any] = {"max_await_time_ms": 50}
    if raw:
        options["document_class"] = RawBSONDocument
    if start is not None:  # the first run: nothing stored yet
        options["start_at_operation_time"] = start

    def handler(stop: Any) -> Callable[[Any], None]:
        def handle(change: Any) -> None:
            store(change)
            seen.append(change["_id"])
            if commits is not None and len(seen) == BATCH + 3:  # inside the next batch
                commits.next_batch_seen.set()
            if change["documentKey"]["_id"] == CHANGES - 1:
                stop.set()

        return handle

    if mode == "sync":
        stop = threading.Event()
        with pymongo.MongoClient(uri) as client:
            changestream.consume(client[names[0]][names[1]], handler(stop), store, stop=stop,
                                 save_every=BATCH, watch_options=options)
        return

    async def main() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri)
        stop = asyncio.Event()
        try:
            await changestream.aio.consume(client[names[0]][names[1]], handler(stop), store,
                                           stop=stop, save_every=BATCH, watch_options=options)
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("raw", [False, True], ids=["dicts", "raw-events"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["sink", "mirror's-resnapshot-wrapper"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_commit_failing_behind_the_next_fetch_loses_nothing_and_stores_no_later_token(
    rs: ReplicaSet, names: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    mode: str, wrapped: bool, raw: bool,
) -> None:
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    coll = client[names[0]][names[1]]
    start = client.admin.command("ping")["operationTime"]
    for i in range(CHANGES):
        coll.insert_one({"_id": i, "v": "x" * i})
    path = tmp_path / "t"

    def store_for(sink: DeltaSink) -> Any:
        return DeltaResnapshot(sink, coll) if wrapped else sink

    sink = DeltaSink(path, app_id="a")
    store = store_for(sink)
    assert isinstance(store, BackgroundTokenStore)
    commits = Commits(monkeypatch, fail=2)  # batch 1 commits, batch 2 fails
    seen: list[Any] = []
    with pytest.raises(DiskFull):
        run_consume(rs.uri, names, store, commits, seen, start, mode, raw)
    # batch 1 was committed on the sink's own thread while the handler had batch 2's changes
    assert commits.threads[:2] == ["changestream-delta-commit"] * 2
    assert len(seen) > BATCH + 3
    # nothing past batch 1 is stored: the table holds batch 1 and its token only
    assert committed_versions(path, "a") == [0]
    reopened = DeltaSink(path, app_id="a")
    stored = reopened.load()
    assert stored is not None and stored.token == dict(seen[BATCH - 1])
    monkeypatch.undo()
    # the next run resumes after batch 1 and loses nothing
    again: list[Any] = []
    run_consume(rs.uri, names, store_for(reopened), None, again, None, mode, raw)
    assert again[0] == seen[BATCH]
    assert_mirrors(path, coll, "a")
    client.close()


def test_a_save_after_a_failed_commit_behind_commits_both_batches(
    rs: ReplicaSet, names: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The failure is raised by the next call, the failed batch's changes staged again in
    front: a retried save commits them with the newer ones, as one batch."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    coll = client[names[0]][names[1]]
    with changestream.watch(coll, max_await_time_ms=50, full_document="updateLookup") as stream:
        for i in range(6):
            coll.insert_one({"_id": i})
        changes = [stream.next() for _ in range(6)]
    sink = DeltaSink(tmp_path / "t", app_id="a")
    commits = Commits(monkeypatch, fail=1)
    commits.next_batch_seen.set()
    for change in changes[:3]:
        sink(change)
    sink.save_behind(changes[2]["_id"])
    for change in changes[3:]:
        sink(change)
    with pytest.raises(DiskFull):
        sink.save_behind(changes[5]["_id"])
    assert sink.load() is None  # nothing committed, no token stored
    sink.save(changes[5]["_id"])
    sink.flush()  # nothing under way: returns at once
    assert committed_versions(tmp_path / "t", "a") == [0]
    stored = DeltaSink(tmp_path / "t", app_id="a").load()
    assert stored is not None and stored.token == changes[5]["_id"]
    assert_mirrors(tmp_path / "t", coll, "a")
    client.close()


def test_a_staged_change_keeps_what_the_merge_reads_and_the_table_is_the_same(
    rs: ReplicaSet, names: tuple[str, str], tmp_path: Path,
) -> None:
    """The handler keeps a document change slim (the document as its JSON text: fewer
    objects for the garbage collector while the batch waits); the rows are those of the
    whole changes, deletes and updates whose document was gone included."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    coll = client[names[0]][names[1]]
    with changestream.watch(coll, max_await_time_ms=50, full_document="updateLookup") as stream:
        coll.insert_many([{"_id": i, "n": {"deep": [i, {"x": i}]}} for i in range(4)])
        coll.update_one({"_id": 1}, {"$set": {"v": 2}})
        coll.replace_one({"_id": 2}, {"r": True})
        coll.delete_one({"_id": 3})
        changes = [stream.next() for _ in range(7)]
    gone = {**changes[4], "fullDocument": None}  # its document was deleted before the lookup
    staged = [staged_change(change, RELAXED) for change in [*changes, gone]]
    gc.collect()
    assert not any(gc.is_tracked(change) for change in staged)  # nothing the collector walks
    assert '{"_id": 0, "n": {"deep": [0, {"x": 0}]}}' in staged[0]  # the document's text
    assert merge_columns(staged[-1:], full_document="updateLookup").ops == ["delete"]
    handled = DeltaSink(tmp_path / "handled", app_id="a", full_document="updateLookup")
    for change in changes:
        handled(change)
    handled.save(changes[-1]["_id"])
    whole = DeltaSink(tmp_path / "whole", app_id="a", full_document="updateLookup")
    assert whole.write(changes, 0, changes[-1]["_id"])
    assert table_state(tmp_path / "handled") == table_state(tmp_path / "whole") == {
        doc["_id"]: doc for doc in coll.find()}
    assert changes[4]["fullDocument"] is not None  # the caller's events are left as they were
    client.close()


def _event(n: int, op: str, key: Any, *, coll: str = "c", **fields: Any) -> dict[str, Any]:
    return {"_id": {"_data": f"82{n:08X}"}, "operationType": op, "ns": {"db": "d", "coll": coll},
            "documentKey": {"_id": key}, **fields}


def _collapsed(changes: list[Any], **options: Any) -> tuple[Any, ...]:
    columns = merge_columns(changes, **options)
    documents = [d if d is None or isinstance(d, str) else json_util.dumps(d)
                 for d in columns.documents]
    return columns.keys, columns.ops, documents, columns.cleared, columns.last_token


def test_staged_rows_collapse_as_the_whole_changes_do_mixed_with_other_events() -> None:
    """Staged rows (tuples), alone or in one batch with events that stay mappings (a
    snapshot record, a drop, an odd token), give the whole changes' merge columns and
    raise their errors."""
    oid = ObjectId("6553f1000000000000000001")
    snapshot = {"_id": {"_data": SNAPSHOT_MARK, "phase": "copy", "at": Timestamp(1, 1)},
                "operationType": "insert", "ns": {"db": "d", "coll": "c"},
                "documentKey": {"_id": 9}, "fullDocument": {"_id": 9}}
    batches: list[list[Any]] = [
        [_event(1, "insert", oid, fullDocument={"_id": oid, "v": 1}),
         _event(2, "insert", "k", fullDocument={"_id": "k"}),
         _event(3, "update", oid, fullDocument={"_id": oid, "v": 2}),
         _event(4, "delete", "k"), _event(5, "replace", 3, fullDocument={"_id": 3, "r": 1}),
         _event(6, "update", 7, fullDocument=None),  # gone at lookup: a delete
         _event(7, "update", oid, fullDocument={"_id": oid, "v": 3})],  # rows: last in order
        [snapshot, _event(1, "insert", 1, fullDocument={"_id": 1}),
         _event(2, "insert", 2, fullDocument={"_id": 2})],
        [_event(1, "insert", 1, fullDocument={"_id": 1}), _event(2, "drop", None),
         _event(3, "insert", 2, fullDocument={"_id": 2})],
        [_event(1, "insert", 1, fullDocument={"_id": 1}),
         {**_event(2, "insert", 2, fullDocument={"_id": 2}), "_id": {"_data": "8202", "x": 1}}],
    ]
    for batch in batches:
        staged = [staged_change(change, RELAXED) for change in batch]
        assert any(type(change) is tuple for change in staged)
        assert _collapsed(staged, full_document="updateLookup") == _collapsed(
            batch, full_document="updateLookup")
    two = [_event(1, "insert", 1, fullDocument={"_id": 1}),
           _event(2, "insert", 2, coll="other", fullDocument={"_id": 2})]
    for batch in (two, [staged_change(change, RELAXED) for change in two]):
        with pytest.raises(ValueError, match="group the changes by 'ns'"):
            merge_columns(batch)
    bare = [_event(1, "update", 1)]  # no fullDocument: the stream was opened without it
    for batch in (bare, [staged_change(change, RELAXED) for change in bare]):
        with pytest.raises(MissingDocumentError, match='"_data": "8200000001"'):
            merge_columns(batch, full_document="updateLookup")


ODD = [
    {"_id": 1, "s": "caf\u00e9 \u2028 \"q\" \\ \x01", "when": datetime.datetime(2026, 1, 2, 3, 4, 5, 678000),
     "old": datetime.datetime(1969, 7, 20, 20, 17), "d": Decimal128("1.10"), "nan": float("nan"),
     "big": Int64(2**62), "f": 1e20, "small": 1e-7, "neg": -0.0, "u": Binary.from_uuid(uuid.UUID(int=7)),
     "b": b"\x00\xff", "nested": {"a": [1, {"b": None}], "e": {}}, "oid": ObjectId("6553f1000000000000000001")},
    {"_id": {"k": [1, "x"]}, "v": 1},
    {"_id": ObjectId("6553f1000000000000000002"), "r": Regex("^a", "i"), "t": Timestamp(5, 1)},
    {"_id": "text key", "min": MinKey(), "max": MaxKey(), "code": Code("f()")},
]


def test_raw_events_give_the_table_dict_events_give_byte_for_byte(
    rs: ReplicaSet, names: tuple[str, str], tmp_path: Path,
) -> None:
    """``mirror`` reads ``RawBSONDocument`` events: the sink stages their bytes and the commit
    behind decodes them. The rows are the same texts as from decoded events, odd values and
    keys included, and the first load's snapshot records work as before."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    coll = client[names[0]][names[1]]
    coll.insert_one({"_id": "before", "v": 0})  # each sink's first load: one snapshot record
    sinks = {raw: DeltaSink(tmp_path / f"raw{raw}", app_id="a", full_document="updateLookup")
             for raw in (False, True)}

    def run(raw: bool, count: int) -> list[Any]:
        options: dict[str, Any] = {"max_await_time_ms": 50, "full_document": "updateLookup"}
        if raw:
            options["document_class"] = RawBSONDocument
        stop = threading.Event()
        seen: list[Any] = []

        def handle(change: Any) -> None:
            sinks[raw](change)
            seen.append(change)
            if len(seen) == count:
                stop.set()

        changestream.consume(coll, handle, sinks[raw], stop=stop, save_every=3,
                             watch_options=options, initial_snapshot=True)
        return seen

    for raw in (False, True):
        assert len(run(raw, 1)) == 1
    coll.insert_many(ODD)
    coll.update_one({"_id": 1}, {"$set": {"s": "\u00fcber"}})
    coll.delete_one({"_id": "text key"})
    coll.update_one({"_id": {"k": [1, "x"]}}, {"$inc": {"v": 1}})
    for raw in (False, True):
        seen = run(raw, len(ODD) + 3)
        assert {type(change) for change in seen} == {RawBSONDocument if raw else dict}
    tables = {raw: sink.read_current().sort_by("_key") for raw, sink in sinks.items()}
    assert tables[True].column("document").to_pylist() == tables[False].column("document").to_pylist()
    assert tables[True].column("_key").to_pylist() == tables[False].column("_key").to_pylist()
    assert len(tables[True]) == len(ODD)  # "before" and the odd ones but the deleted one
    relaxed = json_util.RELAXED_JSON_OPTIONS  # the collection, as json_util writes it
    assert dict(zip(tables[True].column("_key").to_pylist(),
                    tables[True].column("document").to_pylist(), strict=True)) == {
        json_util.dumps(doc["_id"], json_options=relaxed, separators=(",", ":")):
        json_util.dumps(doc, json_options=relaxed) for doc in coll.find()}
    client.close()


class HeldCompaction:
    """The sink's compactions, each held until :attr:`release` is set; ``fail``: then it
    fails (a full disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
        self.real: Callable[..., Any] = delta_sink.compact
        self.started, self.release = threading.Event(), threading.Event()
        self.fail = fail
        monkeypatch.setattr(delta_sink, "compact", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.started.set()
        if not self.release.wait(30):
            raise AssertionError("the compaction was never released")
        if self.fail:
            raise DiskFull(28, "No space left on device")
        return self.real(*args, **kwargs)


def _six_changes(coll: Any) -> list[Any]:
    with changestream.watch(coll, max_await_time_ms=50, full_document="updateLookup") as stream:
        for i in range(6):
            coll.insert_one({"_id": i, "v": "x" * i})
        coll.update_one({"_id": 1}, {"$set": {"v": "again"}})
        return [stream.next() for _ in range(7)]


def test_a_compaction_behind_does_not_hold_the_next_batch_up_and_comes_before_its_commit(
    rs: ReplicaSet, names: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stream waits for a batch's commit, not for the rewrite after it: the next batch
    is handed over while that compaction runs, and committed after it (the compaction
    replaces the log it read, so a commit between would make it conflict)."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    coll = client[names[0]][names[1]]
    changes = _six_changes(coll)
    path = tmp_path / "t"
    sink = DeltaSink(path, app_id="a", max_log_rows=1,  # a compaction after each batch
                     full_document="updateLookup")
    held = HeldCompaction(monkeypatch)
    for change in changes[:3]:
        sink(change)
    sink.save_behind(changes[2]["_id"])
    assert held.started.wait(30)  # batch 0 committed, its compaction under way (held)
    for change in changes[3:]:
        sink(change)
    sink.save_behind(changes[6]["_id"])  # returns while the compaction is held
    assert not held.release.is_set()
    assert committed_versions(path, "a") == [0]  # batch 1 waits for the compaction
    held.release.set()
    sink.flush()
    assert committed_versions(path, "a") == [0, 1]
    kinds = ["compaction" if "changestream.compaction" in c else c.get("changestream.version")
             for c in reversed(deltalake.DeltaTable(str(path)).history())]
    assert kinds.index("compaction") < kinds.index("1"), kinds
    assert_mirrors(path, coll, "a")
    stored = DeltaSink(path, app_id="a").load()
    assert stored is not None and stored.token == changes[6]["_id"]
    client.close()


def test_a_compaction_failing_behind_fails_the_next_batch_which_a_retried_save_commits(
    rs: ReplicaSet, names: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The failure of a compaction after batch 0 is raised by the sink's next call; batch
    1, which waited for it, is not committed and is staged again: nothing is lost, and
    the stored token stays batch 0's until a retried save commits batch 1."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    coll = client[names[0]][names[1]]
    changes = _six_changes(coll)
    path = tmp_path / "t"
    sink = DeltaSink(path, app_id="a", max_log_rows=1, full_document="updateLookup")
    held = HeldCompaction(monkeypatch, fail=True)
    for change in changes[:3]:
        sink(change)
    sink.save_behind(changes[2]["_id"])
    assert held.started.wait(30)
    for change in changes[3:]:
        sink(change)
    sink.save_behind(changes[6]["_id"])
    held.release.set()
    with pytest.raises(DiskFull):
        sink.flush()
    assert committed_versions(path, "a") == [0]
    stored = DeltaSink(path, app_id="a").load()
    assert stored is not None and stored.token == changes[2]["_id"]
    monkeypatch.undo()
    sink.save(changes[6]["_id"])  # batch 1's changes, staged again
    assert committed_versions(path, "a") == [0, 1]
    assert_mirrors(path, coll, "a")
    client.close()


def test_the_first_batch_of_changes_is_cut_at_a_quarter_of_the_bytes_then_whole_batches(
    rs: ReplicaSet, names: tuple[str, str], tmp_path: Path,
) -> None:
    """The first batch's commit starts early (its conversion would otherwise wait a whole
    batch with a core idle); every later batch, and every first load's commit, is whole."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
    coll = client[names[0]][names[1]]
    coll.insert_many([{"_id": -i, "v": "y" * 1000} for i in range(1, 121)])  # the copy
    sink = DeltaSink(tmp_path / "t", app_id="a", batch_bytes=40 * 1024)
    with changestream.watch(coll, max_await_time_ms=50) as stream:
        coll.insert_many([{"_id": i, "v": "x" * 1000} for i in range(240)])
        changes = [stream.next() for _ in range(240)]

    def cut(staged: list[Any]) -> int:
        """Changes staged until the sink says its batch is full."""
        for n, change in enumerate(staged, 1):
            sink(change)
            if sink.batch_full():
                sink.save(change["_id"])
                return n
        raise AssertionError("the batch never filled")

    first = cut(changes)
    second = cut(changes[first:])
    third = cut(changes[first + second:])
    assert first >= 5 and 3 * first <= second <= 5 * first, (first, second)
    assert third == second
    # a first load's commits are cut at the whole bytes (a base file each), from the start
    loaded = DeltaSink(tmp_path / "load", app_id="a", batch_bytes=40 * 1024)
    stop, seen = threading.Event(), []

    def handle(change: Any) -> None:
        loaded(change)
        seen.append(change)
        if len(seen) == 120:
            stop.set()

    changestream.consume(coll, handle, loaded, stop=stop,
                         watch_options={"max_await_time_ms": 50}, initial_snapshot=True,
                         save_every=10_000)
    actions = pyarrow.table(
        deltalake.DeltaTable(str(tmp_path / "load")).get_add_actions(flatten=True))
    rows = actions.column("num_records").to_pylist()
    assert sum(rows) >= 120 and min(rows[:-1] or rows) >= second - 2, (rows, second)
    client.close()
