"""A new table's first copy read by several readers over ``_id`` ranges, at one cluster time.

``mirror --snapshot-readers N``: the copy that :func:`changestream.consume`
(``initial_snapshot=True``) makes with one reader, split instead:

* one cluster time ``T``: the time of a first ``readConcern: snapshot`` read;
  every range is read with ``atClusterTime: T``, so the ranges are one
  consistent copy, and the stream then starts just after ``T``
  (:func:`changestream._snapshot.stream_start`): no gap, no duplicate;
* ranges: split points from a ``$sample`` of ``_id`` sorted in BSON order
  (the simulator does not run ``$bucketAuto`` outside change streams, and
  ``$sample`` + sort is what Flink CDC's sample splitter does; mongod answers
  both); a point repeated by the sample is used once;
* readers read their ranges in parallel (a thread each, ``_id`` order within
  a range); the batches are committed **in ``_id`` order** as base rows, each
  with the copy position of its last ``_id`` (the single reader's position
  format). A ``kill -9`` therefore leaves the same kind of position as a
  single reader's: the next run continues after the last committed ``_id``
  at the same ``T`` (in parallel again, or with one reader), and once the
  last range is committed, ``consume`` finds nothing after it and streams
  from ``T``;
* a copy that outlives the server's snapshot history (SnapshotTooOld, 239;
  ``minSnapshotHistoryWindowInSeconds``), or a restart after it, stops after
  its last commit (:attr:`CopyResult.too_old`): the single reader continues
  from that position at a new read time, as it does after any window overrun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure, PyMongoError

from ._pymongo import SyncCursorReader
from ._snapshot import (
    SNAPSHOT_TOO_OLD,
    SnapshotBatches,
    SnapshotError,
    SnapshotPosition,
    bson_order_key,
    is_snapshot_position,
    range_filter,
    type_rank,
    uuid_hex,
)
from .stores import StoredToken

__all__ = ["CopyResult", "parallel_copy", "split_points"]

_SAMPLES_PER_RANGE = 16
_END: Any = object()


class _Sink(Protocol):
    def __call__(self, change: Mapping[str, Any]) -> None: ...
    def load(self) -> StoredToken | None: ...
    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...


@dataclasses.dataclass
class CopyResult:
    """What a parallel copy did."""

    at: Timestamp | None
    """The copy's cluster time (the stream starts just after it)."""
    documents: int = 0
    ranges: int = 0
    commits: int = 0
    too_old: bool = False
    """The server no longer keeps ``at`` (SnapshotTooOld, 239): the copy stopped after its
    last commit in ``_id`` order; the single reader goes on from there (``consume`` with
    ``initial_snapshot=True`` reads the rest at a new time, as after any window overrun)."""


