"""A lost history recovered by a resnapshot leaves the Delta table equal to the collection.

``on_history_lost="resnapshot"`` copies the collection again between a
``snapshotStart`` and a ``snapshotEnd`` record; the sink drops every key the
new copy did not bring. Under concurrent inserts, updates and deletes, with a
stop in the middle of the copy, the table must end equal to the collection.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

import changestream
from changestream.testing import ReplicaSet

deltalake = pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")

from delta_support import plain_state, table_state  # noqa: E402

from changestream.delta import DeltaSink  # noqa: E402

DOCS = 200
OPLOG = 400
FAST = {"max_await_time_ms": 50, "full_document": "updateLookup", "copy_batch_size": 10}


@pytest.fixture
def coll() -> Iterator[Any]:
    with ReplicaSet("8.0", oplog_max_entries=OPLOG) as rs:
        client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(rs.uri)
        yield client[f"t_{uuid.uuid4().hex[:8]}"]["c"]
        client.close()


def mirror_until(coll: Any, sink: DeltaSink, until: Any, *, stop_after_records: int | None = None,
                 during_copy: Any = None, **options: Any) -> list[str]:
    """``consume`` into ``sink`` until the change of ``_id`` ``until`` (or a number of
    resnapshot records); ``during_copy`` runs in a thread from the copy's first record."""
    stop = threading.Event()
    kinds: list[str] = []
    threads: list[threading.Thread] = []

    def handle(change: Any) -> None:
        kind = change["operationType"]
        kinds.append(kind)
        if during_copy is not None and not threads and "snapshot" in change:
            threads.append(threading.Thread(target=during_copy))
            threads[-1].start()
        sink(change)
        if change.get("documentKey", {}).get("_id") == until:
            stop.set()
        if stop_after_records is not None and kinds.count("insert") >= stop_after_records:
            stop.set()

    changestream.consume(coll, handle, sink, initial_snapshot=True, watch_options=FAST,
                         save_every=7, stop=stop, **options)
    for thread in threads:
        thread.join()
    return kinds


def churn(coll: Any, seed: int, ops: int, sentinel: str) -> None:
    """Inserts, updates and deletes (about a fifth), then a sentinel insert."""
    rnd = random.Random(seed)
    for n in range(ops):
        key = rnd.randrange(DOCS + 60)
        roll = rnd.random()
        if roll < 0.2:
            coll.delete_one({"_id": key})
        elif roll < 0.6:
            coll.update_one({"_id": key}, {"$set": {"v": n, "s": seed}}, upsert=True)
        else:
            coll.replace_one({"_id": key}, {"_id": key, "r": n, "s": seed}, upsert=True)
    coll.insert_one({"_id": sentinel})


def lose_history(coll: Any, sink: DeltaSink) -> None:
    """A mirrored table, then more writes (deletes among them) than the oplog holds."""
    coll.insert_many([{"_id": i, "v": 0} for i in range(DOCS)])
    coll.insert_one({"_id": "ready"})
    mirror_until(coll, sink, "ready")
    assert table_state(sink.path) == {d["_id"]: d for d in coll.find()}
    coll.delete_many({"_id": {"$lt": 40}})  # gone while the history is lost
    churn(coll, seed=1, ops=OPLOG + 100, sentinel="lost")


def test_a_resnapshot_under_concurrent_writes_drops_the_deleted_documents(
    coll: Any, tmp_path: Path
) -> None:
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup", max_log_rows=50)
    lose_history(coll, sink)
    gaps: list[changestream.HistoryGap] = []
    kinds = mirror_until(coll, sink, "after", on_history_lost="resnapshot", gap=gaps.append,
                         during_copy=lambda: churn(coll, seed=2, ops=150, sentinel="after"))
    assert [g.action for g in gaps] == ["resnapshot"]
    assert table_state(sink.path) == {d["_id"]: d for d in coll.find()}
    assert kinds.count("snapshotStart") == 1 and kinds.count("snapshotEnd") == 1
    assert kinds.index("snapshotStart") < kinds.index("snapshotEnd")
    sink.finish()  # compaction after the resnapshot keeps it
    assert table_state(sink.path) == {d["_id"]: d for d in coll.find()}


