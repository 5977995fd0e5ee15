"""Change events encoded once, so a reply copies their bytes instead of encoding them.

Events built from one oplog entry for one stream shape are kept in the
deployment's :class:`~changestream.testing.core.event_cache.EventCache` and shared
by every stream of that shape.
"""

from __future__ import annotations

import copy
from typing import Any, Final

import bson

from ..core.codec import ENCODE_OPTIONS

_RAW_BSON_DOCUMENT_MARKER: Final = 101
"""``bson.raw_bson.RawBSONDocument._type_marker``: pymongo's encoders copy ``raw`` as is."""


class EncodedEvent(dict[str, Any]):
    """A change event that carries its own BSON, so a reply copies it instead of encoding it.

    It is the event's dict for everything in this process (pipelines, tests);
    pymongo's encoder sees the :class:`~bson.raw_bson.RawBSONDocument` marker and
    writes ``raw`` (also where a user stage nests it in another document).
    Never mutate one: ``raw`` would no longer match.
    """

    __slots__ = ("raw",)
    _type_marker = _RAW_BSON_DOCUMENT_MARKER
    raw: bytes

    def __copy__(self) -> dict[str, Any]:
        return dict(self)  # a copy may be changed: it must be encoded again

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return copy.deepcopy(dict(self), memo)


_encode_nested = bson._dict_to_bson
"""pymongo's document encoder; ``top_level=False`` keeps ``_id`` where it is, as in an array."""


def encode_event(doc: dict[str, Any]) -> EncodedEvent:
    """``doc`` with the bytes it has inside a reply's batch (its size is their length)."""
    event = EncodedEvent(doc)
    event.raw = _encode_nested(doc, False, ENCODE_OPTIONS, False)
    return event
