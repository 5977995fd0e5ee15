"""A whole database kept in one Delta table per collection, from one change stream.

:class:`DatabaseTables` is both halves of :func:`changestream.consume` for a
database: the handler routes each change to its collection's table sink, and
the store saves the shared stream's token into every table. Each table keeps
its own position (its own commits, ``(app id, version)`` transactions and
token, as a single :class:`changestream.delta.DeltaSink`), so each is exactly
once on its own:

- the stream opens at the **oldest** position among the tables; a change a
  table already holds (at or before its stored token, by
  :class:`changestream._token.ResumeToken` order) is skipped for that table;
  a save never moves a table's position backwards;
- a collection without a table (there at start, created later, renamed into
  the database) is copied at one cluster time ``T`` on a background thread
  (:class:`changestream._snapshot.SnapshotRun`, the consistent copy of
  ``snapshot_then_watch``) into its table as a first load, while the shared
  stream goes on: its changes after ``T`` are held in memory until the copy
  is done (at most ``max_held``; beyond that the stream waits for the copy),
  then applied; its changes at or before ``T`` are in the copy. A copy killed
  midway continues after its last committed ``_id`` at the same ``T``; the
  stream then opens at ``T`` if that is older than every table's token;
- ``drop`` empties the collection's table; ``rename`` empties the source's
  table, and the target's table is started again from a copy of the renamed
  collection (a commit that empties it and records the copy's position, then
  the copy): every step is one commit with its position, so a ``kill -9``
  anywhere resumes exactly once;
- ``dropDatabase`` ends the run with :class:`DatabaseDroppedError` after the
  drops before it are committed.

The table sinks are built by a factory (``changestream.delta.DatabaseSink``
gives one making ``DeltaSink``\\ s), so this module needs only the
:class:`TableSink` protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any, Protocol

from bson.timestamp import Timestamp
from pymongo.errors import OperationFailure

from ._position import reply_cluster_time
from ._pymongo import SyncCursorReader
from ._snapshot import (
    DeliverRecord,
    RunCommand,
    SnapshotPosition,
    SnapshotRun,
    is_snapshot_position,
    stream_start,
)
from ._token import ResumeToken
from .errors import ChangeStreamError
from .stores import StoredToken

__all__ = ["DatabaseDroppedError", "DatabaseTables", "TableSink", "table_directory"]


class DatabaseDroppedError(ChangeStreamError):
    """The mirrored database was dropped: its tables hold the drops, the run ends."""


class TableSink(Protocol):
    """What the router needs of one collection's table (``DeltaSink`` is one)."""

    path: str

    def __call__(self, change: Mapping[str, Any]) -> None: ...

    def load(self) -> StoredToken | None: ...

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...

    def batch_full(self) -> bool: ...

    def finish(self) -> Any: ...


def table_directory(collection: str) -> str:
    """The directory name of a collection's table: its name, with ``/``, ``\\``, ``%`` escaped.

    Collection names may hold ``/``; a name starting with ``.`` gets its dot
    escaped too, so no name is ``.`` or ``..`` or a hidden directory.
    """
    text = urllib.parse.quote(collection, safe=" !#$&'()+,;=@[]^`{}~-_.")
    return "%2E" + text[1:] if text.startswith(".") else text


def _collection_of(directory: str) -> str:
    return urllib.parse.unquote(directory)


def _cluster_time(change: Mapping[str, Any]) -> Timestamp | None:
    found = change.get("clusterTime")
    if isinstance(found, Timestamp):
        return found
    return ResumeToken.of(change["_id"], check=False).cluster_time


@dataclasses.dataclass
class _Table:
    """One collection's table and where it stands."""

    name: str
    sink: TableSink
    after: ResumeToken | None = None
    """Its stored token: changes at or before it are in the table."""
    at: Timestamp | None = None
    """A copy's time ``T``: changes at or before it are in the table (``after`` unset)."""
    copying: bool = False
    held: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)
    """Changes after ``at`` that came while the copy ran (applied when it is done)."""
    staged: int = 0
    done: threading.Event = dataclasses.field(default_factory=threading.Event)

    def holds(self, change: Mapping[str, Any]) -> bool:
        """Is ``change`` already in the table (or in its copy)?"""
        if self.after is not None:
            return ResumeToken.of(change["_id"], check=False) <= self.after
        if self.at is not None:
            time = _cluster_time(change)
            return time is not None and time <= self.at
        return False

    def position(self, stored: Mapping[str, Any] | None) -> None:
        self.after, self.at = None, None
        if stored is None:
            return
        if is_snapshot_position(stored):
            self.at = SnapshotPosition.parse(stored).at
        else:
            self.after = ResumeToken.of(stored, check=False)


