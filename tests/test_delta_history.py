"""The history table (``DeltaSink(history=...)``, ``mirror --history``): every change, SCD type 2.

Per key the intervals chain without gaps or overlaps; the collection as of a
time equals the state recorded at that time (Python, and the documented SQL
run by DuckDB); replays, a crash between the two tables' commits and a
``kill -9`` of ``mirror --history`` leave both tables exactly once.
"""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

deltalake = pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")
pa = pytest.importorskip("pyarrow", reason="needs pyarrow (the 'delta' extra)")

import pymongo  # noqa: E402
from bson import json_util  # noqa: E402
from bson.timestamp import Timestamp  # noqa: E402
from delta_support import committed_versions, table_state, write_mix  # noqa: E402

from changestream.delta import AS_OF_SQL, HISTORY_SQL, DeltaSink  # noqa: E402
from changestream.testing import ReplicaSet  # noqa: E402

NS = {"db": "d", "coll": "c"}
START = 1_800_000_000


class Clock:
    """Synthetic change events: tokens in order, cluster times that a test moves on, the state."""

    def __init__(self) -> None:
        self.seconds = START
        self.increment = 0
        self.count = 0
        self.state: dict[Any, Any] = {}
        self.states: dict[int, dict[Any, Any]] = {}
        """The state at the end of each second (recorded when the clock moves on)."""

    def tick(self) -> None:
        self.states[self.seconds] = dict(self.state)
        self.seconds += 1
        self.increment = 0

    def event(self, operation: str, key: Any, value: Any = None, *, same_time: bool = False) -> dict[str, Any]:
        if not same_time:
            self.increment += 1
        self.count += 1  # a transaction's changes share the cluster time, not the token
        token = {"_data": f"82{self.seconds:08X}{self.increment:08X}{self.count:08X}"
                          "2B042C0100296E5A1004"}
        change: dict[str, Any] = {"_id": token, "operationType": operation, "ns": NS,
                                  "clusterTime": Timestamp(self.seconds, self.increment),
                                  "documentKey": {"_id": key}}
        if operation == "delete":
            self.state.pop(key, None)
        elif operation != "drop":
            document = {"_id": key, "v": value}
            change["fullDocument"] = document
            self.state[key] = document
        else:
            del change["documentKey"]
            self.state.clear()
        return change


def apply(sink: DeltaSink, changes: list[dict[str, Any]]) -> None:
    for change in changes:
        sink(change)
    sink.save(changes[-1]["_id"])


def at(seconds: int) -> datetime:
    """The end of that second (a timestamp inside it, after its changes)."""
    return datetime.fromtimestamp(seconds + 0.5, timezone.utc)


def documents(rows: pa.Table) -> dict[Any, Any]:
    found = {json_util.loads(r["_key"]): json_util.loads(r["document"]) for r in rows.to_pylist()}
    assert len(found) == rows.num_rows, "a key twice"
    return found


def assert_chained(history: pa.Table) -> None:
    """Per key, in ``_seq`` order: each row's valid_to is the next one's valid_from; the last is open."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for row in history.to_pylist():
        by_key.setdefault(row["_key"], []).append(row)
    for key, rows in by_key.items():
        seqs = [row["_seq"] for row in rows]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), key
        for earlier, later in itertools.pairwise(rows):
            assert earlier["valid_to"] == later["valid_from"], (key, earlier, later)
            assert earlier["valid_from"] <= later["valid_from"], key
        assert rows[-1]["valid_to"] is None, key


def as_of_by_duckdb(path: Path, seconds: int) -> dict[Any, Any]:
    """AS_OF_SQL, as docs/mirror.md gives it, run by DuckDB over the table's rows."""
    duckdb = pytest.importorskip("duckdb", reason="the SQL is checked with DuckDB (delta-tests)")
    history = deltalake.DeltaTable(str(path)).to_pyarrow_table()  # noqa: F841 (read by DuckDB)
    time_ = f"TIMESTAMPTZ '{at(seconds).isoformat()}'"
    query = f"SELECT _key, document FROM ({AS_OF_SQL.format(table='history', time=time_)})"
    found = {json_util.loads(k): json_util.loads(d) for k, d in duckdb.sql(query).fetchall()}
    assert len(found) == len(duckdb.sql(query).fetchall()), "a key twice"
    return found


