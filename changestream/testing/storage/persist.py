"""A deployment's data on disk (``dbpath``): what survives a restart of the simulator.

Kept: every collection and view (options, UUID, indexes, documents in natural
order), the oplog (so a resume token taken before the restart resumes after
it), the cluster time (new writes are stamped after the old ones) and the
term. Not kept: sessions, open transactions and retryable-write history,
cursors, failpoints, the event cache.

The snapshot is one file of concatenated BSON documents, written at a clean
shutdown to a temporary file, flushed and renamed over the old one, so a crash
while writing leaves the previous snapshot. Writes after the last snapshot are
lost when the process is killed (mongod's journal keeps them). While a
deployment uses a ``dbpath`` it holds an exclusive lock on its ``mongod.lock``
file, as mongod does.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import bson
from bson.binary import Binary, UuidRepresentation
from bson.codec_options import CodecOptions

from ..core.codec import DECODE_OPTIONS
from ..core.oplog import OplogEntry

if TYPE_CHECKING:
    from .catalog import CollectionState
    from .deployment import Deployment

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None  # type: ignore[assignment]

SNAPSHOT = "changestream-simulator.bson"
LOCK = "mongod.lock"
FORMAT = 1

_WRITE_OPTIONS: CodecOptions[dict[str, Any]] = CodecOptions(
    uuid_representation=UuidRepresentation.STANDARD, tz_aware=True
)
"""Server-made :class:`uuid.UUID` values are written as subtype-4 binaries (as on the wire);
everything a client sent was decoded with :data:`DECODE_OPTIONS` and reads back the same."""


class DbPathError(Exception):
    """The ``dbpath`` cannot be used (in use, unreadable, or another deployment's)."""


class DbPathLock:
    """mongod's ``mongod.lock``: one deployment per ``dbpath`` at a time."""

    def __init__(self, dbpath: Path) -> None:
        dbpath.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = open(dbpath / LOCK, "a+")  # noqa: SIM115 - held until release
        if fcntl is not None:
            try:
                fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._file.close()
                self._file = None
                raise DbPathError(
                    f"Unable to lock the lock file: {dbpath / LOCK} (another process is using "
                    "this dbpath)"
                ) from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.truncate()
            self._file.close()  # closing drops the flock
            self._file = None


# -- writing -------------------------------------------------------------------------------------


def _entry_doc(entry: OplogEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"ts": entry.ts, "wall": entry.wall, "op": entry.op, "ns": entry.ns}
    doc["o"] = entry.o
    optional = {
        "ui": None if entry.ui is None else Binary(entry.ui.bytes, 4),
        "o2": entry.o2,
        "lsid": entry.lsid,
        "txnNumber": entry.txn_number,
        "stmtId": entry.stmt_id,
        "txnOps": None if entry.txn_ops is None else [_entry_doc(e) for e in entry.txn_ops],
        "preImage": entry.pre_image,
        "postImage": entry.post_image,
    }
    doc.update((k, v) for k, v in optional.items() if v is not None)
    doc["t"] = entry.t
    doc["size"] = entry.size
    return doc


def _records(deployment: Deployment) -> Iterator[dict[str, Any]]:
    yield {
        "format": FORMAT,
        "version": deployment.profile.version,
        "setName": deployment.set_name,
        "term": deployment.term,
        "clusterTime": deployment.clock.current(),
        "oplogTruncated": deployment.oplog.truncated,
    }
    catalog = deployment.catalog
    for db in catalog.database_names():
        for state in catalog.collections(db):
            yield {
                "collection": state.name,
                "db": state.db,
                "uuid": Binary(state.uuid.bytes, 4),
                "options": state.options,
                "indexes": state.indexes,
            }
            for doc in state.iter_stored():
                yield {"d": doc}
    oplog = deployment.oplog
    for entry in oplog.read(oplog.first_seq):
        yield {"entry": _entry_doc(entry)}


def save(deployment: Deployment, dbpath: Path) -> None:
    """Write ``deployment``'s snapshot into ``dbpath`` (atomically; caller holds its lock)."""
    final = dbpath / SNAPSHOT
    partial = dbpath / (SNAPSHOT + ".partial")
    with deployment.lock, open(partial, "wb") as out:
        for record in _records(deployment):
            out.write(bson.encode(record, codec_options=_WRITE_OPTIONS))
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, final)
    with contextlib.suppress(OSError):  # make the rename itself durable
        fd = os.open(dbpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- reading -------------------------------------------------------------------------------------


def _entry(doc: dict[str, Any]) -> OplogEntry:
    ui = doc.get("ui")
    txn_ops = doc.get("txnOps")
    return OplogEntry(
        ts=doc["ts"],
        wall=doc["wall"],
        op=doc["op"],
        ns=doc["ns"],
        o=doc["o"],
        ui=None if ui is None else uuid.UUID(bytes=bytes(ui)),
        o2=doc.get("o2"),
        t=int(doc["t"]),
        lsid=doc.get("lsid"),
        txn_number=doc.get("txnNumber"),
        stmt_id=doc.get("stmtId"),
        txn_ops=None if txn_ops is None else [_entry(e) for e in txn_ops],
        pre_image=doc.get("preImage"),
        post_image=doc.get("postImage"),
        size=int(doc["size"]),
    )


def has_snapshot(dbpath: Path) -> bool:
    return (dbpath / SNAPSHOT).is_file()


def restore(deployment: Deployment, dbpath: Path) -> None:
    """Load ``dbpath``'s snapshot into a new, empty ``deployment``."""
    path = dbpath / SNAPSHOT
    try:
        with open(path, "rb") as stream:
            records = bson.decode_file_iter(stream, codec_options=DECODE_OPTIONS)
            _load(deployment, path, records)
    except (bson.errors.BSONError, KeyError, TypeError, ValueError) as exc:
        raise DbPathError(f"{path} is not a readable simulator snapshot: {exc}") from None


def _load(deployment: Deployment, path: Path, records: Iterator[dict[str, Any]]) -> None:
    meta = next(records, None)
    if meta is None or meta.get("format") != FORMAT:
        raise DbPathError(f"{path} is not a simulator snapshot of format {FORMAT}")
    if meta.get("setName") != deployment.set_name:

        def describe(name: Any) -> str:
            return "a standalone" if name is None else f"replica set {name!r}"

        raise DbPathError(
            f"{path.parent} holds the data of {describe(meta.get('setName'))}, "
            f"not of {describe(deployment.set_name)}"
        )
    catalog = deployment.catalog
    state: CollectionState | None = None
    pending_indexes: list[dict[str, Any]] = []
    for record in records:
        if "d" in record:
            if state is None:
                raise ValueError("a document outside any collection")
            state.insert(record["d"])
        elif "collection" in record:
            _finish(state, pending_indexes)
            state = catalog.new_collection(record["db"], record["collection"], record["options"])
            state.uuid = uuid.UUID(bytes=bytes(record["uuid"]))
            pending_indexes = list(record["indexes"])
            state.indexes = []
        elif "entry" in record:
            _finish(state, pending_indexes)
            state = None
            deployment.oplog.append(_entry(record["entry"]))
        else:
            raise ValueError(f"unknown record {sorted(record)}")
    _finish(state, pending_indexes)
    deployment.oplog.truncated = bool(meta.get("oplogTruncated"))
    deployment.clock.advance(meta["clusterTime"])
    deployment.term = int(meta["term"])


def _finish(state: CollectionState | None, indexes: list[dict[str, Any]]) -> None:
    """Add a restored collection's indexes once its documents are in (unique ones index them)."""
    if state is None:
        return
    for spec in indexes:
        if spec["name"] == "_id_":
            state.indexes.append(spec)
        else:
            state.add_index(spec)
