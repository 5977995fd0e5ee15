"""``read_snapshot``: one aggregate of a collection at one cluster time, batch by batch.

The building block of a copy split into ranges and read elsewhere (Spark's executors
read their ``_id`` range at the copy's time with it). What it adds to an ``aggregate``
sent through ``Database.command`` with ``readConcern: snapshot`` is where the
``getMore``\\ s go: a URI listing several mongoses lets ``Database.command`` send each
one to any of them, and a mongos that did not open the cursor answers CursorNotFound
(43). Here the cursor's ``getMore`` and ``killCursors`` go to the server that opened it
(:class:`changestream._pymongo.SyncCursorReader`); the batches come from
:class:`changestream._snapshot.SnapshotBatches`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

from bson.timestamp import Timestamp
from pymongo.synchronous.collection import Collection

from ._pymongo import SyncCursorReader
from ._snapshot import SnapshotBatches

__all__ = ["read_snapshot"]


def read_snapshot(
    collection: Collection[Any],
    pipeline: Sequence[Mapping[str, Any]] = (),
    *,
    at: Timestamp | None = None,
    batch_size: int = 10_000,
) -> Generator[list[Any], None, None]:
    """The documents of ``collection`` through ``pipeline`` at cluster time ``at``, batch by batch.

    One ``aggregate`` with ``readConcern: {level: "snapshot", atClusterTime: at}``
    (``at`` None: the server picks the time), then its ``getMore``\\ s, each sent to the
    server (mongos) that opened the cursor, in a session of its own. Yields each
    non-empty batch as a list of documents decoded with the collection's
    ``codec_options`` (``RawBSONDocument`` stays raw). Reading the same ``pipeline`` at
    the same ``at`` twice gives the same documents, so ranges of one copy can be read
    in parallel, on other machines, and read again after a failure.

    Closing the generator early kills the cursor. Server errors raise as PyMongo raises
    them: ``OperationFailure`` with code 239 (SnapshotTooOld) once ``at`` has left the
    server's history window (``minSnapshotHistoryWindowInSeconds``). Needs MongoDB 5.0+
    (a replica set or a sharded cluster).
    """
    if not isinstance(collection, Collection):
        raise TypeError(
            f"read_snapshot() needs a pymongo Collection, not {type(collection).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, not {batch_size!r}")
    if at is not None and not isinstance(at, Timestamp):
        raise TypeError(f"at must be a bson Timestamp or None, not {type(at).__name__}")
    return _batches(collection, [dict(stage) for stage in pipeline], at, batch_size)


def _batches(collection: Collection[Any], pipeline: list[dict[str, Any]], at: Timestamp | None,
             batch_size: int) -> Generator[list[Any], None, None]:
    database = collection.database
    with database.client.start_session(causal_consistency=False) as session:
        read = SyncCursorReader(database, session, collection.codec_options)
        try:
            yield from SnapshotBatches(read, collection.name, pipeline, at=at,
                                       batch_size=batch_size)
        finally:
            read.close()
