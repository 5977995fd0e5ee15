"""Snapshot, then stream: the sans-IO core shared by the sync and async shells and by Spark.

A copy reads every document of one collection at one cluster time ``T`` with
``readConcern: {level: "snapshot", atClusterTime: T}`` (MongoDB 5.0+), in
``_id`` order, as insert-shaped records; the change stream then starts at
``Timestamp(T.time, T.inc + 1)``, so every write after ``T`` arrives as an
event and none before it does.

Each record's ``_id`` is its *position*: a document the token stores keep like
a resume token (``{"_data": "snapshot", "phase": "copy", "at": T, "readAt": R,
"lastId": <_id>, "uuid": <collection UUID>}``). Reopening from it continues
the copy after ``lastId`` at the same read time; a stream-phase position
(``phase: "stream"``) starts the stream after ``T``.

When the read time has left the server's history window (SnapshotTooOld),
the rest is copied at a new time ``R`` while the stream still starts after
``T``: documents copied at ``R`` may then have their events between ``T`` and
``R`` delivered again (their records say ``eventsMayRepeat: true``). A drop or
rename of the collection during the copy ends it with a
``snapshotInterrupted`` record; the stream then reports the drop or rename.

Records are built by the server (``$replaceWith``), so the user's change-stream
pipeline runs on them exactly as on events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import re
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from decimal import Decimal
from typing import Any, Literal

from bson.binary import Binary
from bson.code import Code
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp

from .errors import ChangeStreamError

__all__ = [
    "SNAPSHOT_MARK",
    "SnapshotCopy",
    "SnapshotError",
    "SnapshotPosition",
    "bson_order_key",
    "is_snapshot_position",
    "range_filter",
    "stream_start",
    "type_rank",
]

SNAPSHOT_MARK = "snapshot"
"""``_data`` of a snapshot position (never a real resume token's hex string)."""

SNAPSHOT_TOO_OLD = 239
QUERY_PLAN_KILLED = 175
NAMESPACE_NOT_FOUND = 26
SNAPSHOT_UNAVAILABLE = 246
_INTERRUPTING = frozenset({QUERY_PLAN_KILLED, NAMESPACE_NOT_FOUND, SNAPSHOT_UNAVAILABLE})
_SPLIT_STAGE = "$changeStreamSplitLargeEvent"
DEFAULT_COPY_BATCH = 1000


class SnapshotError(ChangeStreamError):
    """The copy cannot run (e.g. a server before 5.0, or a bad position)."""


# -- positions ---------------------------------------------------------------------------------
Phase = Literal["copy", "stream"]


@dataclasses.dataclass(frozen=True)
class SnapshotPosition:
    """Where a snapshot-then-stream run is: copying after ``last_id`` at ``read_at``, or streaming after ``at``."""

    phase: Phase
    at: Timestamp
    """T: the stream starts just after it."""
    read_at: Timestamp
    """The time the copy reads at (T, or a later one after a window overrun)."""
    uuid: str | None = None
    """The copied collection's UUID, as hex (a drop or rename is noticed on restart)."""
    last_id: Any = None
    has_last: bool = False
    marks: bool = False
    """Copying with boundary records (``snapshotStart``/``snapshotEnd``): a resnapshot."""

    def document(self) -> dict[str, Any]:
        """The position as stored (in the token slot of a token store)."""
        doc: dict[str, Any] = {"_data": SNAPSHOT_MARK, "phase": self.phase, "at": self.at}
        if self.read_at != self.at:
            doc["readAt"] = self.read_at
        if self.uuid is not None:
            doc["uuid"] = self.uuid
        if self.has_last:
            doc["lastId"] = self.last_id
        if self.marks and self.phase == "copy":
            doc["marks"] = True
        return doc

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> SnapshotPosition:
        """A stored position; :class:`SnapshotError` naming what is wrong otherwise."""
        if not is_snapshot_position(doc):
            raise SnapshotError(f"not a snapshot position: {dict(doc)!r:.200}")
        phase, at, read_at = doc.get("phase"), doc.get("at"), doc.get("readAt", doc.get("at"))
        if phase not in ("copy", "stream"):
            raise SnapshotError(f"snapshot position has an unknown phase {phase!r}")
        if not isinstance(at, Timestamp) or not isinstance(read_at, Timestamp):
            raise SnapshotError("snapshot position lacks its cluster times ('at', 'readAt')")
        coll_uuid = doc.get("uuid")
        if coll_uuid is not None and not isinstance(coll_uuid, str):
            raise SnapshotError("snapshot position has a malformed collection 'uuid'")
        return cls(phase, at, read_at, coll_uuid, doc.get("lastId"), "lastId" in doc,
                   doc.get("marks") is True)

    def streaming(self) -> SnapshotPosition:
        return SnapshotPosition("stream", self.at, self.read_at, self.uuid)


def is_snapshot_position(token: Any) -> bool:
    """Is ``token`` a snapshot position (rather than a server resume token)?"""
    return isinstance(token, Mapping) and token.get("_data") == SNAPSHOT_MARK


def stream_start(at: Timestamp) -> Timestamp:
    """The first cluster time after ``at`` (``startAtOperationTime`` includes events AT it)."""
    if at.inc >= 0xFFFFFFFF:
        return Timestamp(at.time + 1, 0)
    return Timestamp(at.time, at.inc + 1)


# -- _id ranges in BSON order ------------------------------------------------------------------
_RANKS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (-1, ("minKey",)),
    (5, ("null", "undefined")),
    (10, ("double", "int", "long", "decimal")),
    (15, ("string", "symbol")),
    (20, ("object",)),
    (25, ("array",)),
    (30, ("binData",)),
    (35, ("objectId",)),
    (40, ("bool",)),
    (45, ("date",)),
    (47, ("timestamp",)),
    (50, ("regex",)),
    (55, ("dbPointer",)),
    (60, ("javascript",)),
    (65, ("javascriptWithScope",)),
    (127, ("maxKey",)),
)
"""mongod's canonical type order with the ``$type`` aliases of each rank."""


