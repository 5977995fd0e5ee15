"""Relaxed Extended JSON of documents, byte for byte ``json_util.dumps``'s, at C-encoder speed.

The Delta sink stores each document as relaxed Extended JSON. ``json_util.dumps``
walks every document in Python before the ``json`` module encodes it
(about 25-40 µs for a 230-byte order on the benchmark machine), which alone
would cap a first load below 40,000 documents/s. Here the ``json`` module's
C encoder walks the document and calls back only for the two BSON types
that ordinary documents hold (ObjectId, UTC datetimes after 1970), in the
very form ``json_util`` gives them; any other value (a NaN, bytes, a
Decimal128, a RawBSONDocument, ...) sends the whole document to
``json_util.dumps``, so the text never differs from it.

JavaScript code, which the C encoder would write as a plain string, is held as a
``JsCode`` in documents decoded from their bytes (:func:`._js_code.decode_held`) and
searched for in the others (:mod:`._js_code`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from typing import Any

from bson import json_util
from bson.objectid import ObjectId

from ._js_code import JsCode, code_json, decode_held, holds_code, unmarked

__all__ = ["relaxed_dumps", "relaxed_key", "relaxed_text"]

_RELAXED = json_util.RELAXED_JSON_OPTIONS


class _Unusual(Exception):
    """A value this encoder leaves to ``json_util`` (raised out of the C encoder)."""


_UTC = datetime.timezone.utc


def _default(value: Any) -> Any:
    kind = type(value)
    if kind is ObjectId:
        return {"$oid": value.binary.hex()}
    if kind is datetime.datetime and value.year >= 1970:
        tz = value.tzinfo  # naive: UTC, as json_util takes it
        if tz is None or tz is _UTC or not value.utcoffset():
            # %-formatting is one C call: f-strings with widths cost twice the whole encoding
            millis = value.microsecond // 1000
            if millis:
                return {"$date": "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ" % (  # noqa: UP031
                    value.year, value.month, value.day, value.hour, value.minute,
                    value.second, millis)}
            return {"$date": "%04d-%02d-%02dT%02d:%02d:%02dZ" % (  # noqa: UP031
                value.year, value.month, value.day, value.hour, value.minute, value.second)}
    if kind is JsCode:
        return code_json(value)
    raise _Unusual


def _encoder(item_separator: str, key_separator: str) -> Callable[[Any], str]:
    """``JSONEncoder(default=_default, allow_nan=False, ...).encode`` without its per-call set-up.

    ``JSONEncoder.encode`` builds the C encoder anew for every document; built once here
    (no circular-reference check: decoded BSON has no cycles).
    """
    c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
    if c_make_encoder is None:  # no C accelerator: the plain encoder
        return json.JSONEncoder(default=_default, allow_nan=False,
                                separators=(item_separator, key_separator)).encode
    encode = c_make_encoder(None, _default, json.encoder.encode_basestring_ascii, None,
                            key_separator, item_separator, False, False, False)

    def run(value: Any) -> str:
        return "".join(encode(value, 0))

    return run


_ENCODE = _encoder(", ", ": ")
_ENCODE_COMPACT = _encoder(",", ":")


def relaxed_dumps(document: Any, *, held: bool = False) -> str:
    """``json_util.dumps(document, json_options=RELAXED_JSON_OPTIONS)``, faster.

    ``held``: decoded by :func:`._js_code.decode_held`, so no ``Code`` to search for (a
    ``JsCode`` is written as ``json_util`` writes code, with ``held`` or without)."""
    if not held and holds_code(document):
        return json_util.dumps(document, json_options=_RELAXED)
    try:
        return _ENCODE(document)
    except (_Unusual, ValueError, TypeError):
        return json_util.dumps(unmarked(document), json_options=_RELAXED)


def relaxed_text(raw: bytes) -> str:
    """``relaxed_dumps`` of a BSON document given as its bytes (the sink's documents)."""
    return relaxed_dumps(decode_held(raw), held=True)


def relaxed_key(key: Any) -> str:
    """The key column's text of an ``_id`` (compact relaxed Extended JSON), faster
    (a key from :func:`._js_code.decode_held` may hold a ``JsCode``)."""
    if type(key) is ObjectId:
        return f'{{"$oid":"{key.binary.hex()}"}}'
    if holds_code(key):
        return json_util.dumps(key, json_options=_RELAXED, separators=(",", ":"))
    try:
        return _ENCODE_COMPACT(key)
    except (_Unusual, ValueError, TypeError):
        return json_util.dumps(unmarked(key), json_options=_RELAXED, separators=(",", ":"))
