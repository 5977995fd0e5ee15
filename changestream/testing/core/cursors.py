"""Server-side cursors: the registry and the ``cursor`` reply they produce.

A cursor is anything with the :class:`ServerCursor` shape: find cursors,
plain aggregate cursors and change-stream cursors all register here, so
``getMore`` and ``killCursors`` treat them alike.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from bson.int64 import Int64
from bson.timestamp import Timestamp

from .errors import CommandError

if TYPE_CHECKING:
    from .context import CommandContext


MAX_BATCH_BYTES: Final = 16 * 1024 * 1024
"""``FindCommon::kMaxBytesToReturnToClientAtOnce`` (``BSONObjMaxUserSize``)."""


class BatchBytes:
    """The bytes a batch's BSON array really uses, and mongod's rule for adding one more.

    mongod builds the batch array in the reply buffer and, before appending a
    document, checks ``bytesUsed() + objsize <= 16 MiB`` (``haveSpaceForNext``,
    ``CursorResponseBuilder::bytesUsed``): ``bytesUsed`` counts the array's
    length prefix and every element's type byte and index name, not only the
    documents. The first document always goes, however large, so a cursor
    always makes progress. The array thus ends at most a few bytes over 16 MiB,
    which the reply's 16 KiB allowance (``BSONObjMaxInternalSize``) covers.
    """

    __slots__ = ("count", "used")

    def __init__(self) -> None:
        self.count = 0
        self.used = 4
        """The array's bytes so far: its int32 length prefix, then its elements."""

    def fits(self, size: int) -> bool:
        """Whether a document of ``size`` bytes may join the batch."""
        return not self.count or self.used + size <= MAX_BATCH_BYTES

    def add(self, size: int) -> None:
        """Count a document of ``size`` bytes appended as element ``"<count>"``."""
        self.used += size + 2 + len(str(self.count))  # type byte, index name, its NUL
        self.count += 1


@dataclass(slots=True)
class CursorBatch:
    """One batch a cursor hands out."""

    documents: list[Any]
    exhausted: bool = False
    """The cursor is done: the reply carries ``id: 0`` and the cursor is dropped."""
    post_batch_resume_token: dict[str, Any] | None = None
    invalidated: bool = False
    """Add ``invalidated: true`` (change stream closed by an invalidate, 7.0+)."""
    at_cluster_time: Timestamp | None = None
    """The read time of a snapshot read (``atClusterTime``, in every reply of its cursor)."""


class ServerCursor(Protocol):
    """What every cursor kind provides."""

    ns: str
    """Namespace reported in replies: ``db.coll`` or ``db.$cmd.aggregate``."""
    lsid_id: bytes | None
    """``lsid.id`` bytes of the session that created it (getMore must match)."""
    tailable_await: bool
    """Tailable + awaitData (change streams): getMore accepts ``maxTimeMS`` and waits."""

    def get_more(
        self, ctx: CommandContext, batch_size: int | None, max_time_ms: int | None
    ) -> CursorBatch: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Slot:
    cursor: ServerCursor
    member_name: str
    in_use: bool = False
    killed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class CursorManager:
    """Cursor ids to cursors, per member (a cursor lives on one server only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, _Slot] = {}
        self._rng = random.Random()

    def __len__(self) -> int:
        """How many cursors are open."""
        with self._lock:
            return len(self._slots)

    def register(self, cursor: ServerCursor, member_name: str) -> int:
        """Store ``cursor`` and return its new id (a positive int64)."""
        with self._lock:
            while True:
                cid = self._rng.randrange(1, 2**62)
                if cid not in self._slots:
                    break
            self._slots[cid] = _Slot(cursor, member_name)
            return cid

    def checkout(self, cid: int, member_name: str) -> ServerCursor:
        """Pin cursor ``cid`` for a getMore; CursorNotFound (43) if unknown here."""
        with self._lock:
            slot = self._slots.get(cid)
            if slot is None or slot.member_name != member_name or slot.killed:
                raise CommandError(43, f"cursor id {cid} not found")
            if slot.in_use:
                raise CommandError(143, f"cursor id {cid} is already in use")
            slot.in_use = True
            return slot.cursor

    def checkin(self, cid: int, *, drop: bool = False) -> None:
        """Unpin after a getMore; ``drop`` removes it (exhausted or failed)."""
        with self._lock:
            slot = self._slots.get(cid)
            if slot is None:
                return
            slot.in_use = False
            if drop or slot.killed:
                del self._slots[cid]
                cursor = slot.cursor
            else:
                return
        cursor.close()

    def kill(self, cid: int, member_name: str) -> bool:
        """Kill ``cid`` on ``member_name``; False if no such cursor there."""
        with self._lock:
            slot = self._slots.get(cid)
            if slot is None or slot.member_name != member_name:
                return False
            if slot.in_use:
                slot.killed = True  # the running getMore drops it on checkin
                cursor = slot.cursor
            else:
                del self._slots[cid]
                cursor = slot.cursor
        cursor.close()
        return True

    def kill_all(self, member_name: str | None = None) -> int:
        """Kill every cursor (on one member, or everywhere); return how many."""
        with self._lock:
            ids = [
                cid
                for cid, s in self._slots.items()
                if member_name is None or s.member_name == member_name
            ]
        return sum(
            self.kill(cid, self._slots[cid].member_name) for cid in ids if cid in self._slots
        )

    def kill_sessions(self, member_name: str, sessions: Collection[bytes] | None) -> int:
        """Kill ``member_name``'s cursors opened in ``sessions`` (None: in any session).

        Cursors opened outside a session are never matched, as in mongod's
        ``killCursorsWithMatchingSessions``. Returns how many were killed.
        """
        with self._lock:
            ids = [
                cid
                for cid, slot in self._slots.items()
                if slot.member_name == member_name
                and slot.cursor.lsid_id is not None
                and (sessions is None or bytes(slot.cursor.lsid_id) in sessions)
            ]
        return sum(self.kill(cid, member_name) for cid in ids)

    def ids(self) -> list[int]:
        with self._lock:
            return list(self._slots)


def cursor_reply(cid: int, ns: str, batch: CursorBatch, *, first: bool) -> dict[str, Any]:
    """The ``{"cursor": {...}}`` reply body in mongod's field order.

    ``firstBatch``/``nextBatch``, ``postBatchResumeToken``, ``atClusterTime``,
    ``invalidated``, ``id``, ``ns``.
    """
    cur: dict[str, Any] = {("firstBatch" if first else "nextBatch"): batch.documents}
    if batch.post_batch_resume_token is not None:
        cur["postBatchResumeToken"] = batch.post_batch_resume_token
    if batch.at_cluster_time is not None:
        cur["atClusterTime"] = batch.at_cluster_time
    if batch.invalidated:
        cur["invalidated"] = True
    cur["id"] = Int64(0 if batch.exhausted else cid)
    cur["ns"] = ns
    return {"cursor": cur}