def random_batches(clock: Clock, rng: random.Random, batches: int) -> list[list[dict[str, Any]]]:
    out = []
    for n in range(batches):
        batch = []
        for i in range(rng.randrange(1, 12)):
            key = rng.randrange(8)
            roll = rng.random()
            if roll < 0.15:  # a transaction: several changes at one cluster time
                batch.append(clock.event("update", key, f"{n}.{i}.a"))
                batch.append(clock.event("delete", key, same_time=True))
                batch.append(clock.event("insert", key, f"{n}.{i}.b", same_time=True))
            elif roll < 0.35:
                batch.append(clock.event("delete", key))
            else:
                batch.append(clock.event(rng.choice(["insert", "update", "replace"]), key,
                                         f"{n}.{i}"))
            if rng.random() < 0.4:
                clock.tick()
        rng.shuffle(batch)  # arrival order does not matter: token order does
        out.append(batch)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_history_chains_and_as_of_equals_the_recorded_states(tmp_path: Path, seed: int) -> None:
    clock, rng = Clock(), random.Random(seed)
    sink = DeltaSink(tmp_path / "t", app_id="a", history=tmp_path / "h", log_fraction=0.3)
    for batch in random_batches(clock, rng, 12):
        apply(sink, batch)
    clock.tick()
    history = sink.read_history()
    assert_chained(history)
    assert history.num_rows == sum(1 for _ in history.column("_key"))
    for seconds, state in clock.states.items():
        assert documents(sink.read_as_of(at(seconds))) == state, seconds
    for seconds in rng.sample(sorted(clock.states), 5):
        assert as_of_by_duckdb(tmp_path / "h", seconds) == clock.states[seconds], seconds
    assert documents(sink.read_as_of(at(START - 1))) == {}  # before the first change
    assert table_state(tmp_path / "t") == clock.state
    assert committed_versions(tmp_path / "h", "a") == committed_versions(tmp_path / "t", "a")


def test_the_history_sql_gives_valid_to_and_every_change_is_a_row(tmp_path: Path) -> None:
    duckdb = pytest.importorskip("duckdb", reason="the SQL is checked with DuckDB (delta-tests)")
    clock = Clock()
    sink = DeltaSink(tmp_path / "t", app_id="a", history=tmp_path / "h")
    first = [clock.event("insert", 1, "a"), clock.event("update", 1, "b")]
    clock.tick()
    apply(sink, [*first, clock.event("delete", 1)])  # three changes of one key in one batch
    history = deltalake.DeltaTable(str(tmp_path / "h")).to_pyarrow_table()  # noqa: F841
    rows = duckdb.sql(HISTORY_SQL.format(table="history") + " ORDER BY _seq").fetchall()
    names = [c[0] for c in duckdb.sql(HISTORY_SQL.format(table="history")).description]
    got = [dict(zip(names, row, strict=True)) for row in rows]
    assert [(r["_operation"], r["_op"]) for r in got] == [
        ("insert", "upsert"), ("update", "upsert"), ("delete", "delete")]
    assert [r["valid_to"] for r in got[:2]] == [got[1]["valid_from"], got[2]["valid_from"]]
    assert got[2]["valid_to"] is None and got[2]["document"] is None
    assert got[0]["valid_from"] == datetime.fromtimestamp(START, timezone.utc)
    assert json_util.loads(got[0]["_token"]) == first[0]["_id"]
    assert got[0]["_cluster_time"] == got[0]["valid_from"]


