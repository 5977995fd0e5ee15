"""A bounded cache of the change events built from a deployment's oplog entries.

An oplog entry never changes once written, so the events the transform makes
from it depend only on the entry and on the stream's *shape* (scope, options,
token version, emulated version). Streams of one shape over the same range
(repeated benchmark reads, the Spark source's token scan then its read,
several consumers of one collection) share them through the cache; once one
stream has encoded an event, the others copy its bytes. What depends on a
stream's own state or on mutable data runs per stream on top: resume checks,
invalidation, pre/post images (``updateLookup`` reads the current document),
user stages and split fragments.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence
from typing import Any, Final

CACHE_BYTES: Final = 64 * 1024 * 1024
"""Default bound of one deployment's cache: the estimated memory of the events it holds
(about 43,000 small inserts for one stream shape). Tests embedding the simulator keep a
modest footprint; benchmarks ask for more (``ReplicaSet(event_cache_bytes=...)``,
``serve --event-cache-mb``)."""
EVENT_OVERHEAD: Final = 1250
"""Estimated memory of one cached event besides the oplog entry's size: its dict, token,
BSON framing and slot in the cache (measured for small inserts, whose BSON is encoded)."""
ENTRY_OVERHEAD: Final = 150
"""Estimated memory of the cache slot of one oplog entry."""

class EventCache:
    """The events of recent oplog entries per stream shape, bounded by estimated bytes.

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
        self._events: dict[tuple[int, str], Sequence[Any]] = {}
        self._keys: list[tuple[int, str, int]] = []
        """A heap of (seq, shape, cost) per cached entry: the oldest is evicted first."""

    def get(self, seq: int, shape: str) -> Sequence[Any] | None:
        return self._events.get((seq, shape))

    def put(self, seq: int, shape: str, events: Sequence[Any], entry_size: int) -> None:
        """Remember the ``events`` entry ``seq`` (of ``entry_size`` bytes) made for ``shape``."""
        key = (seq, shape)
        cost = ENTRY_OVERHEAD + (EVENT_OVERHEAD + entry_size) * len(events)
        with self._lock:
            if key in self._events:
                return
            if self.size + cost > self.max_bytes and (not self._keys or seq < self._keys[0][0]):
                return  # older than everything kept (or larger than the whole cache)
            self._events[key] = events
            heapq.heappush(self._keys, (seq, shape, cost))
            self.size += cost
            while self.size > self.max_bytes:
                old_seq, old_shape, old_cost = heapq.heappop(self._keys)
                del self._events[old_seq, old_shape]
                self.size -= old_cost

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self._keys.clear()
            self.size = 0

    def __len__(self) -> int:
        """How many (entry, shape) results are held."""
        return len(self._events)