def _rank(value: Any) -> int:
    """The canonical BSON type rank of a decoded value (comparison brackets by it)."""
    if value is None:
        return 5
    if isinstance(value, bool):
        return 40
    if isinstance(value, (int, float, Int64, Decimal128, Decimal)):
        return 10
    if isinstance(value, str):
        return 15
    if isinstance(value, (Mapping, DBRef)):
        return 20
    if isinstance(value, (list, tuple)):
        return 25
    if isinstance(value, (bytes, Binary, uuid.UUID)):
        return 30
    if isinstance(value, ObjectId):
        return 35
    if isinstance(value, datetime.datetime):
        return 45
    if isinstance(value, Timestamp):
        return 47
    if isinstance(value, (Regex, re.Pattern)):
        return 50
    if isinstance(value, Code):
        return 65 if value.scope else 60
    if isinstance(value, MinKey):
        return -1
    if isinstance(value, MaxKey):
        return 127
    raise SnapshotError(f"cannot order an _id of type {type(value).__name__}")


def bson_order_key(value: Any) -> tuple[Any, ...]:
    """A sort key that orders decoded ``_id`` values as mongod does (type rank, then value)."""
    rank = _rank(value)
    if isinstance(value, bool):
        return (rank, value)
    if isinstance(value, Decimal128):
        return (rank, value.to_decimal())
    if isinstance(value, (int, float, Decimal)):
        return (rank, value)
    if isinstance(value, str):
        return (rank, value)
    if isinstance(value, ObjectId):
        return (rank, value.binary)
    if isinstance(value, datetime.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
        return (rank, value)
    if isinstance(value, Timestamp):
        return (rank, (value.time, value.inc))
    if isinstance(value, Mapping):
        return (rank, tuple((_rank(v), k, bson_order_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (rank, tuple(bson_order_key(v) for v in value))
    if isinstance(value, (bytes, Binary)):
        subtype = value.subtype if isinstance(value, Binary) else 0
        return (rank, (len(value), subtype, bytes(value)))
    return (rank, repr(value))  # MinKey, MaxKey, null: one value per rank


def type_rank(value: Any) -> int:
    """The canonical BSON type rank of a decoded ``_id`` (:class:`SnapshotError`: unorderable)."""
    return _rank(value)


def _types_between(low: int, high: int) -> list[str]:
    """``$type`` aliases of every rank strictly between ``low`` and ``high``."""
    return [alias for rank, aliases in _RANKS if low < rank < high for alias in aliases]


_NO_LOWER = -2
_NO_UPPER = 128


def range_filter(
    lower: Any = None, upper: Any = None, *, has_lower: bool = False, has_upper: bool = False,
    lower_inclusive: bool = False,
) -> dict[str, Any]:
    """A filter for ``lower < _id < upper`` (or ``<=`` lower) in full BSON order.

    Query comparisons are type-bracketed (``{$gt: 5}`` never matches a
    string), so a range across types adds ``$type`` clauses for the types
    between the bounds. ``{}`` when unbounded.
    """
    if not has_lower and not has_upper:
        return {}
    low_op = "$gte" if lower_inclusive else "$gt"
    low_rank = _rank(lower) if has_lower else _NO_LOWER
    high_rank = _rank(upper) if has_upper else _NO_UPPER
    if low_rank > high_rank:
        raise SnapshotError(f"empty _id range: {lower!r} is after {upper!r}")
    if has_lower and has_upper and low_rank == high_rank:
        return {"_id": {low_op: lower, "$lt": upper}}
    clauses: list[dict[str, Any]] = []
    if has_lower:
        clauses.append({"_id": {low_op: lower}})
    between = _types_between(low_rank, high_rank)
    if between:
        clauses.append({"_id": {"$type": between}})
    if has_upper:
        clauses.append({"_id": {"$lt": upper}})
    return clauses[0] if len(clauses) == 1 else {"$or": clauses}


# -- the copy pipeline -------------------------------------------------------------------------
def copy_pipeline(
    db: str,
    coll: str,
    position: SnapshotPosition,
    user_pipeline: Sequence[Mapping[str, Any]],
    *,
    upper: Any = None,
    has_upper: bool = False,
    lower_inclusive: bool = False,
) -> list[dict[str, Any]]:
    """``$match`` (after ``lastId``, before ``upper``), ``$sort: {_id: 1}``, the record, the user's stages."""
    stages: list[dict[str, Any]] = []
    match = range_filter(
        position.last_id, upper, has_lower=position.has_last, has_upper=has_upper,
        lower_inclusive=lower_inclusive,
    )
    if match:
        stages.append({"$match": match})
    stages.append({"$sort": {"_id": 1}})
    key: dict[str, Any] = {
        "_data": {"$literal": SNAPSHOT_MARK},
        "phase": {"$literal": "copy"},
        "at": {"$literal": position.at},
    }
    if position.read_at != position.at:
        key["readAt"] = {"$literal": position.read_at}
    if position.uuid is not None:
        key["uuid"] = {"$literal": position.uuid}
    key["lastId"] = "$_id"
    if position.marks:
        key["marks"] = {"$literal": True}
    stages.append(
        {
            "$replaceWith": {
                "_id": key,
                "operationType": {"$literal": "insert"},
                "clusterTime": {"$literal": position.read_at},
                "ns": {"db": {"$literal": db}, "coll": {"$literal": coll}},
                "documentKey": {"_id": "$_id"},
                "fullDocument": "$$ROOT",
                "snapshot": {"eventsMayRepeat": {"$literal": position.read_at != position.at}},
            }
        }
    )
    stages.extend(dict(s) for s in user_pipeline if _SPLIT_STAGE not in s)
    return stages


def uuid_hex(value: Any) -> str | None:
    """A collection UUID (``uuid.UUID`` or ``Binary`` subtype 4, per codec) as hex."""
    if isinstance(value, uuid.UUID):
        return value.hex
    if isinstance(value, (bytes, Binary)) and len(value) == 16:
        return bytes(value).hex()
    return None


def snapshot_concern(at: Timestamp | None) -> dict[str, Any]:
    concern: dict[str, Any] = {"level": "snapshot"}
    if at is not None:
        concern["atClusterTime"] = at
    return concern


class SnapshotBatches:
    """One snapshot read of ``coll`` (``aggregate`` of ``pipeline``, ``readConcern:
    snapshot`` at ``at``, or at a time the server picks), batch by batch; no I/O of its own.

    ``read(command)`` runs a command and returns its reply (in one session, so the
    getMores find the cursor). Iterating yields each non-empty batch of documents;
    :attr:`at` is the read's cluster time once the first reply came. An iteration
    stopped early (the generator closed) kills the cursor.
    """

    def __init__(self, read: Callable[[dict[str, Any]], Mapping[str, Any]], coll: str,
                 pipeline: Sequence[Mapping[str, Any]], *, at: Timestamp | None = None,
                 batch_size: int = 10_000) -> None:
        self._read = read
        self.coll = coll
        self.pipeline = [dict(stage) for stage in pipeline]
        self.at = at
        """The read's cluster time (``atClusterTime``, else ``operationTime``)."""
        self.batch_size = batch_size

    def __iter__(self) -> Generator[list[Mapping[str, Any]], None, None]:
        reply = self._read({"aggregate": self.coll, "pipeline": self.pipeline,
                            "cursor": {"batchSize": self.batch_size},
                            "readConcern": snapshot_concern(self.at)})
        cursor = reply["cursor"]
        found = cursor.get("atClusterTime") or reply.get("operationTime")
        if isinstance(found, Timestamp):
            self.at = found
        cursor_id, batch = int(cursor["id"]), cursor["firstBatch"]
        try:
            while True:
                if batch:
                    yield list(batch)
                if not cursor_id:
                    return
                asked, cursor_id = cursor_id, 0  # a failed getMore leaves no cursor to kill
                more = self._read({"getMore": Int64(asked), "collection": self.coll,
                                   "batchSize": self.batch_size})["cursor"]
                cursor_id, batch = int(more["id"]), more["nextBatch"]
        finally:
            if cursor_id:  # stopped early: the server's cursor goes now, not at its timeout
                with contextlib.suppress(Exception):  # best effort: it times out anyway
                    self._read({"killCursors": self.coll, "cursors": [Int64(cursor_id)]})


# -- the copy state machine --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Command:
    """One command for the shell to run on the collection's database (in one session)."""

    name: str
    body: dict[str, Any]


class SnapshotCopy:
    """Decides the copy's next command and interprets replies; no I/O.

    The shell loops: ``cmd = copy.next_command()``; run it; feed
    :meth:`on_reply` (which returns the records to deliver) or
    :meth:`on_error`; until :attr:`done`. ``position`` is where a fresh copy
    would continue after everything returned so far was delivered.
    """

    def __init__(
        self,
        db: str,
        coll: str,
        pipeline: Sequence[Mapping[str, Any]] = (),
        position: SnapshotPosition | None = None,
        *,
        batch_size: int = DEFAULT_COPY_BATCH,
        marks: bool = False,
    ) -> None:
        if position is not None and position.phase != "copy":
            raise SnapshotError("a stream-phase position has nothing left to copy")
        self.marks = marks if position is None else position.marks
        """Deliver ``snapshotStart`` (after the read time is chosen) and ``snapshotEnd``."""
        self.interrupted = False
        self.db = db
        self.coll = coll
        self.pipeline = list(pipeline)
        self.batch_size = batch_size
        self.position = position
        self.cursor_id = 0
        self.done = False
        self.overruns = 0
        """How many times the read time left the history window (and a new one was taken)."""
        self._state: Literal["catalog", "probe", "open", "more"] = "catalog"
        self._uuid: Any = position.uuid if position is not None else None

    # -- what to run --------------------------------------------------------------------------
    def next_command(self) -> Command:
        if self.done:
            raise SnapshotError("the copy is finished")
        if self._state == "catalog":
            return Command("listCollections", {
                "listCollections": 1, "filter": {"name": self.coll}, "nameOnly": False,
            })
        if self._state == "probe":
            return Command("find", {
                "find": self.coll, "limit": 1, "singleBatch": True, "projection": {"_id": 1},
                "readConcern": snapshot_concern(None),
            })
        assert self.position is not None
        if self._state == "open":
            return Command("aggregate", {
                "aggregate": self.coll,
                "pipeline": copy_pipeline(self.db, self.coll, self.position, self.pipeline),
                "cursor": {"batchSize": self.batch_size},
                "readConcern": snapshot_concern(self.position.read_at),
            })
        return Command("getMore", {
            "getMore": Int64(self.cursor_id), "collection": self.coll, "batchSize": self.batch_size,
        })

    # -- what came back ------------------------------------------------------------------------
    def on_reply(self, reply: Mapping[str, Any]) -> list[Any]:
        """The records in ``reply`` (possibly a ``snapshotInterrupted`` record)."""
        if self._state == "catalog":
            return self._on_catalog(reply)
        cursor = reply["cursor"]
        if self._state == "probe":
            read_at = cursor.get("atClusterTime")
            if not isinstance(read_at, Timestamp):
                raise SnapshotError(
                    "the server ignored readConcern level 'snapshot' (no atClusterTime in its "
                    "reply): snapshot_then_watch needs MongoDB 5.0 or later"
                )
            pos = self.position
            if pos is None:
                self.position = SnapshotPosition("copy", read_at, read_at, self._uuid,
                                                 marks=self.marks)
                self._state = "open"
                return [self._start_record()] if self.marks else []
            self.overruns += 1
            self.position = dataclasses.replace(pos, read_at=read_at)
            self._state = "open"
            return []
        batch = cursor["firstBatch"] if self._state == "open" else cursor["nextBatch"]
        self.cursor_id = int(cursor["id"])
        self._state = "more"
        if batch:
            last = batch[-1]["_id"]
            assert self.position is not None
            self.position = dataclasses.replace(
                self.position, last_id=last["lastId"], has_last=True
            )
        if not self.cursor_id:
            self.done = True
        return list(batch)

    def _on_catalog(self, reply: Mapping[str, Any]) -> list[Any]:
        found = reply["cursor"]["firstBatch"]
        info = found[0].get("info", {}) if found else {}
        current = uuid_hex(info.get("uuid"))
        if found and found[0].get("type") == "view":
            raise SnapshotError(f"{self.db}.{self.coll} is a view: only collections can be copied")
        if self.position is None:
            self._uuid = current
            self._state = "probe"
            return []
        if self.position.uuid is not None and current != self.position.uuid:
            what = "dropped" if current is None else "dropped or renamed (another collection now has its name)"
            return self._interrupt(f"the collection was {what} during the copy", None)
        self._state = "open"
        return []

    def on_error(self, code: int | None, message: str) -> list[Any]:
        """A server error: retried at a new read time, ends the copy, or re-raised by the shell.

        Returns the records to deliver; raises nothing itself. The shell
        re-raises the error when :meth:`handles` said no.
        """
        self.cursor_id = 0
        if code == SNAPSHOT_TOO_OLD and self._state in ("open", "more"):
            self._state = "probe"
            return []
        return self._interrupt(message, code)

    def handles(self, code: int | None) -> bool:
        """Does :meth:`on_error` deal with this server error code?"""
        if code == SNAPSHOT_TOO_OLD:
            return self._state in ("open", "more")
        return code in _INTERRUPTING and self._state in ("open", "more")

    def _start_record(self) -> dict[str, Any]:
        """The resnapshot's first record: the copy reads at ``T`` from here on."""
        pos = self.position
        assert pos is not None
        return {
            "_id": pos.document(),
            "operationType": "snapshotStart",
            "ns": {"db": self.db, "coll": self.coll},
            "snapshot": {"atClusterTime": pos.read_at},
        }

    def end_record(self) -> dict[str, Any]:
        """The resnapshot's last record: every document of the copy came before it."""
        pos = self.finished_position()
        info: dict[str, Any] = {"atClusterTime": pos.at}
        if self.interrupted:
            info["interrupted"] = True
        return {
            "_id": pos.document(),
            "operationType": "snapshotEnd",
            "ns": {"db": self.db, "coll": self.coll},
            "snapshot": info,
        }

    def _interrupt(self, reason: str, code: int | None) -> list[Any]:
        self.done = True
        self.interrupted = True
        pos = self.position
        assert pos is not None
        info: dict[str, Any] = {
            "atClusterTime": pos.read_at,
            "streamAfter": pos.at,
            "reason": reason,
        }
        if code is not None:
            info["code"] = code
        if pos.has_last:
            info["lastId"] = pos.last_id
        self.position = pos.streaming()
        return [{
            "_id": self.position.document(),
            "operationType": "snapshotInterrupted",
            "ns": {"db": self.db, "coll": self.coll},
            "snapshot": info,
        }]

    def finished_position(self) -> SnapshotPosition:
        """Where the run stands once the copy is done: streaming after ``T``."""
        assert self.position is not None
        return self.position.streaming()


# -- the whole run: copy, then stream (what both shells drive) ----------------------------------
@dataclasses.dataclass(frozen=True)
class RunCommand:
    command: Command


@dataclasses.dataclass(frozen=True)
class DeliverRecord:
    record: Any


@dataclasses.dataclass(frozen=True)
class UseStream:
    """Open (once) and poll the change stream, starting where ``start`` says."""

    start: dict[str, Any]


Action = RunCommand | DeliverRecord | UseStream

_START_OPTIONS = ("resume_after", "start_after", "start_at_operation_time")


def check_watch_options(options: Mapping[str, Any]) -> None:
    """The run decides where the stream starts: refuse the options that would say otherwise."""
    clash = [name for name in _START_OPTIONS if options.get(name) is not None]
    if clash:
        raise TypeError(
            f"snapshot_then_watch() decides where the stream starts; remove {', '.join(clash)} "
            "and pass resume_after=<a position or resume token it returned> to continue a run"
        )
    if options.get("typed"):
        raise TypeError("snapshot_then_watch() returns documents: typed=True is not supported")


class SnapshotRun:
    """Snapshot, then stream, for one collection: the shells only run what it asks for.

    ``start`` is ``None`` (a new run), a snapshot position, or a resume
    token a previous run returned (then the copy is over: only the stream).
    """

    def __init__(
        self,
        db: str,
        coll: str,
        pipeline: Sequence[Mapping[str, Any]] = (),
        start: Mapping[str, Any] | None = None,
        *,
        copy_batch_size: int = DEFAULT_COPY_BATCH,
        marks: bool = False,
    ) -> None:
        if isinstance(copy_batch_size, bool) or not isinstance(copy_batch_size, int) or copy_batch_size < 1:
            raise ValueError(f"copy_batch_size must be an integer >= 1, not {copy_batch_size!r}")
        self._records: list[Any] = []
        self._next = 0
        self.token: Any = dict(start) if start is not None else None
        """Where a new run would continue after the last delivered record (``None``: not started)."""
        self.copy: SnapshotCopy | None = None
        if start is None:
            self.copy = SnapshotCopy(db, coll, pipeline, batch_size=copy_batch_size, marks=marks)
        elif is_snapshot_position(start):
            position = SnapshotPosition.parse(start)
            if position.phase == "copy":
                self.copy = SnapshotCopy(db, coll, pipeline, position, batch_size=copy_batch_size)

    @property
    def copying(self) -> bool:
        return self.copy is not None

    @property
    def fetched(self) -> int:
        """Records fetched and not yet delivered (the next ones need no command)."""
        return len(self._records) - self._next

    def buffered(self) -> Any:
        """The next record already fetched, or None (the per-record fast path of the shells)."""
        records = self._records
        i = self._next
        if i >= len(records):
            return None
        record = records[i]
        i += 1
        if i == len(records):
            self._records, self._next = [], 0
        else:
            self._next = i
        self.token = record["_id"]
        return record

    def next_action(self) -> Action:
        record = self.buffered()
        if record is not None:
            return DeliverRecord(record)
        copy = self.copy
        if copy is not None:
            if not copy.done:
                if self.token is None and copy.position is not None:
                    self.token = copy.position.document()
                return RunCommand(copy.next_command())
            self.copy = None
            self.token = copy.finished_position().document()
            if copy.marks:
                self._take([copy.end_record()])
                return self.next_action()
        return UseStream(self._stream_start())

    def _stream_start(self) -> dict[str, Any]:
        token = self.token
        if is_snapshot_position(token):
            return {"start_at_operation_time": stream_start(SnapshotPosition.parse(token).at)}
        return {"resume_after": token}

    def on_reply(self, reply: Mapping[str, Any]) -> None:
        assert self.copy is not None
        self._take(self.copy.on_reply(reply))

    def on_error(self, code: int | None, message: str) -> bool:
        """``False``: not the copy's to handle (the shell re-raises the error)."""
        copy = self.copy
        if copy is None or not copy.handles(code):
            return False
        self._take(copy.on_error(code, message))
        return True

    def _take(self, records: list[Any]) -> None:
        if records:
            self._records.extend(records)

    def kill_command(self) -> Command | None:
        """``killCursors`` for an open copy cursor (on close), else None."""
        copy = self.copy
        if copy is None or not copy.cursor_id:
            return None
        cid, copy.cursor_id = copy.cursor_id, 0
        return Command("killCursors", {"killCursors": copy.coll, "cursors": [Int64(cid)]})


def opens_snapshot(token: Any, initial_snapshot: bool) -> bool:
    """Does a consumer reopening from ``token`` need :func:`snapshot_then_watch` (not ``watch``)?"""
    return is_snapshot_position(token) or (initial_snapshot and token is None)