def test_a_drop_ends_every_live_document_in_the_history(tmp_path: Path) -> None:
    clock = Clock()
    sink = DeltaSink(tmp_path / "t", app_id="a", history=tmp_path / "h")
    apply(sink, [clock.event("insert", k, "x") for k in range(3)])
    clock.tick()
    apply(sink, [clock.event("insert", 3, "y"), clock.event("delete", 0), clock.event("drop", None)])
    clock.tick()
    history = sink.read_history()
    assert_chained(history)
    drops = [r["_key"] for r in history.to_pylist() if r["_operation"] == "drop"]
    assert drops == ["1", "2", "3"]
    assert documents(sink.read_as_of(at(START))) == clock.states[START]
    assert documents(sink.read_as_of(at(START + 1))) == {}


def test_replays_are_no_ops_in_both_tables(tmp_path: Path) -> None:
    clock = Clock()
    sink = DeltaSink(tmp_path / "t", app_id="spark", history=tmp_path / "h")
    zero = [clock.event("insert", k, "x") for k in range(3)]
    one = [clock.event("update", 1, "y"), clock.event("delete", 2)]
    assert sink.write(zero, version=0, token=zero[-1]["_id"])
    assert sink.write(one, version=1, token=one[-1]["_id"])
    before = sink.read_history()
    assert not sink.write(zero, version=0)
    assert not DeltaSink(tmp_path / "t", app_id="spark", history=tmp_path / "h").write(one, version=1)
    assert sink.read_history().equals(before)
    assert before.num_rows == 5
    with pytest.raises(ValueError, match="lists of changes"):
        sink.write(pa.table({"_key": ["1"], "_op": ["upsert"], "document": ["{}"]}), version=2)


def test_a_crash_between_the_two_commits_keeps_each_change_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The history commits batch v, the process dies before the table's commit; the run after it
    cuts the batch differently (more changes): the history's orphan is replaced, not doubled."""
    import changestream._delta_sink as sink_module

    clock = Clock()
    sink = DeltaSink(tmp_path / "t", app_id="a", history=tmp_path / "h")
    apply(sink, [clock.event("insert", k, "x") for k in range(4)])
    clock.tick()
    batch = [clock.event("update", 1, "y"), clock.event("delete", 2)]
    more = [clock.event("insert", 9, "z")]
    clock.tick()
    real = sink_module.write_deltalake

    def dies(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt("killed between the history's commit and the table's")

    monkeypatch.setattr(sink_module, "write_deltalake", dies)
    with pytest.raises(KeyboardInterrupt):
        apply(sink, batch)
    monkeypatch.setattr(sink_module, "write_deltalake", real)
    assert committed_versions(tmp_path / "h", "a") == [0, 1]  # the orphan
    assert committed_versions(tmp_path / "t", "a") == [0]
    restarted = DeltaSink(tmp_path / "t", app_id="a", history=tmp_path / "h")
    apply(restarted, batch + more)  # resumed after the table's token: cut anew
    history = restarted.read_history()
    assert history.num_rows == 4 + 3
    assert_chained(history)
    assert documents(restarted.read_as_of(at(START + 1))) == clock.state
    assert documents(restarted.read_as_of(at(START))) == clock.states[START]
    assert table_state(tmp_path / "t") == clock.state


def test_a_history_path_equal_to_the_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="another path"):
        DeltaSink(tmp_path / "t", history=tmp_path / "t")
    with pytest.raises(ValueError, match="keeps no history"):
        DeltaSink(tmp_path / "t").read_history()


