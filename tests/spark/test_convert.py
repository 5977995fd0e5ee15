"""Event → Arrow conversion, the schema DDL, offsets and option parsing (no streaming query)."""

from __future__ import annotations

import datetime
import decimal
import json
import pickle
from typing import Any

import bson
import pyarrow as pa
import pytest
from bson import Binary, Decimal128, Int64, ObjectId, Timestamp, json_util
from bson.raw_bson import RawBSONDocument
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import DataType, StructType
from spark_support import PANDAS_WARNING

from changestream.spark_adapter import SchemaMismatchError, event_ddl
from changestream.spark_adapter._config import SourceConfig
from changestream.spark_adapter._convert import EventConverter, relaxed_json
from changestream.spark_adapter._offsets import make_offset, offset_token, offset_watch_option

pytestmark = [pytest.mark.spark, pytest.mark.filterwarnings(PANDAS_WARNING)]

TOKEN = {"_data": "82650000010000000A2B042C0100296E5A1004AB"}


def _converter(spark: Any, schema: str | None = None, publish: bool = False) -> EventConverter:
    ddl = event_ddl(schema, publish_full_document_only=publish)
    arrow = to_arrow_schema(DataType.fromDDL(ddl), timezone="UTC")
    return pickle.loads(pickle.dumps(EventConverter(arrow, publish_full_document_only=publish)))


def _update_event() -> dict[str, Any]:
    return {
        "txnNumber": Int64(7),
        "lsid": {"id": Binary(b"0123456789abcdef", 4)},
        "_id": TOKEN,
        "operationType": "update",
        "clusterTime": Timestamp(1700000000, 5),
        "wallTime": datetime.datetime(2024, 5, 1, 12, 30),
        "fullDocument": {"_id": ObjectId("650000000000000000000001"), "qty": 3.0},
        "ns": {"db": "shop", "coll": "orders"},
        "documentKey": {"_id": ObjectId("650000000000000000000001")},
        "updateDescription": {"updatedFields": {"qty": 3.0}, "removedFields": ["old"]},
    }


def test_relaxed_json_matches_json_util_for_every_bson_type() -> None:
    document = {
        "oid": ObjectId("650000000000000000000001"),
        "int": 1,
        "long": Int64(2**40),
        "double": 1.5,
        "nan": float("nan"),
        "date": datetime.datetime(2020, 1, 1),
        "old": datetime.datetime(1960, 1, 1),
        "dec": Decimal128("1.10"),
        "bin": Binary(b"ab", 4),
        "bytes": b"xy",
        "ts": Timestamp(1, 2),
        "nested": [{"a": None, "b": True}],
        "raw": RawBSONDocument(b"\x0c\x00\x00\x00\x10a\x00\x01\x00\x00\x00\x00"),
    }
    expected = json_util.dumps(
        {**document, "raw": {"a": 1}}, json_options=json_util.RELAXED_JSON_OPTIONS
    )
    assert relaxed_json(document) == expected
    assert relaxed_json(None) is None


def test_envelope_row_keeps_cluster_time_increment_and_transaction_fields(spark: Any) -> None:
    row = _converter(spark).convert([_update_event()]).to_pylist()[0]
    assert row["resume_token"] == TOKEN["_data"]
    assert (row["operation_type"], row["database"], row["collection"]) == (
        "update",
        "shop",
        "orders",
    )
    assert row["cluster_time"] == {"t": 1700000000, "i": 5}
    assert row["wall_time"] == datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc)
    assert json.loads(row["document_key"]) == {"_id": {"$oid": "650000000000000000000001"}}
    assert json.loads(row["update_description"]) == {
        "updatedFields": {"qty": 3.0},
        "removedFields": ["old"],
    }
    assert row["txn_number"] == 7 and json.loads(row["lsid"])["id"]["$binary"]["subType"] == "04"
    assert row["full_document_before_change"] is None and row["to_database"] is None


def test_full_document_schema_types_documents_and_fails_fast_on_mismatch(spark: Any) -> None:
    converter = _converter(spark, "_id STRING, qty INT, price DECIMAL(10,2), at TIMESTAMP")
    event = _update_event()
    event["fullDocument"].update(price=Decimal128("9.999"), at=datetime.datetime(2024, 1, 1))
    row = converter.convert([event]).to_pylist()[0]
    assert row["full_document"] == {
        "_id": "650000000000000000000001",  # ObjectId → hex
        "qty": 3,  # an integral double fits INT
        "price": decimal.Decimal("10.00"),
        "at": datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc),
    }
    event["fullDocument"]["qty"] = "three"
    with pytest.raises(SchemaMismatchError, match=r"'fullDocument.qty'.*str 'three'") as caught:
        converter.convert([event])
    assert TOKEN["_data"] in str(caught.value)


