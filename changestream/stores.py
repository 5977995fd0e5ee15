"""Durable resume-token stores: where an at-least-once consumer keeps its position.

A store holds one :class:`StoredToken`. :class:`FileTokenStore` writes
canonical Extended JSON atomically (a crash mid-save leaves the previous
token); :class:`MongoTokenStore` / :class:`AsyncMongoTokenStore` upsert one
document with write concern "majority" (a token that could roll back would
make a restart skip events). :class:`MemoryTokenStore` keeps it in memory.
Tokens are stored as plain BSON documents, so ``_typeBits`` and key order
survive byte for byte.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
import tempfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from bson import json_util
from bson.codec_options import CodecOptions
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference
from pymongo.synchronous.collection import Collection
from pymongo.write_concern import WriteConcern

from ._snapshot import SNAPSHOT_MARK
from ._token import ResumeToken
from .errors import ChangeStreamError

__all__ = [
    "AsyncMongoTokenStore",
    "AsyncTokenStore",
    "BackgroundTokenStore",
    "BatchingTokenStore",
    "FileTokenStore",
    "MemoryTokenStore",
    "MongoTokenStore",
    "StoredToken",
    "TokenStore",
    "TokenStoreError",
]

log = logging.getLogger("changestream.stores")

_JSON = json_util.CANONICAL_JSON_OPTIONS.with_options(tz_aware=True, tzinfo=timezone.utc)
_CODEC: CodecOptions[dict[str, Any]] = CodecOptions(tz_aware=True, tzinfo=timezone.utc)


@dataclass(frozen=True)
class StoredToken:
    """A saved position: the resume token, the caller's batch id and when it was saved (UTC)."""

    token: dict[str, Any]
    batch_id: int | None
    saved_at: datetime


@runtime_checkable
class TokenStore(Protocol):
    """Where a consumer keeps its resume token (one token per store)."""

    def load(self) -> StoredToken | None:
        """The last saved token, or ``None`` if nothing was saved yet."""
        ...

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """Durably replace the stored token; when this returns, a restart resumes from it."""
        ...


@runtime_checkable
class AsyncTokenStore(Protocol):
    """:class:`TokenStore` with coroutine methods (for :func:`changestream.aio.consume`)."""

    async def load(self) -> StoredToken | None: ...

    async def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...


