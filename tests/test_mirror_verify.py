"""``changestream mirror --verify`` and ``DeltaSink.verify``: the table against the collection at
the table's position, by hashes of key ranges; damage Delta cannot see is caught."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pymongo import MongoClient

pytest.importorskip("deltalake", reason="the delta extra is not installed")

from changestream.delta import DeltaSink, merge_table
from changestream.testing import ReplicaSet


def mirror(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
                          capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def rs() -> Iterator[ReplicaSet]:
    with ReplicaSet("8.0") as replica_set:
        yield replica_set


@pytest.fixture
def mirrored(rs: ReplicaSet, tmp_path: Path) -> Iterator[tuple[Any, list[str]]]:
    """300 documents mirrored with ``--until-idle``: (collection, mirror's arguments)."""
    with MongoClient(rs.uri) as client:
        name = tmp_path.name[-20:].replace("-", "_")
        coll = client.db[name]
        coll.insert_many([{"_id": i, "v": i, "pad": "x" * 100} for i in range(300)])
        args = [rs.uri, "--db", "db", "--coll", name, "--to", str(tmp_path / "t")]
        done = mirror(*args, "--until-idle", "0.2")
        assert done.returncode == 0, done.stderr
        yield coll, args


def test_verify_is_0_on_an_equal_table_at_its_own_position(mirrored: Any) -> None:
    coll, args = mirrored
    coll.update_one({"_id": 3}, {"$set": {"v": -3}})  # after the table's position: not counted
    coll.delete_one({"_id": 4})
    checked = mirror(*args, "--verify")
    assert checked.returncode == 0, checked.stderr
    assert "verified" in checked.stderr and "300 rows in the table" in checked.stderr


def test_verify_catches_an_add_action_removed_from_the_log(mirrored: Any) -> None:
    """The damage of issue 31: Delta sees a valid, empty table; mirror used to exit 0."""
    _, args = mirrored
    log = Path(args[args.index("--to") + 1]) / "_delta_log"
    for commit in log.glob("*.json"):
        kept = [line for line in commit.read_text().splitlines(keepends=True)
                if not line.startswith('{"add"')]
        commit.write_text("".join(kept))
    checked = mirror(*args, "--verify")
    assert checked.returncode == 1, checked.stderr
    assert "0 rows in the table" in checked.stderr
    assert "300 missing, 0 extra, 0 different" in checked.stderr


def test_verify_counts_missing_extra_and_different_keys_with_examples(mirrored: Any) -> None:
    coll, args = mirrored
    path = args[args.index("--to") + 1]
    sink = DeltaSink(path, app_id="changestream-mirror")
    assert sink.verify(coll).ok
    vandal = DeltaSink(path, app_id="vandal")  # another writer damages the table
    changes = [
        {"_id": {"_data": f"82{n:032X}"}, "operationType": op, "ns": {"db": "db", "coll": coll.name},
         "documentKey": {"_id": key}, **({"fullDocument": doc} if doc is not None else {})}
        for n, (op, key, doc) in enumerate([
            ("replace", 7, {"_id": 7, "v": "wrong", "pad": "x" * 100}),
            ("insert", 1000, {"_id": 1000}),
            ("delete", 8, None),
            ("delete", 9, None),
        ])
    ]
    vandal.write(merge_table(changestream_merge_ready(changes)), 0)
    result = sink.verify(coll)
    assert (result.missing, result.extra, result.different) == (2, 1, 1)
    assert result.examples == {"missing": ["8", "9"], "extra": ["1000"], "different": ["7"]}
    assert not result.ok and "2 missing, 1 extra, 1 different" in result.summary()


@pytest.mark.parametrize("drift", [{"on_mismatch": "rescue"}, {"evolve": True},
                                   {"on_mismatch": "rescue", "evolve": True}])
def test_verify_a_table_with_rescued_or_evolved_columns(
    rs: ReplicaSet, tmp_path: Path, drift: dict[str, Any]
) -> None:
    """The collection's side is converted as the sink converts (``_rescued``, evolved columns),
    without counting rescues or growing the sink's columns."""
    import changestream

    with MongoClient(rs.uri) as client:
        coll = client.db[f"drift_{len(drift)}_{int(drift.get('evolve', False))}"]
        misfit = "text" if drift.get("on_mismatch") == "rescue" else -1  # evolve alone: fails
        coll.insert_many([{"_id": i, "v": i, **({"extra": "x"} if i % 3 else {"v": misfit})}
                          for i in range(60)])
        sink = DeltaSink(tmp_path / "t", schema="v BIGINT", full_document="updateLookup",
                         **drift)
        coll.insert_one({"_id": "end"})
        stop = threading.Event()

        def handle(change: Any) -> None:
            sink(change)
            if change["documentKey"]["_id"] == "end":
                stop.set()

        changestream.consume(coll, handle, sink, initial_snapshot=True, save_every=1000,
                             stop=stop, watch_options={"max_await_time_ms": 50})
        assert sink.rescued > 0 or "extra" in sink.columns.names
        rescued, columns = sink.rescued, sink.columns
        result = sink.verify(coll)
        assert result.ok, result.summary()
        assert (sink.rescued, sink.columns) == (rescued, columns)


def changestream_merge_ready(changes: list[dict[str, Any]]) -> Any:
    import changestream

    return changestream.merge_ready(changes)


def test_verify_catches_up_first_when_the_server_no_longer_keeps_the_position(
    mirrored: Any
) -> None:
    coll, args = mirrored
    admin = coll.database.client.admin
    admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 1})
    try:
        coll.insert_one({"_id": "later"})
        time.sleep(1.5)  # the history window (1 s) passes the table's position
        coll.insert_one({"_id": "later2"})  # a write prunes what is older than the window
    finally:
        admin.command({"setParameter": 1, "minSnapshotHistoryWindowInSeconds": 300})
    checked = mirror(*args, "--verify")
    assert checked.returncode == 0, checked.stderr
    assert "catching up first" in checked.stderr
    assert "302 rows in the table, 302 documents" in checked.stderr


