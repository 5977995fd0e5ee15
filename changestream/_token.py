"""Helpers for applications that store resume tokens.

A resume token is an opaque document ``{_data: <hex KeyString>[, _typeBits:
BinData(0)]}``; it must come back to the server byte-for-byte (including
``_typeBits``), so it is stored as Extended JSON, which keeps BSON types.
The cluster time is read from the KeyString prefix (``0x82`` + 8 bytes of
timestamp) without any other knowledge of the token layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bson import json_util
from bson.timestamp import Timestamp

__all__ = ["token_cluster_time", "token_from_json", "token_to_json"]

_KEYSTRING_TIMESTAMP = 0x82


def token_to_json(token: Mapping[str, Any], *, canonical: bool = False) -> str:
    """Serialise a resume token as Extended JSON (relaxed by default, or canonical).

    Both modes keep ``_typeBits`` as ``{"$binary": ...}`` so
    :func:`token_from_json` restores the exact BSON.
    """
    if not isinstance(token, Mapping):
        raise TypeError(f"token must be a document (mapping), not {type(token).__name__}")
    options = json_util.CANONICAL_JSON_OPTIONS if canonical else json_util.RELAXED_JSON_OPTIONS
    return json_util.dumps(token, json_options=options)


def token_from_json(text: str | bytes) -> dict[str, Any]:
    """Parse a token stored with :func:`token_to_json`; raise ``ValueError`` if it is not one."""
    try:
        token = json_util.loads(text)
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"not a resume token in Extended JSON: {exc}") from exc
    if not isinstance(token, dict) or "_data" not in token:
        raise ValueError("not a resume token: expected a document with a '_data' field")
    return token


def token_cluster_time(token: Mapping[str, Any]) -> Timestamp | None:
    """The cluster time a token points at, or ``None`` if it cannot be decoded.

    Works for hex-string tokens (4.0+) and BinData tokens (3.6).
    """
    data = token.get("_data") if isinstance(token, Mapping) else None
    if isinstance(data, str):
        try:
            raw = bytes.fromhex(data[:18])
        except ValueError:
            return None
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data[:9])
    else:
        return None
    if len(raw) < 9 or raw[0] != _KEYSTRING_TIMESTAMP:
        return None
    return Timestamp(int.from_bytes(raw[1:5], "big"), int.from_bytes(raw[5:9], "big"))
