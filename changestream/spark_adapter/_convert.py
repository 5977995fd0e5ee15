"""Change events to Arrow record batches (the fast path into Spark).

Columns are built one at a time from plain lists, then handed to pyarrow,
which converts them in C. Documents become relaxed Extended JSON through one
``json.JSONEncoder`` built once, BSON types handled in ``default`` (the same
text as ``bson.json_util.dumps(..., RELAXED_JSON_OPTIONS)``). With a user
schema, documents are converted field by field; a value that does not fit
fails the batch with :class:`SchemaMismatchError` instead of being silently
dropped or changed.

Why hand-written and not ``pymongoarrow`` (MongoDB's BSON -> Arrow library),
measured on 20,000 of the benchmark's insert events (425 B), 10,000 per call,
µs of CPU per event, best of 7, pymongoarrow 1.15 on pyarrow 25.0.0, the
2-core development machine at load ~1 (``/work/notes/spark.md``):

* envelope (the default rows): here 15.1, of which decoding 5.9, the full
  document's JSON 5.9 and the 13 other columns 3.4. pymongoarrow cannot
  write JSON text (``full_document``, ``document_key``, ``update_description``,
  ``lsid``) nor read a BSON Timestamp (``cluster_time``), so the events must
  be decoded here anyway; its 7 columns it can make cost 4.8 on their own,
  more than the 3.4 they cost here after that decode;
* typed documents (``full_document_schema``, publish-only): here 12.0,
  pymongoarrow 4.5. Faster, but not the same rows: it truncates ``1.5`` into
  an integer column, writes booleans as 0/1 into numeric columns and NaN as
  null, where the contract here is to fail the batch naming the field; STRING
  columns refuse ObjectIds and other values (here: hex, relaxed JSON), and
  dates come only as millisecond timestamps. It also pins pyarrow to one
  minor (1.15: ``pyarrow>=25.0,<25.1``, and 25.0.1 warns of a binary
  incompatibility) while pyspark 4.3 needs ``pyarrow>=18`` and a resolver
  picks 26 today; so it is not a dependency of the ``spark`` extra.

The JSON encoder is the public one. One ``JSONEncoder.encode`` call per
document costs 5.3 µs per full document against 3.2 through CPython's private
``c_make_encoder`` (which an earlier version called positionally), because
each call builds the C encoder anew; encoding a column's documents in one
call (:func:`_encode_each`) costs 2.9.
"""

from __future__ import annotations

import datetime
import decimal
import json
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import bson
import pyarrow as pa
from bson import json_util
from bson.decimal128 import Decimal128
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

from .._js_code import JsCode, code_held, code_json, decode_all_held, unmarked
from .._token import raw_token_bytes
from ._errors import SchemaMismatchError
from ._schema import ENVELOPE_COLUMNS

__all__ = [
    "DECODE_CHUNK",
    "Event",
    "EventConverter",
    "event_token",
    "is_error_event",
    "is_invalidate",
    "raw_bytes",
    "raw_event",
    "relaxed_json",
]

_RELAXED = json_util.RELAXED_JSON_OPTIONS


def _json_default(value: Any) -> Any:
    if type(value) is JsCode:  # decoded by _decoded: written as json_util writes Code
        return code_json(value)
    try:
        return json_util.default(value, _RELAXED)
    except TypeError:
        if isinstance(value, Mapping):  # e.g. a nested RawBSONDocument
            return dict(value)
        raise


_encode = json.JSONEncoder(default=_json_default, allow_nan=False, check_circular=False).encode
"""Relaxed Extended JSON through the public encoder, built once (BSON documents cannot be
circular, so no cycle markers; NaN and Infinity raise and are spelt by ``json_util``)."""


def relaxed_json(value: Any) -> str | None:
    """Relaxed Extended JSON of a BSON value (``None`` for a missing value)."""
    if value is None:
        return None
    try:
        return _encode(value)
    except ValueError:  # NaN / Infinity: json_util spells them {"$numberDouble": ...}
        return json_util.dumps(unmarked(value), json_options=_RELAXED)


class _Mismatch(Exception):
    def __init__(self, path: str, value: Any, expected: pa.DataType) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        super().__init__(
            f"field {path!r}: cannot convert {type(value).__name__} {shown} to {expected}"
        )


Convert = Callable[[Any], Any]
"""Turns one BSON value into what pyarrow accepts for a given type."""