def split_points(collection: Any, parts: int) -> list[Any]:
    """Up to ``parts - 1`` ``_id`` values splitting the collection into ranges of about one size.

    A collection range-sharded on ``_id`` with several chunks is split at its chunks'
    bounds (``config.chunks``: each range then reads one shard); otherwise at a sample's.
    """
    if parts < 2:
        return []
    chunked = _chunk_points(collection)
    if chunked:
        return chunked
    sample = collection.aggregate([{"$sample": {"size": parts * _SAMPLES_PER_RANGE}},
                                   {"$project": {"_id": 1}}])
    ids = sorted((doc["_id"] for doc in sample), key=bson_order_key)
    points: list[Any] = []
    for i in range(1, parts):
        if not ids:
            break
        point = ids[min(len(ids) - 1, i * len(ids) // parts)]
        if not points or bson_order_key(points[-1]) < bson_order_key(point):
            points.append(point)
    return points


def _chunk_points(collection: Any) -> list[Any]:
    """The chunk bounds of a collection range-sharded on ``{_id: 1}`` (none: not so sharded)."""
    config = collection.database.client["config"]
    namespace = f"{collection.database.name}.{collection.name}"
    try:
        entry = config.collections.find_one({"_id": namespace})
        if not entry or dict(entry.get("key") or {}) != {"_id": 1}:
            return []
        chunks = config.chunks.find({"uuid": entry["uuid"]}, {"min": 1})
        bounds = [c["min"]["_id"] for c in chunks if type_rank(c["min"]["_id"]) != -1]
    except (PyMongoError, KeyError, TypeError):
        return []  # not readable (no privilege, not a sharded cluster): the sample
    return sorted(bounds, key=bson_order_key)


def parallel_copy(collection: Any, sink: _Sink, *, readers: int, batch: int = 10_000,
                  ranges_per_reader: int = 4) -> CopyResult:
    """Copy ``collection`` into ``sink`` with ``readers`` readers; see the module's text."""
    if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
        raise ValueError(f"readers must be an integer >= 1, not {readers!r}")
    stored = sink.load()
    start: SnapshotPosition | None = None
    if stored is not None:
        if not is_snapshot_position(stored.token) or stored.token.get("phase") != "copy":
            return CopyResult(None)  # the table is past its first copy
        start = SnapshotPosition.parse(stored.token)
        if start.read_at != start.at:
            return CopyResult(None)  # a copy past a window overrun: the single reader's way
    database = collection.database
    client = database.client
    with client.start_session() as session:
        if start is None:
            reply = database.command({"aggregate": collection.name, "pipeline": [{"$limit": 1}],
                                      "cursor": {}, "readConcern": {"level": "snapshot"}},
                                     session=session)
            at = reply["cursor"].get("atClusterTime") or reply.get("operationTime")
            if not isinstance(at, Timestamp):
                raise SnapshotError("the server gave no cluster time for a snapshot read "
                                    "(MongoDB 5.0+ replica set or sharded cluster needed)")
            start = SnapshotPosition("copy", at, at, _uuid(database, collection.name))
    points = split_points(collection, readers * ranges_per_reader)
    if start.has_last:
        points = [p for p in points if bson_order_key(p) > bson_order_key(start.last_id)]
    bounds: list[tuple[Any, bool, Any, bool, bool]] = []
    lower, has_lower, inclusive = start.last_id, start.has_last, False
    for point in points:
        bounds.append((lower, has_lower, point, True, inclusive))
        lower, has_lower, inclusive = point, True, True
    bounds.append((lower, has_lower, None, False, inclusive))
    result = CopyResult(start.at, ranges=len(bounds))
    queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=4) for _ in bounds]
    stop = threading.Event()

    def read(index: int) -> None:
        out = queues[index]
        try:
            for docs in _read_range(collection, start.at, bounds[index], batch, stop):
                _put(out, docs, stop)
            _put(out, _END, stop)
        except BaseException as exc:  # the committing thread raises it
            _put(out, exc, stop)

    with ThreadPoolExecutor(max_workers=readers, thread_name_prefix="copy") as pool:
        for index in range(len(bounds)):
            pool.submit(read, index)
        try:
            for out in queues:
                while (docs := out.get()) is not _END:
                    if isinstance(docs, OperationFailure) and docs.code == SNAPSHOT_TOO_OLD:
                        result.too_old = True  # every commit so far is in _id order: a prefix
                        return result
                    if isinstance(docs, BaseException):
                        raise docs
                    _commit(sink, start, docs, result)
        finally:
            stop.set()
    return result


def _put(out: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    """Put unless the copy stopped (a failed commit must not leave readers blocked)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.2)
            return
        except queue.Full:
            continue


def _commit(sink: _Sink, start: SnapshotPosition, docs: list[Mapping[str, Any]],
            result: CopyResult) -> None:
    namespace: dict[str, Any] = {}
    for doc in docs:
        sink({"_id": _position(start, doc["_id"]), "operationType": "insert", "ns": namespace,
              "documentKey": {"_id": doc["_id"]}, "fullDocument": doc})
    sink.save(_position(start, docs[-1]["_id"]))
    result.documents += len(docs)
    result.commits += 1


def _position(start: SnapshotPosition, last_id: Any) -> dict[str, Any]:
    return dataclasses.replace(start, last_id=last_id, has_last=True).document()


def _read_range(collection: Any, at: Timestamp, bounds: tuple[Any, bool, Any, bool, bool],
                batch: int, stop: threading.Event) -> Iterator[list[Mapping[str, Any]]]:
    """One range's documents at ``at`` in ``_id`` order, ``batch`` at a time."""
    lower, has_lower, upper, has_upper, inclusive = bounds
    match = range_filter(lower, upper, has_lower=has_lower, has_upper=has_upper,
                         lower_inclusive=inclusive)
    pipeline: list[dict[str, Any]] = [{"$match": match}] if match else []
    pipeline.append({"$sort": {"_id": 1}})
    database = collection.database
    with database.client.start_session() as session:
        read = SyncCursorReader(database, session)  # getMores on the server of the cursor
        batches = iter(SnapshotBatches(read, collection.name, pipeline, at=at,
                                       batch_size=batch))
        with contextlib.closing(read), contextlib.closing(batches):  # a stop kills the cursor
            for docs in batches:
                yield docs
                if stop.is_set():
                    return


def _uuid(database: Any, name: str) -> str | None:
    """The collection's UUID as hex (a drop before the stream starts is then noticed)."""
    for info in database.list_collections(filter={"name": name}):
        return uuid_hex((info.get("info") or {}).get("uuid"))
    return None
