"""The document column's text stays ``json_util.dumps``'s byte for byte, and a first load's
shortcuts (no sort of keys already in order, no sort of a merge of ordered files, merge passes
only every 16 commits) leave the table as before."""

from __future__ import annotations

import datetime
import random
import sys
from pathlib import Path
from typing import Any

import bson
import deltalake
import pyarrow as pa
from bson import json_util
from bson.binary import Binary
from bson.code import Code
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.regex import Regex
from bson.timestamp import Timestamp
from bson.tz_util import FixedOffset, utc
from hypothesis import given, settings
from hypothesis import strategies as st

from changestream._delta_json import relaxed_dumps, relaxed_key, relaxed_text
from changestream._delta_merger import SmallFileMerger
from changestream._delta_rows import RELAXED, base_rows
from changestream._js_code import decode_held

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.delta_table_bench import document

_RELAXED = json_util.RELAXED_JSON_OPTIONS
_ZONES = st.sampled_from([None, datetime.timezone.utc, utc, FixedOffset(0, "Z"),
                          datetime.timezone(datetime.timedelta(0)),
                          datetime.timezone(datetime.timedelta(hours=2)),
                          datetime.timezone(datetime.timedelta(minutes=-90))])
_DATES = st.builds(lambda d, tz: d.replace(tzinfo=tz),
                   st.datetimes(min_value=datetime.datetime(1960, 1, 1),
                                max_value=datetime.datetime(9999, 12, 30)), _ZONES)


@settings(max_examples=400, deadline=None)
@given(when=_DATES, micro=st.sampled_from([0, 1, 999, 1000, 1001, 137000, 999999]))
def test_datetimes_of_every_zone_and_millisecond_edge_are_json_utils_text(
    when: datetime.datetime, micro: int
) -> None:
    for value in (when, when.replace(microsecond=micro)):
        doc = {"at": value, "nested": [{"at": value}]}
        assert relaxed_dumps(doc) == json_util.dumps(doc, json_options=_RELAXED)


def test_realistic_orders_are_json_utils_text() -> None:
    rng = random.Random(7)
    for n in range(2000):
        doc = document(n * 7919, n % 5, rng)
        assert relaxed_dumps(doc) == json_util.dumps(doc, json_options=_RELAXED)
        key = doc["_id"]
        assert relaxed_key(key) == json_util.dumps(key, json_options=_RELAXED,
                                                   separators=(",", ":"))


def test_odd_documents_are_json_utils_text() -> None:
    epoch = datetime.datetime(1970, 1, 1)
    for doc in [
        {"_id": ObjectId(), "a": epoch, "b": epoch.replace(microsecond=999)},  # '.000' left out
        {"a": datetime.datetime(1969, 12, 31, 23, 59, 59, 999000)},  # before 1970: $numberLong
        {"a": epoch.replace(tzinfo=datetime.timezone(datetime.timedelta(hours=-1)))},
        {"é": "ü\u2028\x00", "n": float("nan"), "i": float("inf")},
        {"a": [], "b": {}, "c": [[{}]], "d": None, "e": True, "f": -0.0, "g": 2**63 - 1},
        {"a": b"\x00\xff", "b": 1.5e-300, "c": ObjectId(b"\x00" * 12)},
    ]:
        assert relaxed_dumps(doc) == json_util.dumps(doc, json_options=_RELAXED)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**31, 2**31 - 1), st.integers(-2**63, 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.builds(ObjectId, st.binary(min_size=12, max_size=12)),
    st.datetimes(min_value=datetime.datetime(1960, 1, 1)).map(
        lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000)),
    st.builds(lambda b: Binary(b, 0), st.binary(max_size=4)),
    st.builds(lambda i: Decimal128(str(i)), st.integers(-999, 999)),
    st.builds(lambda s: Regex(s, "i"), st.text(alphabet="ab^$", max_size=3)),
    st.builds(Timestamp, st.integers(0, 2**31), st.integers(0, 9)),
    st.builds(Code, st.text(max_size=6)),  # JavaScript code (type 0x0D): a str subclass
    st.builds(lambda c, v: Code(c, {"v": v}), st.text(max_size=4), st.integers(0, 9)),  # 0x0F
    st.just(Int64(-1)),  # 0xFF bytes, and carriage returns, for the byte check below
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.text(alphabet="abc\r", min_size=1, max_size=3), inner, max_size=3)),
    max_leaves=12)


@settings(max_examples=600, deadline=None)
@given(document=st.dictionaries(st.text(alphabet="xyz", min_size=1, max_size=2), _VALUES,
                                max_size=5), key=_SCALARS)
def test_documents_of_every_bson_type_are_json_utils_text_from_bytes_and_decoded(
    document: dict[str, Any], key: Any
) -> None:
    """JavaScript code decodes to a ``str`` subclass the C encoder writes as a plain string:
    every path still gives ``{"$code": ...}`` as ``json_util`` does."""
    raw = bson.encode({"_id": key, **document})
    decoded = bson.decode(raw)
    expected = json_util.dumps(decoded, json_options=_RELAXED)
    assert relaxed_text(raw) == expected
    assert relaxed_dumps(decoded) == expected
    marked = decode_held(raw)
    assert relaxed_dumps(marked, held=True) == expected
    key_text = json_util.dumps(decoded["_id"], json_options=_RELAXED, separators=(",", ":"))
    assert relaxed_key(decoded["_id"]) == relaxed_key(marked["_id"]) == key_text


