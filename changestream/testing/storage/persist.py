"""A deployment's data on disk (``dbpath``): what survives a restart of the simulator.

Kept: every collection and view (options, UUID, indexes, documents in natural
order), the oplog (so a resume token taken before the restart resumes after
it), the cluster time (new writes are stamped after the old ones) and the
term. Not kept: sessions, open transactions and retryable-write history,
cursors, failpoints, the event cache.

The snapshot is one file, written at a clean shutdown to a temporary file,
flushed and renamed over the old one, so a crash while writing leaves the
previous snapshot. Writes after the last snapshot are lost when the process is
killed (mongod's journal keeps them). While a deployment uses a ``dbpath`` it
holds an exclusive lock on its ``mongod.lock`` file, as mongod does.

The file fails loudly rather than load wrong data::

    "CSSIMDB" 0x00 | header (BSON: format, serverVersion, set name, term, cluster
    time, FCV, placementSince, users, clusterGeneration for a sharded cluster's files) | records (BSON, one per collection, document, oplog entry) |
    "CSSIMEND" | record count (uint64 BE) | SHA-256 of everything before it

Reading checks, in this order, and names the file and the fault in a
:class:`DbPathError`: the leading magic (not a snapshot), the end marker (cut
short or never finished), each record's length (a record overruns the file),
the record count (a record duplicated or lost), the checksum (changed bytes),
then the format and the emulated server version (a newer one is refused, as
mongod refuses data files of a newer version). Disk full (or any failed
write): the temporary file is removed, the previous snapshot stays, and the
error names the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import bson
from bson.binary import Binary, UuidRepresentation
from bson.codec_options import CodecOptions

from ..core.auth import ScramCredential, User
from ..core.codec import DECODE_OPTIONS
from ..core.oplog import OplogEntry
from ..core.versions import VERSIONS, fcv_tuple

if TYPE_CHECKING:
    from .catalog import CollectionState
    from .deployment import Deployment

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None  # type: ignore[assignment]

SNAPSHOT = "changestream-simulator.bson"
LOCK = "mongod.lock"
FORMAT = 2
"""Format 2 has the header, record count and checksum; format 1 (bare records) still loads."""
MAGIC = b"CSSIMDB\x00"
END = b"CSSIMEND"
_TRAILER = struct.Struct(">8sQ32s")

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


def _header(deployment: Deployment) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "serverVersion": deployment.profile.version,
        "setName": deployment.set_name,
        "term": deployment.term,
        "clusterTime": deployment.clock.current(),
        "oplogTruncated": deployment.oplog.truncated,
        "fcv": deployment.fcv,
        "placementSince": deployment.placement_since,
        "users": [_user_doc(user) for user in deployment.users.all()],
        **({} if deployment.generation is None else {"clusterGeneration": deployment.generation}),
    }


def _user_doc(user: User) -> dict[str, Any]:
    return {
        "user": user.name,
        "db": user.db,
        "userId": Binary(user.user_id.bytes, 4),
        "roles": user.roles,
        "credentials": {
            mechanism: {
                "salt": Binary(c.salt), "iterations": c.iterations,
                "storedKey": Binary(c.stored_key), "serverKey": Binary(c.server_key),
            }
            for mechanism, c in user.credentials.items()
        },
    }  # fmt: skip


def _records(deployment: Deployment) -> Iterator[dict[str, Any]]:
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
    """Write ``deployment``'s snapshot into ``dbpath`` (atomically; caller holds its lock).

    Any failed write (disk full, ...) removes the temporary file, keeps the
    previous snapshot and raises :class:`DbPathError` naming the file.
    """
    final = dbpath / SNAPSHOT
    partial = dbpath / (SNAPSHOT + ".partial")
    try:
        with deployment.lock, open(partial, "wb") as out:
            digest = hashlib.sha256()

            def write(data: bytes) -> None:
                digest.update(data)
                out.write(data)

            write(MAGIC)
            write(bson.encode(_header(deployment), codec_options=_WRITE_OPTIONS))
            count = 0
            for record in _records(deployment):
                write(bson.encode(record, codec_options=_WRITE_OPTIONS))
                count += 1
            out.write(_TRAILER.pack(END, count, digest.digest()))
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, final)
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink()
        reason = exc.strerror or str(exc)
        raise DbPathError(
            f"cannot write {final}: {reason} (the previous snapshot, if any, is kept; the "
            "data written since it is lost)"
        ) from None
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


def snapshot_generation(dbpath: Path) -> tuple[bool, int | None]:
    """``(readable, clusterGeneration)`` from the header of ``dbpath``'s snapshot, without
    reading the rest (a file that is not readable here fails with its own error when loaded)."""
    try:
        with open(dbpath / SNAPSHOT, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                return True, None  # format 1: written before generations
            raw_length = f.read(4)
            length = int.from_bytes(raw_length, "little")
            if len(raw_length) < 4 or not 5 <= length <= 16 * 1024 * 1024:
                return False, None
            header = bson.decode(raw_length + f.read(length - 4), codec_options=DECODE_OPTIONS)
    except (OSError, bson.errors.BSONError):
        return False, None
    generation = header.get("clusterGeneration")
    return True, generation if isinstance(generation, int) else None


def restore(deployment: Deployment, dbpath: Path) -> None:
    """Load ``dbpath``'s snapshot into a new, empty ``deployment`` (DbPathError if it cannot)."""
    path = dbpath / SNAPSHOT
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DbPathError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not data.startswith(MAGIC):
        _restore_format_1(deployment, path, data)
        return
    header, records = read_snapshot(path, data)
    _check_header(deployment, path, header)
    try:
        _load(deployment, path, header, iter(records))
    except (bson.errors.BSONError, KeyError, TypeError, ValueError) as exc:
        raise DbPathError(f"{path} is not a readable simulator snapshot: {exc}") from None