@runtime_checkable
class BackgroundTokenStore(Protocol):
    """A store that can make a save durable while the consumer fetches the next batch.

    :func:`changestream.consume` calls :meth:`save_behind` instead of ``save``
    on such a store, and :meth:`flush` before it returns or raises, so what it
    reports as stored at its end is durable. :class:`changestream.delta.DeltaSink`
    is one: a batch's conversion and commit overlap the next fetch.
    """

    def load(self) -> StoredToken | None: ...

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...

    def save_behind(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """Start saving ``token``; it is durable once the next call of the store returns.

        A failure is raised by the store's next call; a token is never durable before
        everything handled up to it is (a restart resumes from the last durable one).
        """
        ...

    def flush(self) -> None:
        """Wait until the last :meth:`save_behind` is durable; raise its failure."""
        ...


@runtime_checkable
class BatchingTokenStore(Protocol):
    """A store that also keeps what the handler stages, and says when that batch is full.

    ``save_every`` counts changes, which bounds a batch's memory only for small
    documents. :func:`changestream.consume` also saves as soon as :meth:`batch_full`
    is true after a change, as if ``save_every`` had been reached (with ``workers=1``).
    :class:`changestream.delta.DeltaSink` is one: it counts the bytes it stages.
    """

    def load(self) -> StoredToken | None: ...

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...

    def batch_full(self) -> bool:
        """Whether to save now: the staged batch reached the store's own bound."""
        ...


class TokenStoreError(ChangeStreamError):
    """A stored token cannot be read back (corrupt file or document)."""


def _plain_token(token: Mapping[str, Any]) -> dict[str, Any]:
    """A token as a plain dict (also from ``RawBSONDocument``), keeping its exact BSON."""
    resume = ResumeToken.of(token)
    document = resume.document()
    problem = _token_problem(document)
    if problem is not None:
        raise ValueError(f"not a resume token: {problem}")
    return document


def _token_problem(token: Any) -> str | None:
    """Why ``token`` is not a resume token ``{_data: <hex string>, ...}`` (``None``: it is)."""
    if not isinstance(token, Mapping) or "_data" not in token:
        return "'token' is missing or is not a resume token"
    data = token["_data"]
    if not isinstance(data, str):
        return f"'token._data' must be a hex string, not {type(data).__name__} {data!r:.60}"
    if data == SNAPSHOT_MARK:
        return None  # the position snapshot_then_watch stores while it copies
    try:
        bytes.fromhex(data)
    except ValueError:
        return f"'token._data' must be a hex string, not {data!r:.60}"
    return None


def _now() -> datetime:
    """The current UTC time at BSON precision (milliseconds), so loads equal saves."""
    now = datetime.now(timezone.utc)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def _record(token: Mapping[str, Any], batch_id: int | None) -> dict[str, Any]:
    if batch_id is not None and (isinstance(batch_id, bool) or not isinstance(batch_id, int)):
        raise TypeError(f"batch_id must be an int or None, not {type(batch_id).__name__}")
    return {"token": _plain_token(token), "batch_id": batch_id, "saved_at": _now()}


def _stored(record: Any, where: str) -> StoredToken:
    """Validate a loaded record; one :class:`TokenStoreError` naming ``where`` otherwise."""
    problem = None
    if not isinstance(record, Mapping):
        problem = f"expected a document, found {type(record).__name__}"
    elif _token_problem(record.get("token")) is not None:
        problem = _token_problem(record.get("token"))
    elif record.get("batch_id") is not None and not isinstance(record["batch_id"], int):
        problem = "'batch_id' is not an integer"
    elif not isinstance(record.get("saved_at"), datetime):
        problem = "'saved_at' is missing or not a date"
    if problem is not None:
        raise TokenStoreError(f"the resume token stored in {where} is unreadable: {problem}")
    saved_at = record["saved_at"]
    if saved_at.tzinfo is None:
        saved_at = saved_at.replace(tzinfo=timezone.utc)
    return StoredToken(dict(record["token"]), record.get("batch_id"), saved_at)


class MemoryTokenStore:
    """Keeps the token in memory: for tests and for consumers that need no restart."""

    def __init__(self, initial: StoredToken | None = None) -> None:
        self._stored = initial
        self.saves = 0
        """How many times :meth:`save` ran."""

    def load(self) -> StoredToken | None:
        return self._stored

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        record = _record(token, batch_id)
        self._stored = StoredToken(record["token"], batch_id, record["saved_at"])
        self.saves += 1

    def __repr__(self) -> str:
        return "MemoryTokenStore()"


_MAX_FILE_BYTES = 64 * 1024
"""A token file is a few hundred bytes; anything this large is not one of ours."""


class FileTokenStore:
    """One token in a file, as canonical Extended JSON, replaced atomically.

    :meth:`save` writes a temporary file next to the target, fsyncs it,
    renames it over the target and fsyncs the directory: after a crash the
    file holds either the old or the new token, never a mix. Temporary files
    left by a process killed mid-save are removed by the next :meth:`load`
    (one store per file: two live processes must not share a token file).

    ``fsync_interval`` is the durability choice. Only ``fsync`` survives an OS
    crash or a power loss, and it costs (with the rename) about a millisecond or
    more per save on a local disk (``docs/consume.md`` has the numbers):

    * ``0`` (the default): every save is the fsynced replacement above; after a
      power loss the file holds the last saved token.
    * ``N`` seconds: a save makes that fsynced replacement only if the last one
      is ``N`` seconds old; the saves in between overwrite a companion file,
      ``.<name>.recent``, in place (a length and a CRC-32 frame the record; no
      rename, no fsync: microseconds). :meth:`load` takes the newer of the two.
      A process crash (``kill -9``) loses nothing (the page cache has it); an OS
      crash or a power loss loses at most the saves since the last fsync (their
      changes are delivered again), and a torn companion is detected and ignored.
      The token file itself is only ever replaced whole and fsynced.

    The path must be a regular file (or not exist yet): a FIFO, a device or a
    directory is refused with :class:`TokenStoreError` instead of blocking.
    Deleting the token file starts from the current time (its companion is then
    ignored).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync_interval: float = 0.0) -> None:
        self._path = Path(os.fspath(path))
        if (isinstance(fsync_interval, bool) or not isinstance(fsync_interval, (int, float))
                or not math.isfinite(fsync_interval) or fsync_interval < 0):
            raise ValueError(
                f"fsync_interval must be a number of seconds >= 0 (0: fsync every save), "
                f"not {fsync_interval!r}"
            )
        self._fsync_interval = float(fsync_interval)
        self._synced_at: float | None = None
        """When this store last made the fsynced replacement (``time.monotonic``)."""
        self._check_kind()

    @property
    def fsync_interval(self) -> float:
        """Seconds between fsyncs (``0``: every save)."""
        return self._fsync_interval

    @property
    def _recent(self) -> Path:
        """The companion file the saves between fsyncs overwrite in place."""
        return self._path.with_name(f".{self._path.name}.recent")

    @property
    def path(self) -> Path:
        return self._path

    def _check_kind(self) -> None:
        """Refuse a path that exists and is not a regular file (``stat`` never blocks)."""
        try:
            mode = os.stat(self._path).st_mode
        except FileNotFoundError:
            return
        except OSError as exc:
            raise TokenStoreError(f"cannot use the token file {self._path}: {exc}") from exc
        if not stat.S_ISREG(mode):
            raise TokenStoreError(
                f"the token file {self._path} is not a regular file ({_file_kind(mode)}); "
                "give the path of a file (it is created on the first save)"
            )

    def _read(self) -> str | None:
        """The file's text, opened without blocking (a FIFO swapped in is refused, not waited on)."""
        try:
            fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TokenStoreError(f"cannot read the token file {self._path}: {exc}") from exc
        with os.fdopen(fd, "rb") as file:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise TokenStoreError(
                    f"the token file {self._path} is not a regular file ({_file_kind(mode)})"
                )
            data = file.read(_MAX_FILE_BYTES + 1)
        if len(data) > _MAX_FILE_BYTES:
            raise TokenStoreError(
                f"the token file {self._path} is corrupt (larger than {_MAX_FILE_BYTES} bytes; "
                "a token file holds one small document)"
            )
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TokenStoreError(f"cannot read the token file {self._path}: {exc}") from exc

    def _remove_stale_temporaries(self) -> None:
        """Delete ``.<name>.<pid>.*.tmp`` files a killed save left behind (best effort).

        A temporary file is stale when it is older than a save could take and
        the process that wrote it is gone (or it is very old): a reader must
        never delete the file a live writer is about to rename.
        """
        prefix = f".{self._path.name}."
        now = time.time()
        with contextlib.suppress(OSError):
            for entry in os.scandir(self._path.parent):
                name = entry.name
                if not (name.startswith(prefix) and name.endswith(".tmp")):
                    continue
                with contextlib.suppress(OSError):
                    age = now - entry.stat(follow_symlinks=False).st_mtime
                    writer = name[len(prefix):].split(".", 1)[0]
                    if age > _STALE_AFTER and (age > _ORPHANED_AFTER or not _alive(writer)):
                        os.unlink(entry.path)

    def load(self) -> StoredToken | None:
        """The stored token; ``None`` if the file does not exist; :class:`TokenStoreError` if corrupt."""
        self._check_kind()
        self._remove_stale_temporaries()
        text = self._read()
        if text is None:
            return None
        stored = self._parse(text)
        recent = self._load_recent()
        if recent is not None and recent.saved_at >= stored.saved_at:
            return recent
        return stored

    def _parse(self, text: str) -> StoredToken:
        where = f"the token file {self._path}"
        try:
            record = json_util.loads(text, json_options=_JSON)
        except RecursionError as exc:
            raise TokenStoreError(
                f"the token file {self._path} is corrupt (nested too deeply to be a token)"
            ) from exc
        except (ValueError, TypeError, KeyError, OverflowError) as exc:
            raise TokenStoreError(
                f"the token file {self._path} is corrupt (not Extended JSON: {exc}); restore it "
                "from a backup, or delete it to start from the current time (events since the "
                "last saved token are then skipped)"
            ) from exc
        return _stored(record, where)

    def _load_recent(self) -> StoredToken | None:
        """The companion's token: ``None`` if absent, superseded (empty) or torn by a crash."""
        try:
            with open(self._recent, "rb") as file:
                header = file.readline(64)
                data = file.read(_MAX_FILE_BYTES + 1)
        except OSError:
            return None
        try:
            checksum, length = (int(field, 16) for field in header.split())
            if length == 0:
                return None  # an fsynced save came after it
            body = data[:length]
            if len(body) != length or zlib.crc32(body) != checksum:
                raise ValueError("torn")
            record = json_util.loads(body.decode("utf-8"), json_options=_JSON)
            return _stored(record, f"the token file {self._recent}")
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError,
                UnicodeDecodeError, TokenStoreError):
            log.warning(
                "%s is damaged (a crash before its fsync): the token file's own token is used; "
                "the changes saved after it are delivered again", self._recent,
            )
            return None

    def _write_recent(self, body: bytes) -> None:
        """Overwrite the companion in place: one ``pwrite`` of the framed record, no fsync."""
        frame = b"%08x %x\n" % (zlib.crc32(body), len(body)) + body
        try:
            fd = os.open(self._recent, os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
                         0o600)
        except OSError as exc:
            raise TokenStoreError(
                f"cannot write the token file {self._recent}: {exc.strerror or exc}"
            ) from exc
        try:
            os.pwrite(fd, frame, 0)
        finally:
            os.close(fd)

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """Replace the file's token (see the class docstring for ``fsync_interval``)."""
        text = json_util.dumps(_record(token, batch_id), json_options=_JSON) + "\n"
        now = time.monotonic()
        if (self._fsync_interval > 0 and self._synced_at is not None
                and now - self._synced_at < self._fsync_interval):
            self._write_recent(text.encode("utf-8"))
            return
        self._replace(text)
        if self._fsync_interval > 0:
            self._synced_at = now
            self._write_recent(b"")  # superseded: the token file is the newer now

    def _replace(self, text: str) -> None:
        """Write, fsync, rename over the token file, fsync the directory."""
        self._check_kind()
        directory = self._path.parent
        try:
            fd, temporary = tempfile.mkstemp(
                prefix=f".{self._path.name}.{os.getpid()}.", suffix=".tmp", dir=directory
            )
        except OSError as exc:
            raise TokenStoreError(
                f"cannot write the token file {self._path}: {exc.strerror or exc} "
                f"(in the directory {directory})"
            ) from exc
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self._path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _fsync_directory(directory)

    def __repr__(self) -> str:
        if self._fsync_interval:
            return f"FileTokenStore({str(self._path)!r}, fsync_interval={self._fsync_interval})"
        return f"FileTokenStore({str(self._path)!r})"


