"""Consistent copies in Spark: a collection read at one cluster time, split by ``_id`` ranges.

Used by the batch read (``spark.read.format("changestream")``) and by the
streaming source's ``startup_mode=snapshot``. The driver picks the read time
``T`` (or takes ``at_cluster_time``), counts the documents at ``T`` and picks
``snapshot_partitions - 1`` split ``_id``s at equal ranks; each executor reads
its range ``[lower, upper)`` at ``T`` with ``readConcern: {level: "snapshot",
atClusterTime: T}`` (:func:`changestream.read_snapshot`: each getMore on the mongos that
opened the cursor, whatever the URI lists). The rows are the insert-shaped records of
:mod:`changestream._snapshot` (``operation_type = "insert"``, ``cluster_time
= T``), converted like events. A range read twice at ``T`` gives the same
rows, so a replayed micro-batch is identical: exactly once with an idempotent
sink, as long as ``T`` stays inside the server's history window.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
from bson import json_util
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from pymongo import MongoClient
from pymongo.errors import OperationFailure
from pyspark.sql.datasource import InputPartition

from .. import read_snapshot
from .._snapshot import SnapshotPosition, copy_pipeline, snapshot_concern
from ..errors import ChangeStreamError
from ._config import SourceConfig
from ._convert import EventConverter, raw_bytes

__all__ = [
    "SnapshotPlan",
    "SnapshotRange",
    "plan_snapshot",
    "read_snapshot_range",
]

_JSON = json_util.CANONICAL_JSON_OPTIONS


class SnapshotRange(InputPartition):
    """Documents with ``lower <= _id < upper`` (open ends: ``has_lower``/``has_upper`` False) at ``at``."""

    def __init__(self, at: Timestamp, lower: Any, has_lower: bool, upper: Any, has_upper: bool) -> None:
        super().__init__((at.time, at.inc))
        self.at = at
        self.lower = lower
        self.has_lower = has_lower
        self.upper = upper
        self.has_upper = has_upper


class SnapshotPlan:
    """The read time and the split ``_id``s of one copy (JSON-able for Spark offsets)."""

    def __init__(self, at: Timestamp, splits: list[Any]) -> None:
        self.at = at
        self.splits = splits

    @property
    def ranges(self) -> int:
        return len(self.splits) + 1

    def partition(self, i: int) -> SnapshotRange:
        """Range ``i`` of :attr:`ranges` (the first and last are open-ended)."""
        lower = self.splits[i - 1] if i > 0 else None
        upper = self.splits[i] if i < len(self.splits) else None
        return SnapshotRange(self.at, lower, i > 0, upper, i < len(self.splits))

    def to_json(self) -> dict[str, Any]:
        return {
            "at": {"t": self.at.time, "i": self.at.inc},
            "splits": [json.loads(json_util.dumps({"v": s}, json_options=_JSON))["v"] for s in self.splits],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SnapshotPlan:
        try:
            at = Timestamp(int(data["at"]["t"]), int(data["at"]["i"]))
            splits = [json_util.loads(json.dumps({"v": s}))["v"] for s in data["splits"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a snapshot plan: {data!r:.200} ({exc})") from exc
        return cls(at, splits)


def _snapshot_error(exc: OperationFailure, at: Timestamp) -> ChangeStreamError:
    if exc.code == 239:
        return ChangeStreamError(
            f"the copy's read time Timestamp({at.time}, {at.inc}) has left the server's history "
            "window (SnapshotTooOld): a copy must finish, and a failed batch be replayed, within "
            "minSnapshotHistoryWindowInSeconds. Raise that server parameter (setParameter) or use "
            f"more executors, then start the query again from a new checkpoint. Server: {exc}"
        )
    return ChangeStreamError(f"the snapshot read at Timestamp({at.time}, {at.inc}) failed: {exc}")


def plan_snapshot(config: SourceConfig, parts: int, at: Timestamp | None = None) -> SnapshotPlan:
    """Pick the read time (unless given) and ``parts - 1`` split ``_id``s at equal ranks."""
    if config.database is None or config.collection is None:
        raise ValueError("a snapshot copies one collection: options 'database' and 'collection' are required")
    with config.connect() as client:
        db = client[config.database]
        coll = config.collection
        try:
            if at is None:
                probe = db.command({
                    "find": coll, "limit": 1, "singleBatch": True, "projection": {"_id": 1},
                    "readConcern": snapshot_concern(None),
                })
                at = probe["cursor"].get("atClusterTime")
                if not isinstance(at, Timestamp):
                    raise ChangeStreamError(
                        "the server ignored readConcern 'snapshot' (no atClusterTime): snapshot "
                        "reads need MongoDB 5.0 or later"
                    )
            counted = db.command({
                "aggregate": coll, "pipeline": [{"$count": "n"}], "cursor": {},
                "readConcern": snapshot_concern(at),
            })["cursor"]["firstBatch"]
            total = counted[0]["n"] if counted else 0
            splits: list[Any] = []
            for i in range(1, parts):
                rank = total * i // parts
                if rank == 0:
                    continue
                found = db.command({
                    "find": coll, "sort": {"_id": 1}, "skip": rank, "limit": 1,
                    "singleBatch": True, "projection": {"_id": 1},
                    "readConcern": snapshot_concern(at),
                })["cursor"]["firstBatch"]
                if found and (not splits or found[0]["_id"] != splits[-1]):
                    splits.append(found[0]["_id"])
        except OperationFailure as exc:
            raise _snapshot_error(exc, at or Timestamp(0, 0)) from exc
    return SnapshotPlan(at, splits)


def read_snapshot_range(
    config: SourceConfig, converter: EventConverter, part: SnapshotRange
) -> Iterator[pa.RecordBatch]:
    """The records of one range at its read time, as record batches (executor side)."""
    assert config.database is not None and config.collection is not None
    coll = config.collection
    start = SnapshotPosition("copy", part.at, part.at, None, part.lower, part.has_lower)
    pipeline = copy_pipeline(
        config.database, coll, start, list(config.pipeline), upper=part.upper,
        has_upper=part.has_upper, lower_inclusive=True,
    )
    client: MongoClient[RawBSONDocument] = MongoClient(config.uri, document_class=RawBSONDocument)
    with client:
        batches = read_snapshot(client[config.database][coll], pipeline, at=part.at,
                                batch_size=config.batch_size)  # getMores on the cursor's mongos
        pending: list[Any] = []
        try:
            with contextlib.closing(batches):  # a range abandoned early kills its cursor
                for batch in batches:
                    pending.extend(raw_bytes(doc) for doc in batch)
                    while len(pending) >= config.arrow_batch_rows:
                        yield converter.convert(pending[: config.arrow_batch_rows],
                                                share_gil=False)
                        pending = pending[config.arrow_batch_rows :]
        except OperationFailure as exc:
            raise _snapshot_error(exc, part.at) from exc
        if pending:
            yield converter.convert(pending, share_gil=False)