def test_a_resnapshot_stopped_mid_copy_continues_and_drops_once(coll: Any, tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup")
    lose_history(coll, sink)
    first = mirror_until(coll, sink, "never", on_history_lost="resnapshot", gap=lambda gap: None,
                         stop_after_records=60)
    compacted = sink.compact()  # waits: the end needs the rows' numbers
    # a new process: only the table says a resnapshot is under way
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup")
    churn(coll, seed=3, ops=100, sentinel="later")
    second = mirror_until(coll, sink, "later")
    assert table_state(sink.path) == {d["_id"]: d for d in coll.find()}
    assert "snapshotStart" in first and "snapshotEnd" not in first
    assert "snapshotStart" not in second and second.count("snapshotEnd") == 1
    assert compacted is None, "no compaction while the resnapshot is under way"
    history = deltalake.DeltaTable(str(tmp_path / "t")).history()
    marked = [c for c in history if "changestream.resnapshot_from" in c]
    assert marked, "the commits of the resnapshot carry its mark"
    assert "changestream.resnapshot_from" not in history[0], "the end closed it"


def test_mirror_on_history_lost_resnapshot_leaves_the_table_equal(tmp_path: Path) -> None:
    with ReplicaSet("8.0", oplog_max_entries=OPLOG) as rs, \
            pymongo.MongoClient(rs.uri) as client:
        coll = client.db.c
        coll.insert_many([{"_id": i, "v": 0} for i in range(DOCS)])
        target = str(tmp_path / "t")
        args = [sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "db",
                "--coll", "c", "--to", target, "--no-status", "--until-idle", "0.2"]
        first = subprocess.run(args, capture_output=True, text=True, timeout=180)
        assert first.returncode == 0, first.stderr
        coll.delete_many({"_id": {"$lt": 40}})
        churn(coll, seed=4, ops=OPLOG + 100, sentinel="lost")
        refused = subprocess.run(args, capture_output=True, text=True, timeout=180)
        assert refused.returncode == 1, refused.stderr
        healed = subprocess.run([*args, "--on-history-lost", "resnapshot"], capture_output=True,
                                text=True, timeout=180)
        assert healed.returncode == 0, healed.stderr
        assert "copying the collection into the table again" in healed.stderr
        assert plain_state(target) == {d["_id"]: d for d in coll.find()}


def test_the_history_keeps_a_recopy_and_its_deletes(coll: Any, tmp_path: Path) -> None:
    """``history=`` with a recopy: the copy's commits and the end's deletes reach the history
    (as of now it equals the collection) at the same versions as the table's."""
    from datetime import datetime, timezone

    from bson import json_util
    from delta_support import committed_versions

    sink = DeltaSink(tmp_path / "t", full_document="updateLookup", history=tmp_path / "h")
    lose_history(coll, sink)
    mirror_until(coll, sink, "after", on_history_lost="resnapshot", gap=lambda gap: None,
                 during_copy=lambda: churn(coll, seed=5, ops=60, sentinel="after"))
    expected = {d["_id"]: d for d in coll.find()}
    assert table_state(sink.path) == expected
    now = sink.read_as_of(datetime(2100, 1, 1, tzinfo=timezone.utc)).to_pylist()
    found = {json_util.loads(r["_key"]): json_util.loads(r["document"]) for r in now}
    assert len(found) == len(now), "a key twice in the history's present"
    assert found == expected
    ends = [r for r in sink.read_history().to_pylist() if r["_operation"] == "snapshotEnd"]
    assert ends and all(r["_op"] == "delete" and r["valid_from"] is not None for r in ends)
    assert committed_versions(tmp_path / "h", "changestream") == \
        committed_versions(tmp_path / "t", "changestream")
