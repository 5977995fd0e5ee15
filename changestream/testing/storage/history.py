"""Document history for point-in-time reads (``readConcern: {level: "snapshot", atClusterTime}``).

mongod keeps old versions of documents for ``minSnapshotHistoryWindowInSeconds``
(300 s by default) so that a read can see the data as it was at a cluster time
inside that window; older times fail with SnapshotTooOld (239).

The simulator keeps per-document version chains. Every storage write gets a
write number; every oplog entry records which write number was the last one
applied when it was stamped (a *mark*). A read at cluster time ``T`` sees the
writes up to the last mark at or before ``T``. Before a document's write
number ``w`` changes it, the chain stores ``(w, version before the write)``, so
the version visible at read point ``c`` is the one saved by the first write
after ``c``, or the current document if there is none.

Memory is bounded twice: chain entries and marks older than the window are
pruned as writes arrive (amortised O(1)), and at most :attr:`History.max_versions`
old versions are kept; past that the oldest go and the oldest readable time
moves forward (reads before it get SnapshotTooOld, as when WiredTiger's
history store is under pressure).
"""

from __future__ import annotations

import bisect
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from bson.timestamp import Timestamp

from ..core.errors import CommandError

DEFAULT_WINDOW_SECONDS = 300
DEFAULT_MAX_VERSIONS = 250_000

SNAPSHOT_TOO_OLD = 239

_Key = tuple[int, int]


def _key(ts: Timestamp) -> _Key:
    return ts.time, ts.inc


