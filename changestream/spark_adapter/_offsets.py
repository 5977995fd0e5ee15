"""Resume tokens as Spark offsets: JSON-able dicts, and token order.

Spark writes offsets verbatim into ``<checkpoint>/offsets/<batch>`` after a
``json.dumps``, so a token must be plain JSON: it is stored as relaxed
Extended JSON (``_typeBits`` survives as ``{"$binary": ...}``). An offset is
``{"v": 1, "token": {"_data": ...}}`` plus two optional flags:

* ``"start_after": true``: the token came from the user (``startup_mode=token``)
  and may be an ``invalidate`` token, which only ``startAfter`` accepts;
* ``"idle": true``: the driver saw no event between the previous offset and
  this one (an idle advance to a postBatchResumeToken), so the range is empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .. import token_from_json, token_to_json
from .._token import ResumeToken

__all__ = [
    "OFFSET_VERSION",
    "make_offset",
    "offset_token",
    "offset_watch_option",
    "same_position",
    "token_data",
    "token_passed",
]

OFFSET_VERSION = 1


def make_offset(
    token: Mapping[str, Any], *, start_after: bool = False, idle: bool = False
) -> dict[str, Any]:
    """The Spark offset for ``token`` (a resume token as returned by the client)."""
    offset: dict[str, Any] = {"v": OFFSET_VERSION, "token": json.loads(token_to_json(token))}
    if start_after:
        offset["start_after"] = True
    if idle:
        offset["idle"] = True
    return offset


def offset_token(offset: Mapping[str, Any]) -> dict[str, Any]:
    """The resume token (BSON-ready document) an offset points at."""
    if (
        not isinstance(offset, Mapping)
        or offset.get("v") != OFFSET_VERSION
        or "token" not in offset
    ):
        raise ValueError(
            f"not a changestream offset (expected {{'v': {OFFSET_VERSION}, 'token': ...}}): "
            f"{offset!r}; was this checkpoint written by another source?"
        )
    return token_from_json(json.dumps(offset["token"]))


def offset_watch_option(offset: Mapping[str, Any]) -> dict[str, Any]:
    """``watch()`` keyword that starts right after ``offset`` (``resume_after`` or ``start_after``)."""
    key = "start_after" if offset.get("start_after") else "resume_after"
    return {key: offset_token(offset)}


def same_position(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two offsets point at the same token (flags ignored)."""
    return bool(a.get("token") == b.get("token"))


def token_data(token: Mapping[str, Any]) -> str:
    """The ``_data`` hex string of a token, for per-event comparisons on the read-ahead path.

    Upper-case hex of a KeyString orders as its bytes do, i.e. as
    :class:`~changestream._token.ResumeToken` orders; this skips building one per event.
    """
    data = token.get("_data")
    if not isinstance(data, str):
        raise ValueError(f"resume token without a hex string '_data': {token!r}")
    return data


def token_passed(token: Mapping[str, Any], bound: Mapping[str, Any]) -> bool:
    """Whether ``token`` sorts strictly after ``bound`` (:class:`ResumeToken` order).

    ``_data`` is a KeyString, memcmp-ordered: tokens of the same version order
    by clusterTime, then high-water-mark before events, then txnOpIndex, ....
    Used only as a fallback after exact equality.
    """
    token_data(token)  # ValueError unless both are 4.0+ (hex string) tokens
    token_data(bound)
    return ResumeToken.of(token).key > ResumeToken.of(bound).key