def _compile(arrow_type: pa.DataType, path: str) -> Convert:
    """A function turning one BSON value into what pyarrow accepts for ``arrow_type``."""
    types = pa.types

    def checked(accept: Callable[[Any], bool], cast: Convert) -> Convert:
        def convert(value: Any) -> Any:
            if value is None:
                return None
            if not accept(value):
                raise _Mismatch(path, value, arrow_type)
            return cast(value)

        return convert

    if types.is_string(arrow_type) or types.is_large_string(arrow_type):
        return _to_string
    if types.is_boolean(arrow_type):
        return checked(lambda v: isinstance(v, bool), bool)
    if types.is_integer(arrow_type):
        bits = arrow_type.bit_width - (0 if types.is_unsigned_integer(arrow_type) else 1)
        low = 0 if types.is_unsigned_integer(arrow_type) else -(1 << bits)
        high = (1 << bits) - 1
        return checked(
            lambda v: _integral(v) and low <= v <= high,
            int,
        )
    if types.is_floating(arrow_type):
        return checked(
            lambda v: isinstance(v, (int, float, Decimal128)) and not isinstance(v, bool),
            lambda v: float(v.to_decimal()) if isinstance(v, Decimal128) else float(v),
        )
    if types.is_decimal(arrow_type):
        quantum = decimal.Decimal(1).scaleb(-arrow_type.scale)
        return checked(
            lambda v: isinstance(v, (int, float, Decimal128)) and not isinstance(v, bool),
            lambda v: _to_decimal(v).quantize(quantum, rounding=decimal.ROUND_HALF_EVEN),
        )
    if types.is_timestamp(arrow_type):
        return checked(lambda v: isinstance(v, (datetime.datetime, Timestamp)), _to_datetime)
    if types.is_date(arrow_type):
        return checked(
            lambda v: isinstance(v, (datetime.datetime, Timestamp)),
            lambda v: _to_datetime(v).date(),
        )
    if types.is_binary(arrow_type) or types.is_large_binary(arrow_type):
        return checked(
            lambda v: isinstance(v, (bytes, uuid.UUID)),
            lambda v: v.bytes if isinstance(v, uuid.UUID) else bytes(v),
        )
    if types.is_struct(arrow_type):
        fields = [
            (field.name, _compile(field.type, f"{path}.{field.name}")) for field in arrow_type
        ]
        return checked(
            lambda v: isinstance(v, Mapping),
            lambda v: {name: convert(v.get(name)) for name, convert in fields},
        )
    if types.is_list(arrow_type) or types.is_large_list(arrow_type):
        element = _compile(arrow_type.value_type, f"{path}[]")
        return checked(lambda v: isinstance(v, list), lambda v: [element(x) for x in v])
    if types.is_map(arrow_type):
        if not types.is_string(arrow_type.key_type):
            raise ValueError(f"field {path!r}: MAP keys must be STRING (BSON keys are strings)")
        item = _compile(arrow_type.item_type, f"{path}{{}}")
        return checked(
            lambda v: isinstance(v, Mapping), lambda v: [(k, item(x)) for k, x in v.items()]
        )
    raise ValueError(f"field {path!r}: Spark type {arrow_type} is not supported for documents")


def _to_string(value: Any) -> str | None:
    """Strings as they are, ObjectIds as 24 hex digits, anything else as relaxed JSON."""
    if value is None or isinstance(value, str):
        return value
    if type(value) is JsCode:  # a string, as mirror's schema columns take Code
        return str(value.code)
    if isinstance(value, ObjectId):
        return str(value)
    return relaxed_json(value)


def _integral(value: Any) -> bool:
    """An integer, or a float without a fractional part (BSON doubles often hold counters)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _to_decimal(value: Any) -> decimal.Decimal:
    if isinstance(value, Decimal128):
        return value.to_decimal()
    return decimal.Decimal(str(value)) if isinstance(value, float) else decimal.Decimal(value)


def _to_datetime(value: Any) -> datetime.datetime:
    """BSON dates are UTC; naive datetimes (the default codec) are taken as UTC by pyarrow."""
    return value.as_datetime() if isinstance(value, Timestamp) else value


DECODE_CHUNK = 128
"""Raw events decoded per step: the dicts die young, before the cyclic GC promotes (and
rescans) them, and only plain values (strings, ints) wait for the Arrow arrays."""

_YIELD_EVERY = 4 * DECODE_CHUNK
"""Events converted between two offers of the GIL to other threads (~2 ms of work)."""

Docs = list[Mapping[str, Any]]
Extract = Callable[[Docs], list[Any]]
"""Turns a chunk of change documents into one column's Python values."""


