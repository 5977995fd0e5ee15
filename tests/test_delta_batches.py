"""A Delta sink's batch is bounded by its bytes as well as by ``save_every``.

``consume`` saves every ``save_every`` changes; a sink that stages documents also
asks for a save once they hold ``batch_bytes`` (``BatchingTokenStore``), so a batch
of large documents holds about that much memory, whatever the count. ``mirror``'s
defaults (``BATCH_CHANGES``, ``BATCH_BYTES``) are what ``--batch`` and
``--batch-mb`` start from.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from bson.raw_bson import RawBSONDocument
from pymongo.collection import Collection

import changestream

deltalake = pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")

from delta_support import assert_mirrors  # noqa: E402

from changestream._consumer.saves import SaveSchedule  # noqa: E402
from changestream.delta import BATCH_BYTES, BATCH_CHANGES, DatabaseSink, DeltaSink  # noqa: E402
from changestream.stores import BatchingTokenStore, MemoryTokenStore  # noqa: E402

PAD = "x" * 2_000
"""Each document's filler: a raw event of about 2.2 KB."""


def mirror_until(coll: Collection[dict[str, Any]], sink: Any, count: int, **options: Any) -> None:
    """``consume`` into ``sink`` (raw events, as ``mirror`` reads them) until ``count`` changes."""
    stop = threading.Event()
    seen = [0]

    def handle(change: Any) -> None:
        sink(change)
        seen[0] += 1
        if seen[0] >= count:
            stop.set()

    changestream.consume(coll, handle, sink, stop=stop, watch_options={
        "full_document": "updateLookup", "max_await_time_ms": 100,
        "document_class": RawBSONDocument}, **options)


def batch_sizes(path: Path) -> list[int]:
    """Rows appended by each of the table's batch commits, oldest first."""
    history = deltalake.DeltaTable(str(path)).history()
    return [int(commit["operationMetrics"]["num_added_rows"]) for commit in reversed(history)
            if "changestream.version" in commit and commit.get("operation") == "WRITE"]


def test_a_sink_asks_for_a_save_once_its_staged_changes_hold_batch_bytes(
        test_coll: Collection[dict[str, Any]], tmp_path: Path) -> None:
    test_coll.insert_one({"_id": "seed"})
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup", batch_bytes=20_000)
    assert isinstance(sink, BatchingTokenStore)
    mirror_until(test_coll, sink, 1, initial_snapshot=True)  # the copy: one document
    test_coll.insert_many([{"_id": n, "pad": PAD} for n in range(120)])
    mirror_until(test_coll, sink, 120, save_every=BATCH_CHANGES)
    sink.finish()
    assert_mirrors(tmp_path / "t", test_coll, "changestream")
    sizes = batch_sizes(tmp_path / "t")[1:]  # after the copy's commit
    # ~2.2 KB an event: a save once 20,000 bytes are staged, i.e. every 9-10 changes;
    # save_every alone would have committed all 120 in one batch
    assert len(sizes) >= 10, sizes
    assert max(sizes) <= 10, sizes


def test_batch_bytes_none_leaves_the_batch_to_save_every(
        test_coll: Collection[dict[str, Any]], tmp_path: Path) -> None:
    test_coll.insert_one({"_id": "seed"})
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup", batch_bytes=None)
    mirror_until(test_coll, sink, 1, initial_snapshot=True)
    test_coll.insert_many([{"_id": n, "pad": PAD} for n in range(60)])
    mirror_until(test_coll, sink, 60, save_every=25)
    sink.finish()
    assert_mirrors(tmp_path / "t", test_coll, "changestream")
    assert batch_sizes(tmp_path / "t")[1:] == [25, 25, 10]


def test_the_default_bound_does_not_cut_a_batch_of_small_documents(
        test_coll: Collection[dict[str, Any]], tmp_path: Path) -> None:
    test_coll.insert_one({"_id": "seed"})
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup")
    assert sink.batch_bytes == BATCH_BYTES
    mirror_until(test_coll, sink, 1, initial_snapshot=True)
    test_coll.insert_many([{"_id": n, "v": n} for n in range(300)])
    mirror_until(test_coll, sink, 300, save_every=100)
    assert batch_sizes(tmp_path / "t")[1:] == [100, 100, 100]
    assert not sink.batch_full()


