"""Schemas that drift (``on_mismatch="rescue"``, ``evolve=True``; ``mirror --on-mismatch``, ``--evolve``).

Under rescue nothing stops and nothing is lost: each document is given back by
its ``_key``, its non-null columns and its ``_rescued`` JSON. Under evolve a
new field becomes a column. The stats and the exporters count rescued values.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

deltalake = pytest.importorskip("deltalake", reason="needs the 'delta' extra (deltalake)")
pa = pytest.importorskip("pyarrow", reason="needs pyarrow (the 'delta' extra)")

import pymongo  # noqa: E402
from bson import json_util  # noqa: E402
from bson.objectid import ObjectId  # noqa: E402
from bson.timestamp import Timestamp  # noqa: E402

from changestream import ConsumeStats  # noqa: E402
from changestream.delta import DeltaSink, DocumentSchemaError  # noqa: E402
from changestream.testing import ReplicaSet  # noqa: E402

NS = {"db": "d", "coll": "c"}
DDL = "_id BIGINT, name STRING, qty INT, addr STRUCT<city: STRING, zip: INT>, tags ARRAY<STRING>"


class Events:
    def __init__(self) -> None:
        self.count = 0
        self.state: dict[Any, Any] = {}

    def insert(self, document: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        self.state[document["_id"]] = document
        return {"_id": {"_data": f"82{1_800_000_000:08X}{self.count:08X}2B042C0100296E5A1004"},
                "operationType": "insert", "ns": NS, "clusterTime": Timestamp(1_800_000_000,
                                                                              self.count),
                "documentKey": {"_id": document["_id"]}, "fullDocument": document}


def apply(sink: DeltaSink, changes: list[dict[str, Any]]) -> None:
    for change in changes:
        sink(change)
    sink.save(changes[-1]["_id"])


def rows(path: Path) -> list[dict[str, Any]]:
    return deltalake.DeltaTable(str(path)).to_pyarrow_table().to_pylist()


def reconstruct(row: dict[str, Any]) -> dict[str, Any]:
    """The document from ``_key``, the non-null data columns and ``_rescued``."""
    document = {"_id": json_util.loads(row["_key"])}
    for name, value in row.items():
        if (name.startswith("_") and name != "_id") or value is None:
            continue
        document[name] = value
    if row.get("_rescued") is not None:
        document.update(json_util.loads(row["_rescued"]))
    return document


def without_nulls(document: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in document.items() if v is not None}


DRIFTING = [
    {"_id": 1, "name": "pen", "qty": 3, "addr": {"city": "Oslo", "zip": 150}, "tags": ["a"]},
    {"_id": "abc", "name": "cup", "qty": 1},                       # an _id of another type
    {"_id": ObjectId("6650f0a1b2c3d4e5f6a7b8c9"), "qty": 2},       # and another
    {"_id": 2, "name": "ink", "qty": "many"},                      # a string in an int column
    {"_id": 3, "name": "pad", "qty": 2**40},                       # too large for INT
    {"_id": 4, "name": "box", "colour": "red", "size": {"w": 1}},  # fields outside the schema
    {"_id": 5, "addr": {"city": "Rome", "zip": "00100"}},          # nested: a misfit inside
    {"_id": 6, "addr": {"city": "Bern", "zip": 3000, "canton": "BE"}},  # nested: a new key
    {"_id": 7, "tags": ["x", {"deep": 1}]},                        # an array of mixed values
    {"_id": 8, "addr": "not a document"},
]


def test_rescue_keeps_every_value_and_counts_them(tmp_path: Path) -> None:
    events = Events()
    sink = DeltaSink(tmp_path / "t", app_id="a", schema=DDL, on_mismatch="rescue")
    apply(sink, [events.insert(dict(doc)) for doc in DRIFTING])
    found = {json_util.loads(r["_key"]): r for r in rows(tmp_path / "t")}
    assert len(found) == len(DRIFTING)
    for document in DRIFTING:
        row = found[document["_id"]]
        back = reconstruct(row)
        if isinstance(document["_id"], ObjectId):  # an ObjectId in a BIGINT: rescued, as itself
            assert json_util.loads(row["_rescued"]) == {"_id": document["_id"]}
        assert back == without_nulls(document), document
    assert found[1]["_rescued"] is None  # nothing rescued: null
    assert json_util.loads(found[2]["_rescued"]) == {"qty": "many"} and found[2]["qty"] is None
    assert json_util.loads(found[4]["_rescued"]) == {"colour": "red", "size": {"w": 1}}
    assert found[6]["addr"] is None  # a new key inside: the whole field is rescued
    assert json_util.loads(found[6]["_rescued"])["addr"]["canton"] == "BE"
    # Rescued values (fields): _id x2, qty x2, colour, size, addr x3, tags.
    assert sink.rescued == 10
    schema = pa.schema(deltalake.DeltaTable(str(tmp_path / "t")).schema().to_arrow())
    assert schema.names[-1] == "_rescued" and schema.field("_rescued").type == pa.string()


def test_fail_is_still_the_default_and_names_the_field(tmp_path: Path) -> None:
    events = Events()
    sink = DeltaSink(tmp_path / "t", app_id="a", schema=DDL)
    with pytest.raises(DocumentSchemaError, match=r"field '_id' of the document with _id \"abc\""):
        apply(sink, [events.insert({"_id": "abc"})])
    assert sink.rescued == 0
    with pytest.raises(ValueError, match="on_mismatch must be 'fail' or 'rescue'"):
        DeltaSink(tmp_path / "u", schema=DDL, on_mismatch="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need a schema"):
        DeltaSink(tmp_path / "u", on_mismatch="rescue")


def test_evolve_adds_new_fields_as_columns_and_a_restart_keeps_them(tmp_path: Path) -> None:
    events = Events()
    ddl = "_id BIGINT, qty INT"
    sink = DeltaSink(tmp_path / "t", app_id="a", schema=ddl, evolve=True)
    apply(sink, [events.insert({"_id": 1, "qty": 1})])
    apply(sink, [events.insert({"_id": 2, "qty": 2, "price": 2.5, "note": "n",
                                "meta": {"k": [1, 2]}}),
                 events.insert({"_id": 3, "qty": 3, "price": 3, "flag": None})])
    table = deltalake.DeltaTable(str(tmp_path / "t"))
    schema = pa.schema(table.schema().to_arrow())
    assert schema.names == ["_key", "_seq", "_op", "_id", "qty", "price", "note", "meta"]
    assert schema.field("price").type == pa.float64()  # ints and doubles: double
    assert schema.field("meta").type == pa.string()    # a document: JSON
    current = {r["_id"]: r for r in sink.read_current().to_pylist()}
    assert current[1]["price"] is None and current[2]["price"] == 2.5 and current[3]["price"] == 3
    assert json_util.loads(current[2]["meta"]) == {"k": [1, 2]}
    # A restart with the original schema takes the evolved columns; a later field adds one more.
    again = DeltaSink(tmp_path / "t", app_id="a", schema=ddl, evolve=True)
    apply(again, [events.insert({"_id": 4, "qty": 4, "note": "m", "flag": True})])
    assert again.columns.names == ["_id", "qty", "price", "note", "meta", "flag"]
    again.finish()
    plain = {r["_id"]: r for r in deltalake.DeltaTable(str(tmp_path / "t")).to_pyarrow_table()
             .to_pylist()}
    assert plain[4]["flag"] is True and plain[1]["flag"] is None and plain[4]["note"] == "m"
    # Without evolve the evolved table is refused, naming the columns.
    with pytest.raises(Exception, match="has the columns"):
        DeltaSink(tmp_path / "t", app_id="a", schema=ddl).load()
    # A value that does not fit an evolved column is a mismatch (delta-rs widens no type).
    with pytest.raises(DocumentSchemaError, match="field 'price'"):
        apply(again, [events.insert({"_id": 5, "price": "cheap"})])


def test_evolve_with_rescue_keeps_misfits_and_nothing_is_lost(tmp_path: Path) -> None:
    events = Events()
    sink = DeltaSink(tmp_path / "t", app_id="a", schema="_id BIGINT, qty INT", evolve=True,
                     on_mismatch="rescue")
    documents = [{"_id": 1, "qty": 1, "price": 2.5}, {"_id": 2, "qty": "x", "price": "cheap"},
                 {"_id": "k", "qty": 3, "new": [1]}]
    apply(sink, [events.insert(dict(d)) for d in documents[:1]])
    apply(sink, [events.insert(dict(d)) for d in documents[1:]])
    assert sink.columns.names == ["_id", "qty", "_rescued", "price", "new"]
    found = {json_util.loads(r["_key"]): r for r in sink.read_current().to_pylist()}
    for document in documents:
        back = reconstruct(found[document["_id"]])
        if "new" in back:
            back["new"] = json_util.loads(back["new"])  # a new array column: JSON text
        assert back == document
    assert sink.rescued == 3  # qty, price of 2; _id of "k"


def test_reporting_adds_the_rescued_count_per_run(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", app_id="a", schema=DDL, on_mismatch="rescue")
    seen: list[ConsumeStats] = []
    report = sink.reporting(seen.append)
    events = Events()

    def stats(run: str, final: bool = False) -> ConsumeStats:
        return ConsumeStats(handled=0, events_per_second=0.0, lag=timedelta(0), position=None,
                            resumes=0, reopens=0, stored=0, last_stored_token_time=None,
                            elapsed=0.0, final=final, run_id=run)

    apply(sink, [events.insert({"_id": 1, "qty": "x"})])
    report(stats("one"))
    apply(sink, [events.insert({"_id": 2, "qty": "y", "z": 1})])
    report(stats("one", final=True))
    report(stats("two"))
    apply(sink, [events.insert({"_id": 3, "w": 1})])
    report(stats("two"))
    assert [s.rescued for s in seen] == [1, 3, 0, 1]  # each run counts from 0
    try:
        from prometheus_client import CollectorRegistry

        from changestream.exporters.prometheus import PrometheusExporter
    except ImportError:
        return
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry=registry, stream="s")
    for s in seen:
        exporter(s)
    assert registry.get_sample_value("changestream_values_rescued_total", {"stream": "s"}) == 4


def test_history_rows_carry_the_rescued_column(tmp_path: Path) -> None:
    events = Events()
    sink = DeltaSink(tmp_path / "t", app_id="a", schema=DDL, on_mismatch="rescue",
                     history=tmp_path / "h")
    apply(sink, [events.insert({"_id": 1, "qty": "x", "extra": True})])
    history = sink.read_history().to_pylist()
    assert json_util.loads(history[0]["_rescued"]) == {"qty": "x", "extra": True}
    assert sink.rescued == 2  # counted once, not again for the history


# -- mirror --on-mismatch rescue ----------------------------------------------------------------
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


def test_mirror_rescue_goes_on_and_says_how_many_were_rescued(
    coll: Any, rs: ReplicaSet, tmp_path: Path
) -> None:
    coll.insert_many([{"_id": 1, "qty": 3}, {"_id": 2, "qty": "many", "x": 1}])
    target = str(tmp_path / "t")
    args = [rs.uri, "--db", coll.database.name, "--coll", coll.name, "--to", target,
            "--schema", "_id BIGINT, qty INT", "--on-mismatch", "rescue", "--until-idle", "1",
            "--no-status"]
    done = subprocess.run([sys.executable, "-m", "changestream", "mirror", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("; 2 values rescued into _rescued")
    found = {json_util.loads(r["_key"]): r for r in rows(tmp_path / "t")}
    assert json_util.loads(found[2]["_rescued"]) == {"qty": "many", "x": 1}
    for args_ in (["--on-mismatch", "rescue"], ["--evolve"]):
        bad = subprocess.run([sys.executable, "-m", "changestream", "mirror", rs.uri, "--db", "d",
                              "--coll", "c", "--to", str(tmp_path / "u"), *args_],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "need --schema" in bad.stderr, bad.stderr


def test_evolve_with_history_and_merge_tables_refused(tmp_path: Path) -> None:
    events = Events()
    sink = DeltaSink(tmp_path / "t", app_id="a", schema="_id BIGINT", evolve=True,
                     history=tmp_path / "h")
    apply(sink, [events.insert({"_id": 1})])
    apply(sink, [events.insert({"_id": 2, "new": "n"})])
    history = {r["_key"]: r for r in sink.read_history().to_pylist()}
    assert history["1"]["new"] is None and history["2"]["new"] == "n"
    with pytest.raises(ValueError, match="not a merge table"):
        sink.write(pa.table({"_key": ["3"], "_op": ["upsert"], "_id": [3]}), version=5)
    with pytest.raises(ValueError, match="not a merge table"):
        sink.stage(pa.table({"_key": ["3"], "_op": ["upsert"], "_id": [3]}))
