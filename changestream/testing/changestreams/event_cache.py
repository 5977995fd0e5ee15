"""Change events encoded once, and a bounded cache of them shared by a deployment's streams.

An oplog entry never changes once written, so the events a stream makes from
it depend only on the entry and on the stream's *shape* (scope, options, token
version, user stages, emulated version). A second stream over the same range
(repeated benchmark reads, the Spark source's token scan then read, several
consumers of one collection) takes the encoded events from the cache instead
of building them again. Nothing that depends on mutable state is cached
(``updateLookup`` reads the current document), nor what depends on the
stream's own progress (resume checks, invalidation, split fragments).
"""

from __future__ import annotations

import heapq
import threading
import weakref
from typing import TYPE_CHECKING, Any, Final

import bson

from ..wire import ENCODE_OPTIONS

if TYPE_CHECKING:
    from ..oplog import Oplog

CACHE_BYTES: Final = 64 * 1024 * 1024
"""Default bound of one deployment's cache (estimated memory of the cached events)."""
EVENT_OVERHEAD: Final = 900
"""Estimated memory of one cached event beyond its BSON: the dict, its token and outputs."""

_RAW_BSON_DOCUMENT_MARKER: Final = 101
"""``bson.raw_bson.RawBSONDocument._type_marker``: pymongo's encoders copy ``raw`` as is."""


class EncodedEvent(dict[str, Any]):
    """A change event that carries its own BSON, so a reply copies it instead of encoding it.

    It is the event's dict for everything in this process (pipelines, tests);
    pymongo's encoder sees the :class:`~bson.raw_bson.RawBSONDocument` marker and
    writes ``raw``. Never mutate one: ``raw`` would no longer match.
    """

    __slots__ = ("raw",)
    _type_marker = _RAW_BSON_DOCUMENT_MARKER
    raw: bytes


_encode_nested = bson._dict_to_bson
"""pymongo's document encoder; ``top_level=False`` keeps ``_id`` where it is, as in an array."""


def encode_event(doc: dict[str, Any]) -> EncodedEvent:
    """``doc`` with the bytes it has inside a reply's batch (which its size is measured by)."""
    event = EncodedEvent(doc)
    event.raw = _encode_nested(doc, False, ENCODE_OPTIONS, False)
    return event


Outputs = tuple[tuple[dict[str, Any], int, Any], ...]
"""What one oplog entry produced for one stream shape: (document, size, clusterTime) each."""


class EventCache:
    """The outputs of recent oplog entries per stream shape, bounded by estimated bytes.

    Keeps the newest entries (by oplog seq): when full it evicts the oldest
    entry, and does not admit one older than everything it holds. Consumers
    tailing the oplog share the latest entries; repeated reads of a range
    larger than the cache hit its newest part instead of evicting each other
    (as LRU and FIFO would). Thread-safe.
    """

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        """Estimated bytes held."""
        self._lock = threading.Lock()
        self._entries: dict[int, dict[str, Outputs]] = {}
        self._costs: dict[int, int] = {}
        self._seqs: list[int] = []
        """A heap of the cached seqs: the oldest is evicted first."""

    def get(self, seq: int, shape: str) -> Outputs | None:
        per_shape = self._entries.get(seq)
        return None if per_shape is None else per_shape.get(shape)

    def put(self, seq: int, shape: str, outputs: Outputs) -> None:
        """Remember what entry ``seq`` produced for ``shape``."""
        cost = sum(size + EVENT_OVERHEAD for _, size, _ in outputs) + EVENT_OVERHEAD
        with self._lock:
            per_shape = self._entries.get(seq)
            if per_shape is None:
                full = self.size + cost > self.max_bytes
                if full and (not self._seqs or seq < self._seqs[0]):
                    return  # older than everything kept (or larger than the whole cache)
                per_shape = self._entries[seq] = {}
                self._costs[seq] = 0
                heapq.heappush(self._seqs, seq)
            elif shape in per_shape:
                return
            per_shape[shape] = outputs
            self._costs[seq] += cost
            self.size += cost
            while self.size > self.max_bytes:
                oldest = heapq.heappop(self._seqs)
                del self._entries[oldest]
                self.size -= self._costs.pop(oldest)

    def __len__(self) -> int:
        """How many (entry, shape) outputs are held."""
        return sum(len(per_shape) for per_shape in self._entries.values())


_caches: weakref.WeakKeyDictionary[Oplog, EventCache] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def cache_for(oplog: Oplog) -> EventCache:
    """The cache of ``oplog``'s events (one per deployment, created on first use)."""
    with _caches_lock:
        cache = _caches.get(oplog)
        if cache is None:
            cache = _caches[oplog] = EventCache()
        return cache