def read_snapshot(path: Path, data: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and records of a format-2 snapshot, every check passed (see the module)."""
    size = len(data)
    if size < len(MAGIC) + _TRAILER.size or data[-_TRAILER.size : -_TRAILER.size + 8] != END:
        raise DbPathError(
            f"{path} is truncated: its end marker is missing ({size} bytes; the file was cut "
            "short or never finished)"
        )
    _end, count, checksum = _TRAILER.unpack(data[-_TRAILER.size :])
    body_end = size - _TRAILER.size
    offsets: list[tuple[int, int]] = []
    offset = len(MAGIC)
    while offset < body_end:
        if offset + 5 > body_end:
            raise DbPathError(
                f"{path} is damaged: record {len(offsets)} at byte {offset} is cut short"
            )
        length = int.from_bytes(data[offset : offset + 4], "little")
        if length < 5 or offset + length > body_end:
            raise DbPathError(
                f"{path} is damaged: record {len(offsets)} at byte {offset} claims {length} "
                f"bytes, past the end of the records (byte {body_end})"
            )
        offsets.append((offset, length))
        offset += length
    if len(offsets) - 1 != count:
        raise DbPathError(
            f"{path} is damaged: it holds {max(len(offsets) - 1, 0)} records but its trailer "
            f"says {count} (a record was duplicated or lost)"
        )
    if hashlib.sha256(data[:body_end]).digest() != checksum:
        raise DbPathError(f"{path} is damaged: its checksum does not match its contents")
    try:
        docs = [
            bson.decode(data[start : start + length], codec_options=DECODE_OPTIONS)
            for start, length in offsets
        ]
    except bson.errors.BSONError as exc:
        raise DbPathError(f"{path} is not a readable simulator snapshot: {exc}") from None
    return docs[0], docs[1:]


def _check_header(deployment: Deployment, path: Path, header: dict[str, Any]) -> None:
    """Refuse a newer format or a newer emulated server version, as mongod refuses them."""
    fmt = header.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise DbPathError(
            f"{path} has snapshot format {fmt}, newer than this simulator's {FORMAT}: "
            "upgrade changestream to read it"
        )
    theirs = header.get("serverVersion")
    mine = deployment.profile.version
    if not isinstance(theirs, str) or _newer(theirs, mine):
        raise DbPathError(
            f"{path.parent} holds the data of MongoDB {theirs}, newer than this deployment's "
            f"{mine}: mongod refuses to start on data files of a newer version (its "
            "featureCompatibilityVersion); start a deployment of that version or newer"
        )


def _newer(theirs: str, mine: str) -> bool:
    def key(version: str) -> tuple[int, ...]:
        profile = VERSIONS.get(version)
        if profile is not None:
            return profile.major_minor
        try:
            return tuple(int(part) for part in version.split("."))
        except ValueError:
            return (999,)

    return key(theirs) > key(mine)


def _restore_format_1(deployment: Deployment, path: Path, data: bytes) -> None:
    """A snapshot of format 1 (bare BSON records, before the header and checksum)."""
    if not data:
        raise DbPathError(f"{path} is empty (not a simulator snapshot)")
    try:
        records = bson.decode_all(data, codec_options=DECODE_OPTIONS)
        meta = records[0] if records else None
        if meta is None or meta.get("format") != 1:
            raise DbPathError(f"{path} is not a simulator snapshot (no header)")
        _load(deployment, path, meta, iter(records[1:]))
    except (bson.errors.BSONError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise DbPathError(f"{path} is not a readable simulator snapshot: {exc}") from None


def _load(
    deployment: Deployment, path: Path, meta: dict[str, Any], records: Iterator[dict[str, Any]]
) -> None:
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
    fcv = meta.get("fcv")  # absent from older files: the version's own
    if isinstance(fcv, str) and fcv_tuple(fcv) <= deployment.profile.major_minor:
        deployment.fcv = fcv
    if "placementSince" in meta:
        deployment.placement_since = meta["placementSince"]
    generation = meta.get("clusterGeneration")
    deployment.generation = None if generation is None else int(generation)
    users = deployment.users
    with users.lock:
        for doc in meta.get("users", ()):
            if users.get(doc["db"], doc["user"]) is None:  # users= given at start win
                users.put(_user(doc))


def _user(doc: dict[str, Any]) -> User:
    credentials = {
        mechanism: ScramCredential(
            bytes(c["salt"]), int(c["iterations"]), bytes(c["storedKey"]), bytes(c["serverKey"])
        )
        for mechanism, c in doc["credentials"].items()
    }
    user_id = doc["userId"]
    return User(
        str(doc["user"]), str(doc["db"]), uuid.UUID(bytes=bytes(getattr(user_id, "bytes", user_id))),
        credentials, [dict(role) for role in doc["roles"]],
    )  # fmt: skip


def _finish(state: CollectionState | None, indexes: list[dict[str, Any]]) -> None:
    """Add a restored collection's indexes once its documents are in (unique ones index them)."""
    if state is None:
        return
    for spec in indexes:
        if spec["name"] == "_id_":
            state.indexes.append(spec)
        else:
            state.add_index(spec)
