"""A bounded cache of the change events built from a deployment's oplog entries.

An oplog entry never changes once written, so the events the transform makes
from it depend only on the entry and on the options that shape them (token
version, emulated version, ``showExpandedEvents``...). A CRUD entry's event is
the same for a collection, a database and a cluster stream: each stream decides
whether it sees the entry, and all that do share one event (built once, encoded
once: the others copy its bytes). Commands and transactions, whose events depend
on the scope, are shared by streams of the same scope and options. Streams
tailing the oplog together, repeated reads of a range and the Spark source's
token scan then its read all share through the cache. What depends on a
stream's own state or on mutable data runs per stream on top: resume checks,
invalidation, pre/post images (``updateLookup`` reads the current document),
user stages and split fragments.

The cache is bounded by estimated bytes, and emptied once no stream has used it
for :data:`IDLE_SECONDS`, so a server's memory comes back after its streams close.
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

CACHE_BYTES: Final = 16 * 1024 * 1024
"""Default bound of one deployment's cache: the estimated memory of the events it holds
(about 10,000 small events, which the estimate matches within a few percent). Streams
tailing the oplog together stay well within it; a server under sustained writes keeps
a modest footprint. Benchmarks re-reading long ranges ask for more
(``ReplicaSet(event_cache_bytes=...)``, ``serve --event-cache-mb``)."""
EVENT_OVERHEAD: Final = 1250
"""Estimated memory of one cached event besides the oplog entry's size: its dict, token,
BSON framing and slot in the cache (measured for small inserts, whose BSON is encoded)."""
ENTRY_OVERHEAD: Final = 150
"""Estimated memory of the cache slot of one oplog entry."""
IDLE_SECONDS: Final = 10.0
"""A cache no change stream has used for this long is emptied: its memory goes back once
the streams are gone, and a stream that closes and reopens (a Spark microbatch's token
scan, then its read) still finds its events."""

class EventCache:
    """The events of recent oplog entries per stream shape, bounded by estimated bytes.

    Keeps the newest entries (by oplog seq): when full it evicts the oldest
    entry, and does not admit one older than everything it holds. Consumers
    tailing the oplog share the latest entries; repeated reads of a range
    larger than the cache hit its newest part instead of evicting each other
    (as LRU and FIFO would). Thread-safe.
    """

    def __init__(self, max_bytes: int = CACHE_BYTES, idle_seconds: float = IDLE_SECONDS) -> None:
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self.size = 0
        """Estimated bytes held."""
        self._lock = threading.Lock()
        self._events: dict[tuple[int, str], Sequence[Any]] = {}
        self._keys: list[tuple[int, str, int]] = []
        """A heap of (seq, shape, cost) per cached entry: the oldest is evicted first."""
        self._readers = 0
        self._idle_timer: threading.Timer | None = None
        self._timer_thread: threading.Timer | None = None
        """The last idle timer started, cancelled or not: close() joins it (it may still be
        expiring after :attr:`_idle_timer` was cleared)."""
        self._closed = False

    # -- readers -----------------------------------------------------------------------------------
    def acquire(self) -> Callable[[], None]:
        """Count one more stream reading; call what this returns when it is gone.

        When the last reader is gone the cache is emptied :attr:`idle_seconds` later,
        unless a reader came back meanwhile.
        """
        with self._lock:
            self._readers += 1
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        return self._release

    def _release(self) -> None:
        with self._lock:
            self._readers -= 1
            if self._readers or not self._events or self._closed:
                return
            timer = self._idle_timer = threading.Timer(self.idle_seconds, self._expire)
            timer.daemon = True
            timer.name = "sim-event-cache-idle"
            self._timer_thread = timer
            # started under the lock: close() (another thread) then joins a started timer,
            # never one it cannot join yet that would start after the deployment stopped
            timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._readers or self._idle_timer is None:
                return
            self._idle_timer = None
            self._clear_locked()
        _return_freed_memory()

    def close(self) -> None:
        """Empty the cache and end its idle timer's thread before returning (the deployment
        stopped: no thread of it outlives :meth:`~changestream.testing.ReplicaSet.stop`)."""
        with self._lock:
            self._closed = True
            timer, self._idle_timer = self._idle_timer, None
            thread, self._timer_thread = self._timer_thread, None
            self._clear_locked()
        if timer is not None:
            timer.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def readers(self) -> int:
        """Streams reading through this cache now."""
        return self._readers

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
            self._clear_locked()

    def _clear_locked(self) -> None:
        self._events = {}
        self._keys = []
        self.size = 0

    def __len__(self) -> int:
        """How many (entry, shape) results are held."""
        return len(self._events)


def _return_freed_memory() -> None:
    """Ask glibc to give freed heap pages back to the system (``malloc_trim``).

    The events of a full cache are many small allocations spread over the heap and
    over the arenas of the threads that built them; freeing them does not lower the
    RSS until the allocator trims. Elsewhere than glibc this does nothing.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if sys.platform != "linux":
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return trim
