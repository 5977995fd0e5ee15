"""Cluster time: the ``Timestamp(seconds, increment)`` every write is stamped with."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from bson.timestamp import Timestamp

ZERO_SIGNATURE_HASH = b"\x00" * 20


class ClusterClock:
    """Hands out strictly increasing oplog timestamps, as mongod's LogicalClock does.

    Seconds follow the wall clock; the increment counts writes within a second.
    ``advance`` takes gossiped ``$clusterTime`` values (never goes backwards).
    """

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now = now
        self._lock = threading.Lock()
        secs = int(now())
        self._last = Timestamp(secs, 1)

    def tick(self) -> Timestamp:
        """Reserve and return the next timestamp."""
        with self._lock:
            secs = int(self._now())
            if secs > self._last.time:
                self._last = Timestamp(secs, 1)
            else:
                self._last = Timestamp(self._last.time, self._last.inc + 1)
            return self._last

    def current(self) -> Timestamp:
        """The latest timestamp handed out (the cluster time to gossip)."""
        with self._lock:
            return self._last

    def advance(self, ts: Timestamp) -> None:
        """Move forward to a gossiped cluster time if it is ahead."""
        with self._lock:
            if (ts.time, ts.inc) > (self._last.time, self._last.inc):
                self._last = ts

    def wall(self) -> datetime:
        """Wall-clock time with millisecond precision (what BSON dates keep)."""
        now = self._now()
        ms = int(now * 1000)
        return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)

    def cluster_time_doc(self) -> dict[str, object]:
        """The ``$clusterTime`` document (dummy-signed, as with auth disabled)."""
        from bson.binary import Binary
        from bson.int64 import Int64

        return {
            "clusterTime": self.current(),
            "signature": {"hash": Binary(ZERO_SIGNATURE_HASH, 0), "keyId": Int64(0)},
        }
