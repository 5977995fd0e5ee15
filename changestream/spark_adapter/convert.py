"""Change events to Arrow record batches (the fast path into Spark).

Columns are built one at a time from plain lists, then handed to pyarrow,
which converts them in C. Documents become relaxed Extended JSON through one
reusable C JSON encoder with BSON types handled in ``default`` (same text as
``bson.json_util.dumps(..., RELAXED_JSON_OPTIONS)``, several times faster:
``json.dumps`` rebuilds its encoder on every call, which dominates for the
small documents of change events).
With a user schema, documents are converted field by field; a value that does
not fit fails the batch with :class:`SchemaMismatchError` instead of being
silently dropped.
"""

from __future__ import annotations

import datetime
import decimal
import json
import json.encoder as json_encoder
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import bson
import pyarrow as pa
from bson import json_util
from bson.decimal128 import Decimal128
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp

from .errors import SchemaMismatchError
from .schema import ENVELOPE_COLUMNS

__all__ = ["EventConverter", "relaxed_json"]

_RELAXED = json_util.RELAXED_JSON_OPTIONS


def _json_default(value: Any) -> Any:
    try:
        return json_util.default(value, _RELAXED)
    except TypeError:
        if isinstance(value, Mapping):  # e.g. a nested RawBSONDocument
            return dict(value)
        raise


def _make_encoder() -> Callable[[Any], str]:
    """``json.dumps(value, default=_json_default, allow_nan=False)``, with the encoder built once.

    BSON documents cannot be circular, so no cycle markers are needed. Falls
    back to the pure-Python encoder where the C accelerator is missing.
    """
    make = getattr(json_encoder, "c_make_encoder", None)
    if make is None:
        return json.JSONEncoder(default=_json_default, allow_nan=False).encode
    chunks = make(
        None,
        _json_default,
        json_encoder.encode_basestring_ascii,
        None,
        ": ",
        ", ",
        False,
        False,
        False,
    )
    return lambda value: "".join(chunks(value, 0))


_encode = _make_encoder()


def relaxed_json(value: Any) -> str | None:
    """Relaxed Extended JSON of a BSON value (``None`` for a missing value)."""
    if value is None:
        return None
    try:
        return _encode(value)
    except ValueError:  # NaN / Infinity: json_util spells them {"$numberDouble": ...}
        return json_util.dumps(value, json_options=_RELAXED)


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


Column = Callable[[list[Mapping[str, Any]]], pa.Array]
"""Builds one Arrow column from a batch of change documents."""


def _field(key: str, arrow_type: pa.DataType) -> Column:
    return lambda docs: pa.array([d.get(key) for d in docs], arrow_type)


def _subfield(outer: str, inner: str, arrow_type: pa.DataType) -> Column:
    """``event[outer][inner]`` (e.g. ``ns.db``); all-null columns cost one pass."""

    def build(docs: list[Mapping[str, Any]]) -> pa.Array:
        parents = [d.get(outer) for d in docs]
        if parents.count(None) == len(parents):
            return pa.nulls(len(parents), arrow_type)
        try:
            return pa.array([None if p is None else p.get(inner) for p in parents], arrow_type)
        except AttributeError:  # a user pipeline replaced the document by something else
            return pa.array(
                [p.get(inner) if isinstance(p, Mapping) else None for p in parents], arrow_type
            )

    return build


def _json_field(key: str, arrow_type: pa.DataType) -> Column:
    """``event[key]`` as relaxed Extended JSON."""

    def build(docs: list[Mapping[str, Any]]) -> pa.Array:
        values = [d.get(key) for d in docs]
        if values.count(None) == len(values):
            return pa.nulls(len(values), arrow_type)
        try:
            return pa.array([None if v is None else _encode(v) for v in values], arrow_type)
        except ValueError:  # a NaN somewhere: let relaxed_json spell it
            return pa.array([relaxed_json(v) for v in values], arrow_type)

    return build


def _cluster_time(arrow_type: pa.DataType) -> Column:
    """``clusterTime`` as ``STRUCT<t, i>``: a Spark TIMESTAMP would drop the increment."""

    def build(docs: list[Mapping[str, Any]]) -> pa.Array:
        values = [d.get("clusterTime") for d in docs]
        seconds = pa.array([None if v is None else v.time for v in values], pa.int64())
        increments = pa.array([None if v is None else v.inc for v in values], pa.int64())
        mask = pa.array([v is None for v in values]) if None in values else None
        return pa.StructArray.from_arrays([seconds, increments], fields=list(arrow_type), mask=mask)

    return build


def _document(key: str | None, field: str | None, arrow_type: pa.DataType, path: str) -> Column:
    """The document at ``event[key]`` (or field ``field`` of the full document), typed."""
    convert = _compile(arrow_type, path)

    def build(docs: list[Mapping[str, Any]]) -> pa.Array:
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
        return pa.array(values, arrow_type)

    return build


_ENVELOPE: dict[str, Callable[[pa.DataType], Column]] = {
    "resume_token": lambda t: _subfield("_id", "_data", t),
    "operation_type": lambda t: _field("operationType", t),
    "database": lambda t: _subfield("ns", "db", t),
    "collection": lambda t: _subfield("ns", "coll", t),
    "document_key": lambda t: _json_field("documentKey", t),
    "cluster_time": _cluster_time,
    "wall_time": lambda t: _field("wallTime", t),
    "update_description": lambda t: _json_field("updateDescription", t),
    "operation_description": lambda t: _json_field("operationDescription", t),
    "to_database": lambda t: _subfield("to", "db", t),
    "to_collection": lambda t: _subfield("to", "coll", t),
    "txn_number": lambda t: _field("txnNumber", t),
    "lsid": lambda t: _json_field("lsid", t),
}
_DOCUMENTS = {
    "full_document": "fullDocument",
    "full_document_before_change": "fullDocumentBeforeChange",
}
assert set(_ENVELOPE) | set(_DOCUMENTS) == {name for name, _ in ENVELOPE_COLUMNS}


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

    def _plan(self) -> list[Column]:
        if self.publish_full_document_only:
            if self.schema.names == ["full_document"] and pa.types.is_string(self.schema[0].type):
                return [_json_field("fullDocument", self.schema[0].type)]
            return [_document(None, f.name, f.type, f.name) for f in self.schema]
        columns = []
        for field in self.schema:
            key = _DOCUMENTS.get(field.name)
            if key is not None and pa.types.is_struct(field.type):
                columns.append(_document(key, None, field.type, key))
            elif key is not None:
                columns.append(_json_field(key, field.type))
            elif field.name in _ENVELOPE:
                columns.append(_ENVELOPE[field.name](field.type))
            else:
                raise ValueError(f"unknown change-event column {field.name!r}")
        return columns

    def convert(self, events: Sequence[Mapping[str, Any]]) -> pa.RecordBatch:
        """One record batch for ``events`` (dicts or ``RawBSONDocument``s, in stream order).

        With ``publish_full_document_only`` events without a full document
        (deletes, DDL, updates without a lookup) produce no row.
        """
        docs = [bson.decode(e.raw) if isinstance(e, RawBSONDocument) else e for e in events]
        if self.publish_full_document_only:
            docs = [d for d in docs if isinstance(d.get("fullDocument"), Mapping)]
        return pa.RecordBatch.from_arrays(
            [column(docs) for column in self._columns], schema=self.schema
        )