class _Column:
    """One column: values gathered chunk by chunk, then one Arrow array built in C.

    ``field`` is the top-level field of the change document the column reads
    (``None``: several); a chunk in which no document has it adds nulls without
    looking at the documents (most envelope columns are absent from most events).
    """

    __slots__ = ("arrow_type", "extract", "field", "values")

    def __init__(self, arrow_type: pa.DataType, extract: Extract, field: str | None) -> None:
        self.arrow_type = arrow_type
        self.extract = extract
        self.field = field
        self.values: list[Any] = []

    def add(self, docs: Docs, fields: set[str]) -> None:
        """Append the column's values for ``docs``, whose top-level fields are ``fields``."""
        if self.field is None or self.field in fields:
            self.values += self.extract(docs)
        else:
            self.values += [None] * len(docs)

    def finish(self) -> pa.Array:
        values = self.values
        if values.count(None) == len(values):  # absent everywhere: one C pass, no conversion
            return pa.nulls(len(values), self.arrow_type)
        return pa.array(values, self.arrow_type)


class _ClusterTime(_Column):
    """``clusterTime`` as ``STRUCT<t, i>``: a Spark TIMESTAMP would drop the increment."""

    __slots__ = ("increments", "missing")

    def __init__(self, arrow_type: pa.DataType) -> None:
        super().__init__(arrow_type, _values("clusterTime"), "clusterTime")
        self.increments: list[int | None] = []
        self.missing = False

    def add(self, docs: Docs, fields: set[str]) -> None:
        times = [d.get("clusterTime") for d in docs]
        if None in times:
            self.missing = True
            self.values += [None if v is None else v.time for v in times]
            self.increments += [None if v is None else v.inc for v in times]
        else:
            present: list[Any] = times
            self.values += [v.time for v in present]
            self.increments += [v.inc for v in present]

    def finish(self) -> pa.Array:
        seconds = pa.array(self.values, pa.int64())
        increments = pa.array(self.increments, pa.int64())
        mask = pa.array([v is None for v in self.values]) if self.missing else None
        return pa.StructArray.from_arrays(
            [seconds, increments], fields=list(self.arrow_type), mask=mask
        )


ColumnFactory = Callable[[], _Column]
"""Makes a fresh, empty column builder (one per :meth:`EventConverter.convert` call)."""


def _values(key: str) -> Extract:
    return lambda docs: [d.get(key) for d in docs]


def _subvalues(outer: str, inner: str) -> Extract:
    """``event[outer][inner]`` (e.g. ``ns.db``)."""

    def extract(docs: Docs) -> list[Any]:
        parents = [d.get(outer) for d in docs]
        if parents.count(None) == len(parents):
            return parents
        try:
            return [None if p is None else p.get(inner) for p in parents]
        except AttributeError:  # a user pipeline replaced the document by something else
            return [p.get(inner) if isinstance(p, Mapping) else None for p in parents]

    return extract


_MARK = 2**200
"""Put between the values of :func:`_encode_each`: an integer no BSON value encodes as."""
_SPLIT = f", {_MARK}, "


def _encode_each(values: list[Any]) -> list[str]:
    """Relaxed JSON of each value (none ``None``), in one call of the encoder.

    The values are encoded as one list with :data:`_MARK` between them and
    the text split there: the same text as one call per value, at half the
    cost (a call builds the C encoder anew). Should a value hold the mark's
    digits, the parts do not add up and each value is encoded on its own.
    """
    items = [_MARK] * (2 * len(values) - 1)
    items[::2] = values
    parts = _encode(items)[1:-1].split(_SPLIT)
    return parts if len(parts) == len(values) else [_encode(v) for v in values]


def _json_values(key: str) -> Extract:
    """``event[key]`` as relaxed Extended JSON."""

    def extract(docs: Docs) -> list[Any]:
        values = [d.get(key) for d in docs]
        missing = values.count(None)
        if missing == len(values):
            return values
        try:
            if not missing:
                return _encode_each(values)
            present = iter(_encode_each([v for v in values if v is not None]))
            return [None if v is None else next(present) for v in values]
        except ValueError:  # a NaN somewhere: let relaxed_json spell it
            return [relaxed_json(v) for v in values]

    return extract


_ESCAPE = json.JSONEncoder().encode  # a str: its JSON literal, ASCII-escaped


def _key_json(key: Any) -> str | None:
    """Relaxed JSON of a ``documentKey``: the usual ``{_id: int | str | ObjectId}`` without
    the general encoder (same text, a fraction of the time)."""
    if key.__class__ is dict and len(key) == 1:
        value: Any = key.get("_id")
        kind = value.__class__
        if kind is int:
            return f'{{"_id": {value}}}'
        if kind is str:
            return f'{{"_id": {_ESCAPE(value)}}}'
        if kind is ObjectId:
            return f'{{"_id": {{"$oid": "{value}"}}}}'
    return None if key is None else relaxed_json(key)


