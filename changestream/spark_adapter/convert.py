"""Change events to Arrow record batches (the fast path into Spark).

Columns are built one at a time from plain lists, then handed to pyarrow,
which converts them in C. Documents become relaxed Extended JSON through the
C JSON encoder with BSON types handled in ``default`` (same text as
``bson.json_util.dumps(..., RELAXED_JSON_OPTIONS)``, several times faster).
With a user schema, documents are converted field by field; a value that does
not fit fails the batch with :class:`SchemaMismatchError` instead of being
silently dropped.
"""

from __future__ import annotations

import datetime
import decimal
import json
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
    if isinstance(value, Mapping):  # e.g. a nested RawBSONDocument
        return dict(value)
    return json_util.default(value, _RELAXED)


_encode = json.JSONEncoder(default=_json_default, allow_nan=False).encode


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


def _cluster_time_array(values: list[Any], arrow_type: pa.DataType) -> pa.Array:
    seconds = pa.array([None if v is None else v.time for v in values], pa.int64())
    increments = pa.array([None if v is None else v.inc for v in values], pa.int64())
    mask = pa.array([v is None for v in values]) if None in values else None
    return pa.StructArray.from_arrays([seconds, increments], fields=list(arrow_type), mask=mask)


def _get_in(document: Mapping[str, Any], outer: str, inner: str) -> Any:
    value = document.get(outer)
    return value.get(inner) if isinstance(value, Mapping) else None


_EXTRACTORS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "resume_token": lambda d: _get_in(d, "_id", "_data"),
    "operation_type": lambda d: d.get("operationType"),
    "database": lambda d: _get_in(d, "ns", "db"),
    "collection": lambda d: _get_in(d, "ns", "coll"),
    "document_key": lambda d: relaxed_json(d.get("documentKey")),
    "cluster_time": lambda d: d.get("clusterTime"),
    "wall_time": lambda d: d.get("wallTime"),
    "update_description": lambda d: relaxed_json(d.get("updateDescription")),
    "operation_description": lambda d: relaxed_json(d.get("operationDescription")),
    "to_database": lambda d: _get_in(d, "to", "db"),
    "to_collection": lambda d: _get_in(d, "to", "coll"),
    "txn_number": lambda d: d.get("txnNumber"),
    "lsid": lambda d: relaxed_json(d.get("lsid")),
}
_DOCUMENT_FIELDS = {
    "full_document": "fullDocument",
    "full_document_before_change": "fullDocumentBeforeChange",
}
assert set(_EXTRACTORS) | set(_DOCUMENT_FIELDS) == {name for name, _ in ENVELOPE_COLUMNS}


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

    def _plan(self) -> list[Callable[[list[Mapping[str, Any]]], pa.Array]]:
        if self.publish_full_document_only:
            if self.schema.names == ["full_document"] and pa.types.is_string(self.schema[0].type):
                return [self._json_column("fullDocument", self.schema[0].type)]
            return [
                self._document_column(
                    None, field.name, _compile(field.type, field.name), field.type
                )
                for field in self.schema
            ]
        columns = []
        for field in self.schema:
            if field.name in _DOCUMENT_FIELDS:
                key = _DOCUMENT_FIELDS[field.name]
                if pa.types.is_struct(field.type):
                    columns.append(
                        self._document_column(key, None, _compile(field.type, key), field.type)
                    )
                else:
                    columns.append(self._json_column(key, field.type))
            elif field.name == "cluster_time":
                columns.append(self._cluster_time_column(field.type))
            elif field.name in _EXTRACTORS:
                columns.append(self._simple_column(_EXTRACTORS[field.name], field.type))
            else:
                raise ValueError(f"unknown change-event column {field.name!r}")
        return columns

    @staticmethod
    def _simple_column(
        extract: Callable[[Mapping[str, Any]], Any], arrow_type: pa.DataType
    ) -> Callable[[list[Mapping[str, Any]]], pa.Array]:
        return lambda docs: pa.array([extract(d) for d in docs], arrow_type)

    @staticmethod
    def _json_column(
        key: str, arrow_type: pa.DataType
    ) -> Callable[[list[Mapping[str, Any]]], pa.Array]:
        return lambda docs: pa.array([relaxed_json(d.get(key)) for d in docs], arrow_type)

    @staticmethod
    def _cluster_time_column(
        arrow_type: pa.DataType,
    ) -> Callable[[list[Mapping[str, Any]]], pa.Array]:
        return lambda docs: _cluster_time_array([d.get("clusterTime") for d in docs], arrow_type)

    @staticmethod
    def _document_column(
        key: str | None, field: str | None, convert: Convert, arrow_type: pa.DataType
    ) -> Callable[[list[Mapping[str, Any]]], pa.Array]:
        """A column from the document at ``key`` (or from field ``field`` of the full document)."""

        def build(docs: list[Mapping[str, Any]]) -> pa.Array:
            values = []
            for d in docs:
                value = d.get(key) if key is not None else d["fullDocument"].get(field)
                try:
                    values.append(convert(value))
                except _Mismatch as exc:
                    token = _get_in(d, "_id", "_data")
                    raise SchemaMismatchError(
                        f"change event {token} does not fit full_document_schema: {exc}"
                    ) from None
            return pa.array(values, arrow_type)

        return build

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