def test_row_hashes_depend_on_the_bytes_only_not_on_where_they_sit() -> None:
    """Slices, chunking, nulls, empty strings and typed columns hash the same wherever they are."""
    import pyarrow as pa

    from changestream._delta_verify import hash_rows, new_powers

    table = pa.table({
        "_key": [f'{{"$oid":"{i:024x}"}}' for i in range(50)] + ['"a"', '"b"', "", '"é"'],
        "document": [f'{{"v":{i}}}' for i in range(50)] + [None, "", "x", '{"s":"é"}'],
        "qty": [*range(53), None],
    })
    powers = new_powers()
    keys, rows = hash_rows(table, ["document", "qty"], powers)
    assert len(set(rows.tolist())) == len(rows), "distinct rows, distinct hashes"
    for start in (1, 7, 50):
        k, r = hash_rows(table.slice(start), ["document", "qty"], powers)
        assert (k == keys[start:]).all() and (r == rows[start:]).all()
    changed = table.set_column(1, "document", pa.array(
        [f'{{"v":{i}}}' for i in range(49)] + ['{"v":48}', None, "", "x", '{"s":"é"}']))
    _, other = hash_rows(changed, ["document", "qty"], powers)
    assert (other != rows).tolist() == [False] * 49 + [True] + [False] * 4


def test_the_streamed_table_side_is_the_current_state(mirrored: Any) -> None:
    """verify streams the table (base batches without the logged keys, then the log's newest
    upserts) instead of holding read_current() (~240 bytes a row: 3.2 GB at 10M rows); the
    rows are the current state's, with updates, deletes and a re-insert in the log."""
    from changestream._delta_verify import current_batches

    coll, args = mirrored
    path = args[args.index("--to") + 1]
    sink = DeltaSink(path, app_id="changestream-mirror")
    vandal = DeltaSink(path, app_id="other")
    ops = [("replace", 7, {"_id": 7, "v": 70}), ("delete", 8, None), ("insert", 500, {"_id": 500}),
           ("delete", 9, None), ("insert", 9, {"_id": 9, "back": True}), ("delete", 500, None)]
    for n, (op, key, doc) in enumerate(ops):
        change = {"_id": {"_data": f"82{n:032X}"}, "operationType": op,
                  "ns": {"db": "db", "coll": coll.name}, "documentKey": {"_id": key},
                  **({"fullDocument": doc} if doc is not None else {})}
        vandal.write(merge_table(changestream_merge_ready([change])), n)
    table = sink.table()
    assert table is not None
    streamed = pa.Table.from_batches(list(current_batches(table, ["document"]))).sort_by("_key")
    current = sink.read_current()
    assert streamed.num_rows == 299  # 300 - 8, + 9 again, 500 inserted then deleted
    assert streamed.to_pylist() == current.select(["_key", "document"]).to_pylist()
