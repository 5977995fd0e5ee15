"""``infer_schema=true``: propose a ``full_document_schema`` from a sample of the collection.

Like the MongoDB Spark connector (SPARK-382), documents are sampled from the
collection itself (``$sample``), not from change events; every field seen gets
the narrowest Spark type that holds all its sampled values, and values that
disagree fall back to ``STRING`` (the converter writes any BSON value there as
relaxed Extended JSON, losslessly). The proposal is logged so it can be pinned
with ``full_document_schema``: an inferred schema changes when the data does,
and a streaming query's schema must not.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId

__all__ = ["MAP_MIN_KEYS", "infer_ddl", "sample_ddl"]

log = logging.getLogger("changestream.spark")

MAP_MIN_KEYS = 250
"""A sub-document with at least this many distinct keys becomes ``MAP<STRING, ...>``
instead of a ``STRUCT`` (as the connector's ``sql.inferSchema.mapTypes.minimum.key.size``)."""

_MAX_DEPTH = 16
_INT32 = (-(2**31), 2**31 - 1)

# A type: a Spark scalar name, ("STRUCT", {field: type}) or ("ARRAY", element); None: only nulls.
_Type = str | tuple[str, Any] | None


def _of(value: Any, depth: int) -> _Type:
    if value is None:
        return None
    if isinstance(value, bool):
        return "BOOLEAN"
    if isinstance(value, Int64):
        return "BIGINT"
    if isinstance(value, int):
        return "INT" if _INT32[0] <= value <= _INT32[1] else "BIGINT"
    if isinstance(value, float):
        return "DOUBLE"
    if isinstance(value, datetime.datetime):
        return "TIMESTAMP"
    if isinstance(value, bytes):
        return "BINARY"
    if isinstance(value, (str, ObjectId, Decimal128, uuid.UUID)) or depth >= _MAX_DEPTH:
        return "STRING"
    if isinstance(value, Mapping):
        fields: dict[str, _Type] = {}
        for key, item in value.items():
            fields[key] = _merge(fields.get(key), _of(item, depth + 1))
        return ("STRUCT", fields)
    if isinstance(value, list):
        element: _Type = None
        for item in value:
            element = _merge(element, _of(item, depth + 1))
        return ("ARRAY", element)
    return "STRING"  # Timestamp, Regex, Code, MinKey, ...: relaxed Extended JSON


def _merge(a: _Type, b: _Type) -> _Type:
    if a is None:
        return b
    if b is None or a == b:
        return a
    numbers = {"INT": 0, "BIGINT": 1, "DOUBLE": 2}
    if isinstance(a, str) and isinstance(b, str) and a in numbers and b in numbers:
        return a if numbers[a] > numbers[b] else b
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0]:
        if a[0] == "ARRAY":
            return ("ARRAY", _merge(a[1], b[1]))
        fields = dict(a[1])
        for key, kind in b[1].items():
            fields[key] = _merge(fields.get(key), kind)
        return ("STRUCT", fields)
    return "STRING"


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _render(kind: _Type) -> str:
    if kind is None:
        return "STRING"
    if isinstance(kind, str):
        return kind
    if kind[0] == "ARRAY":
        return f"ARRAY<{_render(kind[1])}>"
    fields: dict[str, _Type] = kind[1]
    if not fields:
        return "STRING"  # an empty STRUCT is not valid DDL; {} as JSON text
    if len(fields) >= MAP_MIN_KEYS:
        value: _Type = None
        for item in fields.values():
            value = _merge(value, item)
        return f"MAP<STRING, {_render(value)}>"
    return "STRUCT<" + ", ".join(f"{_quote(k)}: {_render(v)}" for k, v in fields.items()) + ">"


def infer_ddl(documents: Iterable[Mapping[str, Any]]) -> str:
    """The Spark DDL (``"`_id` STRING, `qty` INT, ..."``) that holds every document given.

    Raises ``ValueError`` when there is no document to infer from.
    """
    top: _Type = None
    for document in documents:
        top = _merge(top, _of(document, 0))
    if not isinstance(top, tuple) or not top[1]:
        raise ValueError("no documents to infer a schema from")
    return ", ".join(f"{_quote(k)} {_render(v)}" for k, v in top[1].items())


def sample_ddl(collection: Any, sample_size: int) -> str:
    """Sample ``collection`` (a PyMongo ``Collection``) and propose its ``full_document_schema``."""
    documents = list(collection.aggregate([{"$sample": {"size": sample_size}}]))
    if not documents:
        raise ValueError(
            f"infer_schema: {collection.full_name} is empty, so there is nothing to infer a "
            "schema from; pass full_document_schema instead"
        )
    ddl = infer_ddl(documents)
    log.info(
        "infer_schema: full_document_schema inferred from %d documents of %s (pin it with "
        "option full_document_schema to keep the query's schema stable): %s",
        len(documents), collection.full_name, ddl,
    )
    return ddl