def test_a_merge_table_is_refused_by_a_sink_with_history(tmp_path: Path) -> None:
    """``stage()`` (foreach_batch's path) and ``write()`` of a merge table would leave the
    history without the batch: both are refused, nothing is written."""
    from changestream import merge_ready
    from changestream.delta import merge_table

    clock = Clock()
    sink = DeltaSink(tmp_path / "t", app_id="a", history=tmp_path / "h")
    table = merge_table(merge_ready([clock.event("insert", 1, "x")]))
    with pytest.raises(ValueError, match="history"):
        sink.stage(table)
    with pytest.raises(ValueError, match="history"):
        sink.write(table, 0)
    assert sink.table() is None and not (tmp_path / "h").exists()


# -- mirror --history, kill -9 -----------------------------------------------------------------
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


def mirror(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "changestream", "mirror", *args, "--no-status"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def versions_or_empty(path: str, app_id: str) -> list[int]:
    try:
        return committed_versions(path, app_id)
    except Exception:  # not a table yet
        return []


def test_mirror_history_survives_kill_9_with_both_tables_exactly_once(
    coll: Any, rs: ReplicaSet, tmp_path: Path
) -> None:
    coll.insert_many([{"_id": i, "v": "before"} for i in range(100)])
    target, history = str(tmp_path / "t"), str(tmp_path / "h")
    args = [rs.uri, "--db", coll.database.name, "--coll", coll.name, "--to", target,
            "--history", history, "--batch", "15", "--batch-seconds", "0.2"]
    # Every change, in order, as the collection's own stream sees it: the reference history.
    with coll.watch(full_document="updateLookup") as reference:
        writer = threading.Thread(target=write_mix, args=(coll, 400, 5))
        first = mirror(*args)
        try:
            deadline = time.monotonic() + 60
            while not versions_or_empty(target, "changestream-mirror"):
                assert time.monotonic() < deadline and first.poll() is None, first.stderr
                time.sleep(0.05)
            writer.start()
            time.sleep(random.Random(7).uniform(0.3, 1.0))
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            writer.join(120)
        finally:
            first.kill()
        coll.insert_one({"_id": "end"})
        events = []
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the reference stream did not reach the end"
            change = reference.try_next()
            if change is not None:
                events.append(change)
                if change["documentKey"]["_id"] == "end":
                    break
    second = mirror(*args, "--until-idle", "2")
    _out, err = second.communicate(timeout=180)
    assert second.returncode == 0, err
    assert "from its last commit" in err
    final = {doc["_id"]: doc for doc in coll.find()}
    assert table_state(target) == final
    # A kill between a batch's two commits leaves it in the history only: the restart's
    # batch of that version replaces it there (a second commit of the same version).
    assert committed_versions(target, "changestream-mirror") == sorted(set(committed_versions(
        history, "changestream-mirror")))
    rows = DeltaSink(target, app_id="changestream-mirror", history=history).read_history()
    assert_chained(rows)
    # Exactly once: the stream's changes are the history's non-snapshot rows, each once.
    streamed = [r for r in rows.to_pylist() if r["_operation"] != "snapshot"]
    tokens = sorted(json_util.dumps(json_util.loads(r["_token"])) for r in streamed)
    assert len(tokens) == len(set(tokens)), "a change twice in the history"
    expected = sorted(json_util.dumps(e["_id"]) for e in events)
    assert tokens == expected
    snapshot = [r for r in rows.to_pylist() if r["_operation"] == "snapshot"]
    assert sorted(json_util.loads(r["_key"]) for r in snapshot) == list(range(100))
    # The history's last version of each key is the table.
    now = datetime.now(timezone.utc)
    as_of = DeltaSink(target, app_id="changestream-mirror", history=history).read_as_of(now)
    assert documents(as_of) == final


def test_mirror_history_bad_arguments_exit_2_with_one_line(tmp_path: Path) -> None:
    base = ["mongodb://x", "--db", "d", "--coll", "c", "--to", str(tmp_path / "t")]
    for extra in (["--history", str(tmp_path / "t")], ["--history", "/no/such/dir/h"]):
        proc = subprocess.run([sys.executable, "-m", "changestream", "mirror", *base, *extra],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "--history" in proc.stderr