def test_publish_full_document_only_drops_events_without_a_document(spark: Any) -> None:
    delete = {**_update_event(), "operationType": "delete"}
    del delete["fullDocument"]
    typed = _converter(spark, "qty DOUBLE, missing STRING", publish=True)
    assert typed.convert([_update_event(), delete]).to_pylist() == [{"qty": 3.0, "missing": None}]
    raw = _converter(spark, publish=True).convert([delete, _update_event()]).to_pylist()
    assert [json.loads(r["full_document"])["qty"] for r in raw] == [3.0]


def test_event_ddl_shapes() -> None:
    assert event_ddl().startswith("resume_token STRING, operation_type STRING, database STRING")
    assert "full_document STRUCT<a INT>" in event_ddl("a INT")
    assert "full_document_before_change STRUCT<a INT>" in event_ddl("a INT")
    assert event_ddl("a INT", publish_full_document_only=True) == "a INT"
    assert event_ddl(publish_full_document_only=True) == "full_document STRING"
    with pytest.raises(ValueError, match="empty"):
        event_ddl("  ")


def test_offsets_are_plain_json_and_choose_the_start_option() -> None:
    typed = {"_data": TOKEN["_data"], "_typeBits": Binary(b"\x40", 0)}
    offset = make_offset(typed)
    assert json.loads(json.dumps(offset)) == offset  # survives Spark's offset log
    assert offset_token(offset) == {"_data": TOKEN["_data"], "_typeBits": b"\x40"}
    assert list(offset_watch_option(offset)) == ["resume_after"]
    assert list(offset_watch_option(make_offset(TOKEN, start_after=True))) == ["start_after"]
    with pytest.raises(ValueError, match="not a changestream offset"):
        offset_token({"offset": 1})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "'uri' is required"),
        ({"uri": "mongodb://x", "colection": "c"}, "unknown changestream option"),
        ({"uri": "mongodb://x", "collection": "c"}, "needs option 'database'"),
        ({"uri": "mongodb://x", "startup_mode": "earliest"}, "startup_mode must be one of"),
        (
            {"uri": "mongodb://x", "startup_mode": "timestamp"},
            "needs option 'start_at_operation_time'",
        ),
        ({"uri": "mongodb://x", "startup_mode": "token", "start_after": "{}"}, "'start_after'"),
        ({"uri": "mongodb://x", "start_at_operation_time": "1"}, "needs startup_mode=timestamp"),
        ({"uri": "mongodb://x", "max_rows_per_batch": "0"}, "'max_rows_per_batch' must be >= 1"),
        ({"uri": "mongodb://x", "pipeline": "[1]"}, "array of stage documents"),
        (
            {"uri": "mongodb://x",
             "pipeline": '[{"$changeStreamSplitLargeEvent": {}}, {"$match": {}}]'},
            "must be the last stage",
        ),
    ],
)
def test_invalid_options_fail_at_start_naming_the_option(
    options: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SourceConfig.from_options(options)


def test_option_parsing() -> None:
    config = SourceConfig.from_options(
        {
            "URI": "mongodb://x",
            "database": "db",
            "startup_mode": "timestamp",
            "start_at_operation_time": '{"$timestamp": {"t": 1700000000, "i": 3}}',
            "pipeline": '{"$match": {"operationType": "insert"}}',
            "publish_full_document_only": "true",
        }
    )
    assert config.start_at_operation_time == Timestamp(1700000000, 3)
    assert config.pipeline == ({"$match": {"operationType": "insert"}},)
    assert config.full_document == "updateLookup"  # updates carry a document to publish
    assert config.collection is None  # database scope


def test_packed_partitions_return_every_event_in_order_and_stay_small() -> None:
    import random

    import bson

    from changestream.spark_adapter import _readahead as readahead

    noise = random.Random(7)
    for pad in (lambda i: "x" * (i % 700), lambda i: noise.randbytes(i % 700)):
        events = [
            bson.encode({"_id": {"_data": f"82{i:08X}"}, "operationType": "insert", "p": pad(i)})
            for i in range(48_000)
        ]
        parts = readahead.pack(events)
        # ~17 MB of BSON: several partitions (of at most PART_BYTES) converted in parallel,
        # each under Spark's task-size warning however well the events compress
        assert len(parts) >= -(-sum(map(len, events)) // readahead.PART_BYTES) >= 2
        assert all(len(part) < 1000 * 1024 for part in parts)
        assert [event for part in parts for event in readahead.unpack(part)] == events
    assert readahead.pack([]) == []


def test_json_columns_encoded_together_read_as_each_alone(spark: Any) -> None:
    """One encoder call per column chunk gives each document's own text, whatever it holds."""
    from changestream.spark_adapter._convert import _MARK

    documents: list[Any] = [
        {"a": [1, 2], "s": "x, y", "o": ObjectId("6b08b5353ae9adc2737f7557")},
        None,
        {"holds the mark": [_MARK, f", {_MARK}, "]},  # the split does not add up: one by one
        {"n": float("nan")},  # the encoder refuses NaN: relaxed JSON spells it
        {"e": "é", "d": datetime.datetime(2026, 1, 1)},
    ]
    events = [
        {"_id": TOKEN, "operationType": "insert", "fullDocument": doc} for doc in documents
    ]
    column = _converter(spark).convert(events).column("full_document").to_pylist()
    expected = [
        None if doc is None else json_util.dumps(doc, json_options=json_util.RELAXED_JSON_OPTIONS)
        for doc in documents
    ]
    assert column == expected
    assert _converter(spark).convert(events[:1] + events[4:]).column(
        "full_document"
    ).to_pylist() == [expected[0], expected[4]]


def test_javascript_code_is_written_as_json_util_writes_it_from_every_event_form(
    spark: Any
) -> None:
    """``Code`` is a ``str`` the JSON encoder would write as a plain string: raw events,
    decoded ones and joined partitions all give its
    ``{"$code": ...}`` (with ``$scope``, nested, and beside a NaN); a schema's string
    column takes the code's text, as ``mirror``'s do."""
    from bson.code import Code

    from changestream._js_code import decode_all_held

    documents: list[Any] = [
        {"_id": 1, "f": Code("return 1"), "s": Code("x", {"a": Code("y")})},
        {"_id": 2, "n": [{"f": Code("\r")}], "nan": float("nan")},
        {"_id": 3, "plain": "code-free"},
    ]
    events = [{"_id": TOKEN, "operationType": "insert", "fullDocument": doc,
               "documentKey": {"_id": doc["_id"]}} for doc in documents]
    expected = [json_util.dumps(doc, json_options=json_util.RELAXED_JSON_OPTIONS)
                for doc in documents]
    raws = [bson.encode(event) for event in events]
    converter = _converter(spark)
    for form in (events, raws, [RawBSONDocument(raw) for raw in raws]):
        assert converter.convert(form).column("full_document").to_pylist() == expected
    joined = converter.convert_joined([b"".join(raws)]).column("full_document").to_pylist()
    assert joined == expected
    assert decode_all_held(b"".join(raws))[2]["fullDocument"] == documents[2]
    schema = _converter(spark, "f STRING, plain STRING", publish=True)
    rows = schema.convert(raws).to_pylist()
    assert [row["f"] for row in rows] == ["return 1", None, None]


def test_shipped_partitions_give_the_rows_of_the_events_in_bounded_batches(spark: Any) -> None:
    """An executor reading a packed partition (groups of raw events, decoded group by group)
    gives exactly the rows of converting the events one list at a time; a field that only
    later events carry (past the first decode chunks) is filled in for them alone."""
    import bson

    from changestream.spark_adapter import _readahead as readahead
    from changestream.spark_adapter._source import ChangeStreamReader, TokenRange

    def insert(i: int) -> dict[str, Any]:
        return {**_update_event(), "operationType": "insert", "documentKey": {"_id": i},
                "fullDocument": {"_id": i, "s": "x" * (i % 50)}, "updateDescription": None}

    documents = [insert(i) for i in range(700)] + [_update_event() for _ in range(300)]
    for document in documents[:700]:
        del document["updateDescription"], document["lsid"], document["txnNumber"]
    events = [bson.encode(document) for document in documents]
    config = SourceConfig.from_options(
        {"uri": "mongodb://127.0.0.1:9", "collection": "c", "database": "d",
         "arrow_batch_rows": "300"}  # not a multiple of the decode chunk
    )
    schema = DataType.fromDDL(event_ddl())
    assert isinstance(schema, StructType)
    reader = pickle.loads(pickle.dumps(ChangeStreamReader(config, schema)))  # as executors get it
    parts = readahead.pack(events)
    assert [b"".join(readahead.unpack_chunks(part, 128)) for part in parts] == [
        b"".join(readahead.unpack(part)) for part in parts
    ]
    start, end = make_offset(TOKEN), make_offset(TOKEN)
    batches = [batch for part in parts for batch in reader.read(TokenRange(start, end, part))]
    assert all(batch.num_rows <= 300 for batch in batches)

    expected = _converter(spark).convert(documents)
    assert pa.Table.from_batches(batches).equals(pa.Table.from_batches([expected]))
    updates = expected.column("update_description").to_pylist()
    assert updates[:700] == [None] * 700
    assert updates[700:] == [relaxed_json(documents[-1]["updateDescription"])] * 300