def _document_keys(docs: Docs) -> list[Any]:
    return [_key_json(d.get("documentKey")) for d in docs]


def _document_values(key: str | None, field: str | None, convert: Convert) -> Extract:
    """The document at ``event[key]`` (or field ``field`` of the full document), typed."""

    def extract(docs: Docs) -> list[Any]:
        values = []
        for d in docs:
            value = d.get(key) if key is not None else d["fullDocument"].get(field)
            try:
                values.append(convert(value))
            except _Mismatch as exc:
                token = d.get("_id", {}).get("_data")
                raise SchemaMismatchError(
                    f"change event {token} does not fit full_document_schema: {exc}"
                ) from None
        return values

    return extract


def _column(arrow_type: pa.DataType, extract: Extract, field: str | None) -> ColumnFactory:
    return lambda: _Column(arrow_type, extract, field)


def _document(
    key: str | None, field: str | None, arrow_type: pa.DataType, path: str
) -> ColumnFactory:
    extract = _document_values(key, field, _compile(arrow_type, path))
    return _column(arrow_type, extract, key or "fullDocument")


_ENVELOPE: dict[str, Callable[[pa.DataType], ColumnFactory]] = {
    "resume_token": lambda t: _column(t, _subvalues("_id", "_data"), "_id"),
    "operation_type": lambda t: _column(t, _values("operationType"), "operationType"),
    "database": lambda t: _column(t, _subvalues("ns", "db"), "ns"),
    "collection": lambda t: _column(t, _subvalues("ns", "coll"), "ns"),
    "document_key": lambda t: _column(t, _document_keys, "documentKey"),
    "cluster_time": lambda t: lambda: _ClusterTime(t),
    "wall_time": lambda t: _column(t, _values("wallTime"), "wallTime"),
    "update_description": lambda t: _column(
        t, _json_values("updateDescription"), "updateDescription"
    ),
    "operation_description": lambda t: _column(
        t, _json_values("operationDescription"), "operationDescription"
    ),
    "to_database": lambda t: _column(t, _subvalues("to", "db"), "to"),
    "to_collection": lambda t: _column(t, _subvalues("to", "coll"), "to"),
    "txn_number": lambda t: _column(t, _values("txnNumber"), "txnNumber"),
    "lsid": lambda t: _column(t, _json_values("lsid"), "lsid"),
}
_DOCUMENTS = {
    "full_document": "fullDocument",
    "full_document_before_change": "fullDocumentBeforeChange",
}
assert set(_ENVELOPE) | set(_DOCUMENTS) == {name for name, _ in ENVELOPE_COLUMNS}


Event = Mapping[str, Any] | bytes
"""A change document: a mapping (``dict``, ``RawBSONDocument``) or its raw BSON bytes."""


def raw_bytes(event: Any) -> Any:
    """The raw BSON of a ``RawBSONDocument`` (plain bytes are not GC-tracked), else ``event``
    (a mapping); anything else is refused with what to do."""
    if isinstance(event, RawBSONDocument):
        return event.raw
    if isinstance(event, (bytes, Mapping)):
        return event
    raise TypeError(
        "the Spark adapter needs change documents (mappings); open the stream without "
        f"typed=True (got {type(event).__name__})"
    )


def raw_event(event: Any) -> bytes:
    """An event's raw BSON: a ``RawBSONDocument``'s own bytes; a mapping (a split event the
    client merged from its fragments) encoded once."""
    raw = raw_bytes(event)
    return raw if isinstance(raw, bytes) else bson.encode(raw)


def is_invalidate(event: Event) -> bool:
    """Whether a change document is an ``invalidate`` event.

    Raw events are only decoded when their bytes contain the word: reading
    any field of a ``RawBSONDocument`` decodes the whole event, which costs
    more than fetching it.
    """
    if isinstance(event, bytes):
        return b"invalidate" in event and bson.decode(event).get("operationType") == "invalidate"
    if isinstance(event, RawBSONDocument) and b"invalidate" not in event.raw:
        return False
    return event.get("operationType") == "invalidate"


_ERROR_TYPE = b"\x02operationType\x00\x06\x00\x00\x00error\x00"
"""``operationType: "error"`` as BSON: raw events without these bytes are not decoded."""


def is_error_event(event: Event) -> bool:
    """Whether a change document is an ``operationType: "error"`` event (reported for
    MongoDB 9.1; not in mongod's source as of this writing): never data to write."""
    if isinstance(event, bytes):
        return _ERROR_TYPE in event and bson.decode(event).get("operationType") == "error"
    if isinstance(event, RawBSONDocument) and _ERROR_TYPE not in event.raw:
        return False
    return event.get("operationType") == "error"