def test_a_mirror_of_raw_events_stores_javascript_code_as_json_util_does(tmp_path: Path) -> None:
    """Through the sink: a stream's change (read from its bytes) and a snapshot record
    (decoded in the handler) of documents holding code, with and without scope."""
    from changestream.delta import DeltaSink

    documents = [{"_id": 1, "f": Code("return 1"), "n": [{"g": Code("x", {"a": Code("y")})}]},
                 {"_id": 2, "f": Code("\r"), "nan": float("nan")},
                 {"_id": Code("k"), "v": 1}]
    sink = DeltaSink(tmp_path / "t", app_id="a", full_document="updateLookup")
    sink.load()
    ns = {"db": "shop", "coll": "orders"}
    sink(RawBSONDocument(bson.encode(
        {"_id": {"_data": "snapshot", "phase": "copy"}, "operationType": "insert", "ns": ns,
         "documentKey": {"_id": 1}, "fullDocument": documents[0]})))
    sink.save({"_data": "snapshot", "phase": "stream", "at": Timestamp(1_800_000_000, 1)})
    for n, doc in enumerate(documents[1:], start=2):
        sink(RawBSONDocument(bson.encode(
            {"_id": {"_data": f"82{n:016X}2B042C0100296E5A1004"}, "operationType": "insert",
             "clusterTime": Timestamp(1_800_000_000, n), "ns": ns,
             "documentKey": {"_id": doc["_id"]}, "fullDocument": doc})))
    sink.save({"_data": "82" + "F" * 16})
    sink.finish()
    stored = dict(zip(*deltalake.DeltaTable(str(tmp_path / "t")).to_pyarrow_table(
        columns=["_key", "document"]).to_pydict().values(), strict=True))
    assert stored == {json_util.dumps(doc["_id"], json_options=_RELAXED, separators=(",", ":")):
                      json_util.dumps(doc, json_options=_RELAXED) for doc in documents}
    assert '{"$code": "x", "$scope": {"a": {"$code": "y"}}}' in stored["1"]


def _records(keys: list[Any]) -> list[dict[str, Any]]:
    return [{"_id": {"_data": "snapshot", "phase": "copy"}, "operationType": "insert",
             "documentKey": {"_id": key}, "fullDocument": {"_id": key, "v": i}}
            for i, key in enumerate(keys)]


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.one_of(st.integers(-1000, 1000), st.text(max_size=3)),
                     unique_by=lambda k: (type(k), k), max_size=30))
def test_base_rows_come_out_sorted_by_key_in_any_order_they_came(keys: list[Any]) -> None:
    rows = base_rows(_records(keys), None, RELAXED, None)
    texts = rows.column("_key").to_pylist()
    assert texts == sorted(texts)  # "10" < "9": an _id order is not always the text order
    assert sorted(rows.column("document").to_pylist()) == sorted(
        json_util.dumps({"_id": k, "v": i}, json_options=_RELAXED) for i, k in enumerate(keys))


def test_merge_passes_start_every_nth_commit_and_again_after_a_failure() -> None:
    calls: list[int] = []
    outcomes = [OSError("hiccup"), None, None]

    def merge() -> Any:
        calls.append(1)
        outcome = outcomes.pop(0) if outcomes else None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    merger = SmallFileMerger(merge, lambda c: None, every=4)
    for _ in range(3):
        merger.after_commit()
        merger.wait()
    assert calls == []  # fewer commits than a run needs: no pass reads the table
    merger.after_commit()
    merger.wait()
    assert len(calls) == 1  # failed: logged
    merger.after_commit()  # the next commit tries again
    merger.close()
    assert len(calls) == 2


def test_a_first_load_of_unordered_files_merges_into_sorted_files(tmp_path: Path) -> None:
    from changestream.delta import DeltaSink

    sink = DeltaSink(tmp_path / "t", app_id="a")
    sink.file_rows = 400  # files under 200 rows are small
    sink.load()
    rng = random.Random(3)
    keys: list[Any] = []
    for start in range(0, 320, 20):
        batch: list[Any] = [f"k{n:04d}" for n in range(start, start + 20)]
        rng.shuffle(batch)  # out of order within a save: sorted before it is written
        keys += batch
        for record in _records(batch):
            sink(record)
        sink.save({"_id": 1, "_data": "snapshot", "phase": "copy"} | {"lastId": start})
    sink.finish()
    table = deltalake.DeltaTable(str(tmp_path / "t"))
    assert len(table.file_uris()) < 16  # merged
    for path in table.file_uris():
        import pyarrow.parquet as pq

        column = pq.read_table(path).column("_key").to_pylist()
        assert column == sorted(column)
    got = table.to_pyarrow_table().column("_key").to_pylist()
    assert sorted(got) == sorted(json_util.dumps(k, separators=(",", ":")) for k in keys)
    assert pa.compute.count_distinct(pa.array(got)).as_py() == 320