_STALE_AFTER = 30.0
"""Seconds after which a temporary token file of a dead process is removed."""
_ORPHANED_AFTER = 3600.0
"""Seconds after which any temporary token file is removed (its pid may be reused)."""


def _alive(pid_text: str) -> bool:
    """Does process ``pid_text`` exist? Unknown (not a pid, no permission): assume so."""
    if not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (POSIX); platforms without directory fds skip it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _collection_settings() -> dict[str, Any]:
    """Majority writes and reads on the primary: a saved token never rolls back."""
    return {
        "codec_options": _CODEC,
        "write_concern": WriteConcern("majority"),
        "read_concern": ReadConcern("majority"),
        "read_preference": ReadPreference.PRIMARY,
    }


class MongoTokenStore:
    """One token in a MongoDB document ``{_id: key, token, batch_id, saved_at}``, written w:majority."""

    def __init__(self, collection: Collection[Any], key: str) -> None:
        if not isinstance(collection, Collection):
            raise TypeError(f"collection must be a pymongo Collection, not {type(collection).__name__}")
        if not isinstance(key, str):
            raise TypeError(f"key must be a string, not {type(key).__name__}")
        self._collection: Collection[dict[str, Any]] = collection.with_options(
            **_collection_settings()
        )
        self._key = key

    def load(self) -> StoredToken | None:
        document = self._collection.find_one({"_id": self._key})
        return None if document is None else _stored(document, repr(self))

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        document = {"_id": self._key, **_record(token, batch_id)}
        self._collection.replace_one({"_id": self._key}, document, upsert=True)

    @property
    def namespace(self) -> str:
        """``database.collection`` the token is kept in."""
        return self._collection.full_name

    @property
    def key(self) -> str:
        """The ``_id`` of the token's document."""
        return self._key

    def __repr__(self) -> str:
        return f"MongoTokenStore({self._collection.full_name!r}, key={self._key!r})"


class AsyncMongoTokenStore:
    """:class:`MongoTokenStore` over a PyMongo ``AsyncCollection``."""

    def __init__(self, collection: AsyncCollection[Any], key: str) -> None:
        if not isinstance(collection, AsyncCollection):
            raise TypeError(
                f"collection must be a pymongo AsyncCollection, not {type(collection).__name__}"
            )
        if not isinstance(key, str):
            raise TypeError(f"key must be a string, not {type(key).__name__}")
        self._collection: AsyncCollection[dict[str, Any]] = collection.with_options(
            **_collection_settings()
        )
        self._key = key

    async def load(self) -> StoredToken | None:
        document = await self._collection.find_one({"_id": self._key})
        return None if document is None else _stored(document, repr(self))

    async def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        document = {"_id": self._key, **_record(token, batch_id)}
        await self._collection.replace_one({"_id": self._key}, document, upsert=True)

    @property
    def namespace(self) -> str:
        """``database.collection`` the token is kept in."""
        return self._collection.full_name

    @property
    def key(self) -> str:
        """The ``_id`` of the token's document."""
        return self._key

    def __repr__(self) -> str:
        return f"AsyncMongoTokenStore({self._collection.full_name!r}, key={self._key!r})"