def event_token(event: Event) -> Any:
    """The resume token (``_id``) of a change document; raw events decode only the token."""
    if not isinstance(event, bytes):
        return event["_id"]
    token = raw_token_bytes(event)
    return bson.decode(token) if token is not None else bson.decode(event)["_id"]


def _decoded(events: Sequence[Event]) -> Docs:
    """Plain dicts for a chunk of events; raw ones are decoded in one C call.

    JavaScript code (``Code``, a ``str`` subclass the JSON encoder would write as a plain
    string) is held as a ``JsCode``, which ``_json_default`` writes as ``json_util`` does."""
    try:
        data = b"".join(events)  # type: ignore[arg-type]  # raw bytes: the fast path
    except TypeError:
        raws = [raw_bytes(e) for e in events]
        if all(isinstance(raw, bytes) for raw in raws):
            data = b"".join(raws)
        else:
            return [decode_all_held(raw)[0] if isinstance(raw, bytes) else code_held(raw)
                    for raw in raws]
    return decode_all_held(data)


class EventConverter:
    """Turns a list of change documents into one ``pyarrow.RecordBatch`` of a given schema.

    ``schema`` is the Arrow form of the Spark schema from
    :func:`changestream.spark_adapter.schema.event_ddl` (envelope columns, or
    the document's own columns when ``publish_full_document_only``).
    Picklable: it travels to executors inside the data source reader.
    """

    def __init__(self, schema: pa.Schema, *, publish_full_document_only: bool = False) -> None:
        self.schema = schema
        self.publish_full_document_only = publish_full_document_only
        self._columns = self._plan()

    def __getstate__(self) -> dict[str, Any]:
        return {"schema": self.schema, "publish": self.publish_full_document_only}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.schema = state["schema"]
        self.publish_full_document_only = state["publish"]
        self._columns = self._plan()

    def _plan(self) -> list[ColumnFactory]:
        if self.publish_full_document_only:
            if self.schema.names == ["full_document"] and pa.types.is_string(self.schema[0].type):
                return [_column(self.schema[0].type, _json_values("fullDocument"), None)]
            return [_document(None, f.name, f.type, f.name) for f in self.schema]
        columns = []
        for field in self.schema:
            key = _DOCUMENTS.get(field.name)
            if key is not None and pa.types.is_struct(field.type):
                columns.append(_document(key, None, field.type, key))
            elif key is not None:
                columns.append(_column(field.type, _json_values(key), key))
            elif field.name in _ENVELOPE:
                columns.append(_ENVELOPE[field.name](field.type))
            else:
                raise ValueError(f"unknown change-event column {field.name!r}")
        return columns

    def convert(self, events: Sequence[Event], *, share_gil: bool = True) -> pa.RecordBatch:
        """One record batch for ``events`` (dicts, ``RawBSONDocument``s or raw BSON bytes, in
        stream order).

        With ``publish_full_document_only`` events without a full document
        (deletes, DDL, updates without a lookup) produce no row. Raw events
        are decoded :data:`DECODE_CHUNK` at a time. ``share_gil``: offer the
        GIL to other threads now and then (a driver converting beside py4j's
        threads); an executor's worker has no other thread to wait for.
        """
        chunks = (
            _decoded(events[start : start + DECODE_CHUNK])
            for start in range(0, len(events), DECODE_CHUNK)
        )
        return self._convert(chunks, share_gil)

    def convert_joined(self, chunks: Sequence[bytes]) -> pa.RecordBatch:
        """One record batch for raw events given as groups of BSON documents back to back
        (:func:`._readahead.unpack_chunks`, best :data:`DECODE_CHUNK` a group), on an
        executor: each group is decoded in one call, no step per event before it."""
        decoded: Iterable[Docs] = map(decode_all_held, chunks)
        return self._convert(decoded, share_gil=False)

    def _convert(self, chunks: Iterable[Docs], share_gil: bool) -> pa.RecordBatch:
        columns = [make() for make in self._columns]
        publish = self.publish_full_document_only
        done = 0
        for docs in chunks:
            if share_gil and done >= _YIELD_EVERY:
                time.sleep(0)  # let a thread waiting for the GIL (a py4j reply) in at once
                done = 0
            done += len(docs)
            if publish:
                docs = [d for d in docs if isinstance(d.get("fullDocument"), Mapping)]
            fields: set[str] = set().union(*docs)
            for column in columns:
                column.add(docs, fields)
        return pa.RecordBatch.from_arrays([c.finish() for c in columns], schema=self.schema)
