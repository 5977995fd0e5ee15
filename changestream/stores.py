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
import os
import tempfile
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

from ._token import ResumeToken
from .errors import ChangeStreamError

__all__ = [
    "AsyncMongoTokenStore",
    "AsyncTokenStore",
    "FileTokenStore",
    "MemoryTokenStore",
    "MongoTokenStore",
    "StoredToken",
    "TokenStore",
    "TokenStoreError",
]

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


class TokenStoreError(ChangeStreamError):
    """A stored token cannot be read back (corrupt file or document)."""


def _plain_token(token: Mapping[str, Any]) -> dict[str, Any]:
    """A token as a plain dict (also from ``RawBSONDocument``), keeping its exact BSON."""
    return ResumeToken.of(token).document()


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
    elif not isinstance(record.get("token"), Mapping) or "_data" not in record["token"]:
        problem = "'token' is missing or is not a resume token"
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


class FileTokenStore:
    """One token in a file, as canonical Extended JSON, replaced atomically.

    :meth:`save` writes a temporary file next to the target, fsyncs it,
    renames it over the target and fsyncs the directory: after a crash the
    file holds either the old or the new token, never a mix.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(os.fspath(path))

    @property
    def path(self) -> Path:
        return self._path

    def load(self) -> StoredToken | None:
        """The stored token; ``None`` if the file does not exist; :class:`TokenStoreError` if corrupt."""
        try:
            text = self._path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenStoreError(f"cannot read the token file {self._path}: {exc}") from exc
        where = f"the token file {self._path}"
        try:
            record = json_util.loads(text, json_options=_JSON)
        except (ValueError, TypeError, KeyError) as exc:
            raise TokenStoreError(
                f"the token file {self._path} is corrupt (not Extended JSON: {exc}); restore it "
                "from a backup, or delete it to start from the current time (events since the "
                "last saved token are then skipped)"
            ) from exc
        return _stored(record, where)

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """Atomically replace the file's token (see the class docstring)."""
        text = json_util.dumps(_record(token, batch_id), json_options=_JSON) + "\n"
        directory = self._path.parent
        fd, temporary = tempfile.mkstemp(
            prefix=f".{self._path.name}.", suffix=".tmp", dir=directory
        )
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
        return f"FileTokenStore({str(self._path)!r})"


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

    def __repr__(self) -> str:
        return f"AsyncMongoTokenStore({self._collection.full_name!r}, key={self._key!r})"
