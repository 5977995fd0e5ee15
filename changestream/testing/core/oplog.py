"""The replicated operation log: what writes produce and change streams read.

Entries use mongod's own oplog vocabulary (``op``, ``ns``, ``ui``, ``o``,
``o2``) so the change-stream transform can follow the server source. The
oplog is bounded: when it exceeds its size, the oldest entries drop off and a
change stream that resumes before the first remaining entry fails with
ChangeStreamHistoryLost (286), as on a real replica set.
"""

from __future__ import annotations

import bisect
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from bson.timestamp import Timestamp


@dataclass(slots=True)
class OplogEntry:
    """One oplog entry.

    ``op``: ``"i"`` insert, ``"u"`` update, ``"d"`` delete, ``"c"`` command,
    ``"n"`` no-op. ``ns`` is ``"db.coll"`` for CRUD and ``"db.$cmd"`` for
    commands (``"admin.$cmd"`` for a transaction's ``applyOps``).

    CRUD shapes (as mongod writes them):

    * insert: ``o`` = the full document, ``o2`` = the document key ``{_id}``.
    * update: ``o`` = ``{"$v": 2, "diff": <v2 diff>}``, ``o2`` = ``{_id}``.
    * replace: ``op "u"``, ``o`` = the full new document, ``o2`` = ``{_id}``.
    * delete: ``o`` = ``{_id}``.

    Command shapes (``ns = "db.$cmd"``):

    * ``{"create": coll, "idIndex": {...}, <options>}`` (views: ``viewOn``, ``pipeline``)
    * ``{"drop": coll}``
    * ``{"renameCollection": "db.a", "to": "db.b", "stayTemp": False[, "dropTarget": UUID]}``
    * ``{"dropDatabase": 1}``
    * ``{"createIndexes": coll, "v": 2, "key": {...}, "name": ..., <options>}``
    * ``{"dropIndexes": coll, "index": name}`` with ``o2`` = the dropped spec
    * ``{"collMod": coll, <args>}`` with ``o2`` = ``{"collectionOptions_old": {...}[, "indexOptions_old": {...}]}``
    * ``{"applyOps": [...]}`` for a committed transaction; the inner operations
      are in :attr:`txn_ops` (their ``ts`` equals the commit entry's ``ts``).

    The simulator also keeps, per CRUD entry, the images a real server would
    keep in ``config.system.preimages`` when the collection has
    ``changeStreamPreAndPostImages`` enabled (``pre_image``; ``post_image`` for
    updates, which mongod derives by applying the diff to the pre-image).
    """

    ts: Timestamp
    wall: datetime
    op: str
    ns: str
    o: dict[str, Any]
    ui: uuid.UUID | None = None
    o2: dict[str, Any] | None = None
    t: int = 1
    lsid: dict[str, Any] | None = None
    txn_number: int | None = None
    stmt_id: int | None = None
    """Statement id of a retryable write's entry (with ``lsid`` and ``txn_number``)."""
    txn_ops: list[OplogEntry] | None = None
    pre_image: dict[str, Any] | None = None
    post_image: dict[str, Any] | None = None
    size: int = 0
    """Approximate BSON size in bytes, for the oplog size limit."""

    @property
    def db(self) -> str:
        return self.ns.split(".", 1)[0]

    @property
    def coll(self) -> str:
        return self.ns.split(".", 1)[1] if "." in self.ns else ""