def test_batch_full_is_false_once_the_batch_is_saved(
        test_coll: Collection[dict[str, Any]], tmp_path: Path) -> None:
    with changestream.watch(test_coll, document_class=RawBSONDocument,
                            full_document="updateLookup") as stream:
        test_coll.insert_many([{"_id": n, "pad": PAD} for n in range(4)])
        events = [stream.next() for _ in range(4)]
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup",
                     batch_bytes=len(events[0].raw) * 2)
    sink(events[0])
    assert sink.batch_full()  # the first batch of changes: a quarter of the bytes
    sink.save(events[0]["_id"])
    assert not sink.batch_full()  # nothing staged: nothing to save
    sink(events[1])
    assert not sink.batch_full()  # every later batch: the whole bytes
    sink(events[2])
    assert sink.batch_full()
    sink.save(events[2]["_id"])
    assert not sink.batch_full()
    sink(events[3])
    assert not sink.batch_full()  # counted from the save, not from the start


def test_a_database_mirror_saves_once_one_table_holds_batch_bytes(
        test_coll: Collection[dict[str, Any]], tmp_path: Path) -> None:
    db = test_coll.database
    db.a.insert_one({"_id": "seed"})
    first = DatabaseSink(tmp_path, db, full_document="updateLookup")
    first.load()
    first.finish()  # a's table copied: its changes now go to its sink
    sink = DatabaseSink(tmp_path, db, full_document="updateLookup", batch_bytes=20_000)
    assert isinstance(sink, BatchingTokenStore)
    sink.load()
    db.a.insert_many([{"_id": n, "pad": PAD} for n in range(40)])
    db.b.insert_many([{"_id": n} for n in range(3)])  # a new collection: copied meanwhile
    stop = threading.Event()
    saves: list[int] = []
    seen = [0]

    def handle(change: Any) -> None:
        sink(change)
        if change.get("ns", {}).get("coll") == "a":
            seen[0] += 1
        if seen[0] >= 40:
            stop.set()

    real_save = sink.save

    def save(token: Any, *, batch_id: int | None = None) -> None:
        saves.append(seen[0])
        real_save(token, batch_id=batch_id)

    sink.save = save  # type: ignore[method-assign]
    try:
        changestream.consume(sink.open_stream, handle, sink, stop=stop,
                             save_every=BATCH_CHANGES)
    finally:
        sink.close()
    # the decoded events' documents (~2 KB of text each): a save every ~10 changes of a
    assert len([n for n in saves if 0 < n < 40]) >= 3, saves


def test_the_schedule_saves_when_the_store_says_its_batch_is_full() -> None:
    full = [False]
    schedule = SaveSchedule(1_000, None, full=lambda: full[0])
    assert not schedule.on_change({"_data": "01"})
    full[0] = True
    assert schedule.on_change({"_data": "02"})
    plain = SaveSchedule(1_000, None)  # a store without a bound of its own
    assert not plain.on_change({"_data": "01"})
    assert not isinstance(MemoryTokenStore(), BatchingTokenStore)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "64MB"])
def test_a_bad_batch_bytes_is_refused_with_its_name(value: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^batch_bytes must be an integer >= 1, not "):
        DeltaSink(tmp_path / "t", batch_bytes=value)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "changestream", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_mirror_help_gives_the_batch_defaults() -> None:
    result = run_cli("mirror", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert f"commit after N changes at most (default {BATCH_CHANGES})" in text
    assert f"about MB megabytes (default {BATCH_BYTES >> 20})" in text


@pytest.mark.parametrize("value", ["0", "-3", "lots"])
def test_a_bad_batch_mb_exits_2_with_one_line(value: str, tmp_path: Path) -> None:
    result = run_cli("mirror", "mongodb://127.0.0.1:1/", "--db", "d", "--coll", "c",
                     "--to", str(tmp_path / "t"), "--batch-mb", value)
    assert result.returncode == 2
    assert "--batch-mb" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_first_loads_commits_hold_one_base_file_of_records_and_the_streams_do_not(
        test_coll: Collection[dict[str, Any]], tmp_path: Path) -> None:
    """The copy's commits hold at most ``file_rows`` snapshot records (each is one base file,
    the size compactions rewrite), whatever ``save_every``; the stream's are not cut so."""
    test_coll.insert_many([{"_id": n, "v": 0} for n in range(250)])
    sink = DeltaSink(tmp_path / "t", full_document="updateLookup", batch_bytes=None)
    sink.file_rows = 100
    mirror_until(test_coll, sink, 250, initial_snapshot=True, save_every=BATCH_CHANGES)
    test_coll.insert_many([{"_id": n, "v": 1} for n in range(250, 500)])
    mirror_until(test_coll, sink, 250, save_every=BATCH_CHANGES)
    sink.finish()
    assert_mirrors(tmp_path / "t", test_coll, "changestream")
    sizes = batch_sizes(tmp_path / "t")
    assert sizes[:3] == [100, 100, 50], sizes  # the copy: a base file of records a commit
    assert 250 in sizes[3:], sizes  # the stream's 250 changes: one batch, not cut at 100