class History:
    """Old document versions and the cluster-time -> write-number map of one deployment."""

    def __init__(
        self,
        now: Callable[[], float] = time.time,
        *,
        window_seconds: int = DEFAULT_WINDOW_SECONDS,
        max_versions: int = DEFAULT_MAX_VERSIONS,
    ) -> None:
        self._now = now
        self._lock = threading.Lock()
        self.window_seconds = window_seconds
        """``minSnapshotHistoryWindowInSeconds`` (``setParameter`` changes it)."""
        self.max_versions = max_versions
        self._write_no = 0
        self._mark_ts: list[_Key] = []
        self._mark_writes: list[int] = []
        self._mark_start = 0
        """Marks before this index are pruned (the lists are compacted now and then)."""
        self._pruned_to: _Key = (0, 0)
        self._base: tuple[_Key, int] = ((0, 0), 0)
        """The newest pruned mark: reads between it and the first kept mark use its write number."""
        self._chains: dict[uuid.UUID, dict[Hashable, list[tuple[int, dict[str, Any] | None]]]] = {}
        self._order: deque[tuple[int, uuid.UUID, Hashable]] = deque()
        self._forced_oldest: _Key = (0, 0)
        self._catalog_ts: dict[uuid.UUID, _Key] = {}

    # -- writes (the caller holds the deployment lock) -----------------------------
    def record(self, coll: uuid.UUID, key: Hashable, before: dict[str, Any] | None) -> None:
        """A storage write is about to replace ``before`` (None: absent) under ``key``."""
        with self._lock:
            self._write_no += 1
            w = self._write_no
            self._chains.setdefault(coll, {}).setdefault(key, []).append((w, before))
            self._order.append((w, coll, key))
            if len(self._order) > self.max_versions:
                self._evict_locked(len(self._order) - self.max_versions + self.max_versions // 10)

    def mark(self, ts: Timestamp, *, catalog_change: uuid.UUID | None = None) -> None:
        """An oplog entry was stamped ``ts``: reads at ``ts`` see every write so far.

        ``catalog_change``: the entry created or renamed that collection (mongod
        refuses older snapshot reads of it on 5.0 and 6.0).
        """
        with self._lock:
            key = _key(ts)
            self._mark_ts.append(key)
            self._mark_writes.append(self._write_no)
            if catalog_change is not None:
                self._catalog_ts[catalog_change] = key
            self._prune_locked()

    def restarted(self, at: Timestamp) -> None:
        """The deployment was loaded from disk at ``at``: no history before it (as after a
        mongod restart, older reads get SnapshotTooOld)."""
        with self._lock:
            self._chains.clear()
            self._order.clear()
            self._mark_ts, self._mark_writes, self._mark_start = [], [], 0
            self._catalog_ts.clear()
            self._base = (_key(at), self._write_no)
            self._forced_oldest = max(self._forced_oldest, _key(at))

    # -- reads -------------------------------------------------------------------
    def oldest(self) -> Timestamp:
        """The oldest cluster time a snapshot read may still use."""
        with self._lock:
            return Timestamp(*self._oldest_locked())

    def check(self, ts: Timestamp) -> None:
        """SnapshotTooOld (239) if ``ts`` has left the history window."""
        with self._lock:
            if _key(ts) < self._oldest_locked():
                raise CommandError(
                    SNAPSHOT_TOO_OLD,
                    f"Read timestamp Timestamp({ts.time}, {ts.inc}) is older than the oldest "
                    "available timestamp.",
                )

    def read_point(self, ts: Timestamp) -> int:
        """The write number a read at ``ts`` sees (SnapshotTooOld if ``ts`` is too old)."""
        self.check(ts)
        with self._lock:
            return self._point_locked(_key(ts))

    def _point_locked(self, key: _Key) -> int:
        i = bisect.bisect_right(self._mark_ts, key, lo=self._mark_start)
        if i == self._mark_start:
            return self._base[1] if key >= self._base[0] else 0
        return self._mark_writes[i - 1]

    def created_after(self, coll: uuid.UUID, ts: Timestamp) -> Timestamp | None:
        """When ``coll`` was created or renamed, if that was after ``ts``."""
        with self._lock:
            when = self._catalog_ts.get(coll)
        return Timestamp(*when) if when is not None and when > _key(ts) else None

    def versions_at(
        self,
        coll: uuid.UUID,
        current: Mapping[Hashable, dict[str, Any]],
        point: int,
        keep: Callable[[Any], bool] | None = None,
    ) -> list[dict[str, Any]]:
        """The stored documents of ``coll`` as they were at write number ``point``; with
        ``keep``, only those whose ``_id`` it accepts (tested before any version is looked up,
        as mongod walks only the index range a read asks for).

        ``current`` maps each id key to its stored document now. The documents
        returned are the stored objects (never mutated by the engine, never to
        be mutated by the caller). The caller holds the deployment's lock, as
        every write and oplog entry does, so no chain changes meanwhile (copying
        each of them cost 1.7 µs a document per read).
        """
        with self._lock:
            chains = dict(self._chains.get(coll, {}))
        out: list[dict[str, Any]] = []
        if keep is None:
            keep = _every
            if not chains:
                out.extend(current.values())
                return out
        for key, doc in current.items():
            if not keep(doc["_id"]):  # an _id never changes: the current one is every version's
                continue
            chain = chains.get(key)
            if chain is None or chain[-1][0] <= point:  # no write to it after the read time
                out.append(doc)
                continue
            version = _visible(chain, point, doc)
            if version is not None:
                out.append(version)
        for key, chain in chains.items():
            if key in current or chain[-1][0] <= point:
                continue  # read above, or deleted before the read time
            version = _visible(chain, point, None)
            if version is not None and keep(version["_id"]):
                out.append(version)
        return out

    def stats(self) -> dict[str, int]:
        """Sizes, for tests and benchmarks."""
        with self._lock:
            return {
                "versions": len(self._order),
                "marks": len(self._mark_ts) - self._mark_start,
                "chains": sum(len(c) for c in self._chains.values()),
            }

    # -- pruning -------------------------------------------------------------------
    def _oldest_locked(self) -> _Key:
        by_window = (max(int(self._now()) - self.window_seconds, 0), 0)
        if self._mark_start < len(self._mark_ts):
            # as mongod's oldest timestamp trails the stable (last written) one, the latest
            # write stays readable however long ago it was
            by_window = min(by_window, self._mark_ts[-1])
        return max(by_window, self._forced_oldest, self._pruned_to)

    def _prune_locked(self) -> None:
        oldest = self._oldest_locked()
        self._pruned_to = oldest  # a larger window later cannot bring pruned versions back
        marks, writes = self._mark_ts, self._mark_writes
        # keep the last mark at or before ``oldest``: reads at ``oldest`` need it
        start = self._mark_start
        while start + 1 < len(marks) and marks[start + 1] <= oldest:
            start += 1
        if start > self._mark_start:
            self._base = (marks[start - 1], writes[start - 1])
            self._mark_start = start
            if start > 4096 and start * 2 > len(marks):
                del marks[:start], writes[:start]
                self._mark_start = 0
        self._drop_versions_locked(self._point_locked(oldest))
        for coll, when in list(self._catalog_ts.items()) if self._catalog_ts else ():
            if when <= oldest:
                del self._catalog_ts[coll]

    def _drop_versions_locked(self, floor: int) -> None:
        """Forget versions no read at write number >= ``floor`` can see."""
        order = self._order
        while order and order[0][0] <= floor:
            _, coll, key = order.popleft()
            self._trim_chain_locked(coll, key, floor)

    def _trim_chain_locked(self, coll: uuid.UUID, key: Hashable, floor: int) -> None:
        chains = self._chains.get(coll)
        if chains is None:
            return
        chain = chains.get(key)
        if chain is None:
            return
        drop = 0
        while drop < len(chain) and chain[drop][0] <= floor:
            drop += 1
        if drop == len(chain):
            del chains[key]
            if not chains:
                del self._chains[coll]
        elif drop:
            del chain[:drop]

    def _evict_locked(self, count: int) -> None:
        """Over :attr:`max_versions`: drop the ``count`` oldest versions, move the oldest time."""
        cut = self._order[min(count, len(self._order)) - 1][0]
        # reads must now see at least write ``cut``: the oldest readable mark is the first
        # whose write number is >= cut
        i = bisect.bisect_left(self._mark_writes, cut, lo=self._mark_start)
        if i < len(self._mark_ts):
            self._forced_oldest = max(self._forced_oldest, self._mark_ts[i])
        else:
            t = int(self._now())
            self._forced_oldest = max(self._forced_oldest, (t + 1, 0))
        self._drop_versions_locked(cut)


def _every(_: Any) -> bool:
    return True


def _visible(
    chain: list[tuple[int, dict[str, Any] | None]], point: int, current: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The version saved by the first write after ``point``, else ``current``."""
    lo, hi = 0, len(chain)
    while lo < hi:
        mid = (lo + hi) // 2
        if chain[mid][0] <= point:
            lo = mid + 1
        else:
            hi = mid
    return chain[lo][1] if lo < len(chain) else current