class Oplog:
    """An append-only, size-bounded, thread-safe sequence of :class:`OplogEntry`.

    Every entry gets an absolute sequence number (``seq``) that never changes,
    so readers keep a cheap position across truncation. Readers wait on
    :meth:`wait_for` without holding any other lock.
    """

    def __init__(self, max_entries: int | None = None, max_bytes: int | None = None) -> None:
        self._entries: list[OplogEntry] = []
        self._ts_keys: list[int] = []
        """``ts`` of every entry as one int (``time << 32 | inc``): 28 bytes, not a tuple's 64."""
        self._offset = 0  # seq of self._entries[0]
        self._bytes = 0
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._subscribers: set[threading.Event] = set()
        self.truncated = False
        """True once any entry has dropped off the front."""

    # -- writing -------------------------------------------------------------
    def append(self, entry: OplogEntry) -> int:
        """Append ``entry`` (its ``ts`` must be greater than the last); return its seq."""
        with self._cond:
            key = _ts_key(entry.ts)
            if self._ts_keys and key <= self._ts_keys[-1]:
                raise ValueError(f"oplog timestamps must increase: {entry.ts} after {self.last_ts}")
            self._entries.append(entry)
            self._ts_keys.append(key)
            self._bytes += entry.size
            seq = self._offset + len(self._entries) - 1
            self._truncate_locked()
            self._cond.notify_all()
            for event in self._subscribers:
                event.set()
            return seq

    def _truncate_locked(self) -> None:
        drop = 0
        n = len(self._entries)
        if self.max_entries is not None and n > self.max_entries:
            drop = n - self.max_entries
        if self.max_bytes is not None:
            size = self._bytes - sum(e.size for e in self._entries[:drop])
            while drop < n - 1 and size > self.max_bytes:
                size -= self._entries[drop].size
                drop += 1
        if drop:
            self._bytes -= sum(e.size for e in self._entries[:drop])
            del self._entries[:drop]
            del self._ts_keys[:drop]
            self._offset += drop
            self.truncated = True

    def notify(self) -> None:
        """Wake waiting readers (e.g. after a cursor was killed)."""
        with self._cond:
            self._cond.notify_all()
            for event in self._subscribers:
                event.set()

    def subscribe(self, event: threading.Event) -> None:
        """Set ``event`` on every append and :meth:`notify` (mongos waits on several oplogs)."""
        with self._cond:
            self._subscribers.add(event)

    def unsubscribe(self, event: threading.Event) -> None:
        with self._cond:
            self._subscribers.discard(event)

    # -- reading -------------------------------------------------------------
    @property
    def first_seq(self) -> int:
        return self._offset

    @property
    def end_seq(self) -> int:
        """The seq the next appended entry will get."""
        return self._offset + len(self._entries)

    @property
    def size(self) -> int:
        """Approximate BSON bytes of the entries kept (what ``$collStats`` calls ``size``)."""
        with self._cond:
            return self._bytes

    @property
    def last_ts(self) -> Timestamp | None:
        with self._cond:
            return self._entries[-1].ts if self._entries else None

    def seq_at_or_after(self, ts: Timestamp) -> int:
        """Seq of the first entry with ``entry.ts >= ts`` (``end_seq`` if none)."""
        with self._cond:
            i = bisect.bisect_left(self._ts_keys, _ts_key(ts))
            return self._offset + i

    def read(self, seq: int, limit: int | None = None) -> list[OplogEntry]:
        """Entries from ``seq`` on (at most ``limit``).

        Raises :class:`LookupError` if ``seq`` has already dropped off the
        front (the caller turns that into ChangeStreamHistoryLost).
        """
        with self._cond:
            if seq < self._offset:
                raise LookupError(seq)
            start = seq - self._offset
            stop = len(self._entries) if limit is None else start + limit
            return self._entries[start:stop]

    def wait_for(self, seq: int, timeout: float) -> bool:
        """Block until an entry with seq ``>= seq`` exists, or ``timeout`` seconds pass."""
        with self._cond:
            if self.end_seq > seq:
                return True
            if timeout <= 0:
                return False
            self._cond.wait(timeout)
            return self.end_seq > seq

    def __len__(self) -> int:
        return len(self._entries)


def _ts_key(ts: Timestamp) -> int:
    """``ts`` as an int that orders as timestamps do."""
    return ts.time << 32 | ts.inc