class DatabaseTables:
    """One table per collection of ``database`` under ``path``; both handler and store of ``consume``.

    ``sink_for(path)`` makes a collection's table sink; ``include(name)``
    says which collections are mirrored (default: all but ``system.*``).
    ``watch_options`` are ``watch()``'s for the shared stream (e.g.
    ``full_document``); ``copy_batch_size`` documents per copy commit.
    Use :meth:`open_stream` as ``consume``'s first argument.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        database: Any,
        sink_for: Callable[[str], TableSink],
        *,
        include: Callable[[str], bool] | None = None,
        watch_options: Mapping[str, Any] | None = None,
        copy_batch_size: int = 10_000,
        max_held: int = 200_000,
    ) -> None:
        if isinstance(copy_batch_size, bool) or not isinstance(copy_batch_size, int) \
                or copy_batch_size < 1:
            raise ValueError(f"copy_batch_size must be an integer >= 1, not {copy_batch_size!r}")
        self.path = os.fspath(path)
        self.database = database
        self._sink_for = sink_for
        self._include = include
        self.watch_options = dict(watch_options or {})
        self.copy_batch_size = copy_batch_size
        self.max_held = max_held
        self.tables: dict[str, _Table] = {}
        self._start: StoredToken | None = None
        self._loaded = False
        self._last_token: Mapping[str, Any] | None = None
        self._previous: Mapping[str, Any] | None = None
        self._queue: list[tuple[_Table, dict[str, Any]]] = []
        self._queue_lock = threading.Lock()
        self._copier: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        self._closing = False
        self._copies_started = False
        self._full = False  # a table's staged changes reached its sink's bound since the save
        self.copies = 0
        """Collection copies finished by this object."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, {self.database.name!r})"

    def wanted(self, name: str) -> bool:
        """Is collection ``name`` mirrored?"""
        if name.startswith("system."):
            return False
        return self._include is None or bool(self._include(name))

    # -- the store -----------------------------------------------------------------------------
    def load(self) -> StoredToken | None:
        """Read every table's position, start the copies needed; where the shared stream opens.

        The oldest position wins: a table's token, or a copy's time ``T``
        (returned as a snapshot stream position: the stream opens after
        ``T``). Computed once per object.
        """
        if self._loaded:
            return self._start
        os.makedirs(self.path, exist_ok=True)
        for entry in sorted(os.listdir(self.path)):
            name = _collection_of(entry)
            if not self.wanted(name) or not os.path.isdir(os.path.join(self.path, entry)):
                continue
            table = _Table(name, self._sink_for(os.path.join(self.path, entry)))
            stored = table.sink.load()
            if stored is None:
                continue  # made, never committed by this app id: copied like a new one
            table.position(stored.token)
            self.tables[name] = table
            if is_snapshot_position(stored.token) and stored.token.get("phase") == "copy":
                self._enqueue(table, dict(stored.token))  # a copy killed midway continues
        now = self._now()
        for info in self.database.list_collections(filter={"type": "collection"}):
            name = info["name"]
            if self.wanted(name) and name not in self.tables:
                self._copy(name, now)
        self._loaded = True
        self._start = self._oldest(now)
        return self._start

    def _oldest(self, now: Timestamp) -> StoredToken:
        tokens = [t.after for t in self.tables.values() if t.after is not None]
        times = [t.at for t in self.tables.values() if t.at is not None]
        oldest = min(tokens) if tokens else None
        at = min(times) if times else None
        saved_at = datetime.now(timezone.utc)
        if oldest is not None:
            time = oldest.cluster_time
            if at is None or time is None or (time.time, time.inc) <= (at.time, at.inc):
                return StoredToken(oldest.document(), None, saved_at)
        position = SnapshotPosition("stream", at or now, at or now).document()
        return StoredToken(position, None, saved_at)

    def open_stream(self, token: Mapping[str, Any] | None) -> Any:
        """``consume``'s ``open_stream``: the database's stream from ``token`` or a copy's time."""
        from . import watch

        options = dict(self.watch_options)
        if token is not None and is_snapshot_position(token):
            at = SnapshotPosition.parse(token).at
            return watch(self.database, start_at_operation_time=stream_start(at), **options)
        return watch(self.database, resume_after=token, **options)

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """Commit each table's staged changes with ``token``; a table already past it is left as is."""
        self._adopt()
        self._full = False
        if is_snapshot_position(token):
            return  # nothing came from the stream yet: every table is where it was
        self._last_token = token
        resume = ResumeToken.of(token, check=False)
        time = resume.cluster_time
        for table in list(self.tables.values()):
            if table.copying:
                continue
            if table.after is not None and resume <= table.after:
                continue
            if table.at is not None and (time is None or (time.time, time.inc) <= (
                    table.at.time, table.at.inc)):
                continue  # the copy is newer (nothing of the stream is staged for it)
            table.sink.save(token)
            table.after, table.at, table.staged = resume, None, 0

    # -- the handler ---------------------------------------------------------------------------
    def __call__(self, change: Mapping[str, Any]) -> None:
        """Route one change of the database's stream to its collection's table."""
        self._adopt()
        operation = change.get("operationType")
        if operation == "dropDatabase":
            raise DatabaseDroppedError(
                f"the database {self.database.name} was dropped: its collections' tables are "
                f"empty and the run ends; mirror into a new directory to follow a new "
                f"database of that name ({self.path})"
            )
        ns = change.get("ns") or {}
        name = ns.get("coll")
        if not isinstance(name, str):
            return
        try:
            if operation == "rename":
                self._rename(change, name)
            elif self.wanted(name):
                table = self.tables.get(name)
                if table is None:
                    if operation != "drop":  # a dropped collection without a table: nothing
                        self._copy(name, self._now())
                    return  # this change is in the copy (taken after it)
                self._route(table, change)
        finally:
            self._previous = change["_id"]

    def _route(self, table: _Table, change: Mapping[str, Any]) -> None:
        if table.holds(change):
            return
        if table.copying:
            table.held.append(change)
            if len(table.held) > self.max_held:
                self._wait(table)  # back pressure: the copy is slower than the stream
            return
        table.sink(change)
        table.staged += 1
        self._full = self._full or table.sink.batch_full()

    def batch_full(self) -> bool:
        """Whether a table's staged changes reached its sink's bound: ``consume`` saves then
        (:class:`changestream.stores.BatchingTokenStore`)."""
        return self._full

    def _rename(self, change: Mapping[str, Any], name: str) -> None:
        """The source's table is emptied; the target's starts again from a copy."""
        if self.wanted(name) and name in self.tables:
            self._route(self.tables[name], change)
        target = change.get("to") or {}
        if target.get("db") != self.database.name or not isinstance(target.get("coll"), str):
            return
        to = target["coll"]
        if not self.wanted(to):
            return
        table = self.tables.get(to)
        if table is not None and table.holds(change):
            return  # a replayed rename: the target's copy was already started
        self._copy(to, self._now())

    # -- copies --------------------------------------------------------------------------------
    def _copy(self, name: str, at: Timestamp) -> None:
        """Start ``name``'s table from a copy at ``at``: one commit empties it and records that."""
        table = self.tables.get(name)
        if table is None:
            table = _Table(name, self._sink_for(os.path.join(self.path, table_directory(name))))
            self.tables[name] = table
        elif table.copying:
            self._wait(table)
        if table.staged:  # its changes before the copy's start, committed first
            assert self._previous is not None
            table.sink.save(self._previous)
            table.staged = 0
        position = SnapshotPosition("copy", at, at).document()
        table.sink({"_id": {"_data": ""}, "operationType": "drop",
                    "ns": {"db": self.database.name, "coll": name}})
        table.sink.save(position)
        table.position(position)
        self._enqueue(table, position)

    def _enqueue(self, table: _Table, position: dict[str, Any]) -> None:
        self._copies_started = True
        table.copying, table.held = True, []
        table.done.clear()
        with self._queue_lock:
            self._queue.append((table, position))
            if self._copier is None:  # it left when its queue ran empty: one starts again
                self._copier = threading.Thread(target=self._copy_loop, daemon=True,
                                                name=f"changestream-copy-{self.database.name}")
                self._copier.start()

    def _copy_loop(self) -> None:
        """Copy what is queued, then end: no idle thread outlives a mirror never closed."""
        while True:
            with self._queue_lock:
                if not self._queue:
                    self._copier = None
                    return
                table, position = self._queue[0]
            try:
                self._run_copy(table, position)
            except BaseException as exc:  # the main thread raises it at its next call
                with self._queue_lock:
                    self._copy_error = exc
                    failed, self._queue = self._queue, []
                    self._copier = None
                for waiting, _ in failed:
                    waiting.done.set()
                return
            with self._queue_lock:
                self._queue.pop(0)
            table.done.set()

    def _run_copy(self, table: _Table, position: Mapping[str, Any]) -> None:
        """Copy the collection as ``snapshot_then_watch`` does, committing every batch with its position."""
        collection = self.database[table.name]
        run = SnapshotRun(self.database.name, table.name, [], position,
                          copy_batch_size=min(self.copy_batch_size, 1000))
        session = self.database.client.start_session(causal_consistency=False)
        read = SyncCursorReader(self.database, session, collection.codec_options)
        count = 0
        try:
            while not self._closing:
                action = run.next_action()
                if isinstance(action, DeliverRecord):
                    table.sink(action.record)
                    count += 1
                    if count >= self.copy_batch_size:
                        table.sink.save(run.token)
                        count = 0
                    continue
                if isinstance(action, RunCommand):
                    try:
                        reply = read(action.command.body)  # getMores on the cursor's server
                    except OperationFailure as exc:
                        if not run.on_error(exc.code, str(exc)):
                            raise
                    else:
                        run.on_reply(reply)
                    continue
                table.sink.save(run.token)  # the copy is done: "streaming after T"
                self.copies += 1
                return
            if count:
                table.sink.save(run.token)  # stopping: what was copied, with its position
        finally:
            with contextlib.suppress(Exception):
                read.close()
            with contextlib.suppress(Exception):
                session.end_session()

    def _adopt(self) -> None:
        """Hand the finished copies' tables to the stream, with the changes held meanwhile."""
        if self._copy_error is not None:
            error, self._copy_error = self._copy_error, None
            raise error
        if not self._copies_started:
            return  # the per-change fast path: no copy ever ran
        for table in self.tables.values():
            if table.copying and table.done.is_set():
                stored = table.sink.load()
                table.copying = False
                table.position(None if stored is None else stored.token)
                held, table.held = table.held, []
                for change in held:
                    if not table.holds(change):
                        table.sink(change)
                        table.staged += 1
        self._copies_started = any(table.copying for table in self.tables.values())

    def _wait(self, table: _Table) -> None:
        table.done.wait()
        self._adopt()

    @property
    def copying(self) -> list[str]:
        """The collections being copied now (or waiting for their copy)."""
        return sorted(name for name, table in self.tables.items() if table.copying)

    def finish(self) -> None:
        """Wait for the copies, commit what they held, and compact every table (``--until-idle``)."""
        for table in list(self.tables.values()):
            if table.copying:
                self._wait(table)
        self._adopt()
        if self._last_token is not None:
            pending = [t for t in self.tables.values() if t.staged]
            for table in pending:
                table.sink.save(self._last_token)
                table.after, table.at, table.staged = (
                    ResumeToken.of(self._last_token, check=False), None, 0)
        for table in self.tables.values():
            table.sink.finish()

    def close(self) -> None:
        """Stop the copy thread after its current batch (what it copied stays committed)."""
        with self._queue_lock:
            self._closing = True
            copier = self._copier
        if copier is not None:
            copier.join()

    def _now(self) -> Timestamp:
        """The cluster time now: a copy at it holds every change the stream has handled."""
        found = reply_cluster_time(self.database.client.admin.command("ping"))
        if found is None:
            raise ChangeStreamError(
                "the deployment reports no cluster time (a standalone server?): a database "
                "mirror needs a replica set or a sharded cluster")
        return found
