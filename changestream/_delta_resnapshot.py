"""Re-snapshot while streaming: DBLog's watermarks over a Delta table kept by the change stream.

A running mirror re-reads its collection in chunks of ``_id`` ranges without
stopping the stream (Netflix's DBLog; Debezium's incremental snapshots):

* **signal**: :func:`request_snapshot` makes an empty commit in the table
  whose metadata asks for a re-snapshot (``mirror --resnapshot`` and
  :meth:`changestream.delta.DeltaSink.request_snapshot`). The table is the one
  thing the requester and the mirror surely share: no write access to MongoDB,
  no extra collection, and the request is durable (a mirror that is down sees
  it when it starts);
* **low watermark**: right after a batch commit (the stream's position), the
  next chunk is read: ``_id > after`` in ``_id`` order, ``chunk_size``
  documents, with ``readConcern: snapshot`` (one point in time, ``T``);
* **window**: every key the stream changes from then on is noted;
* **high watermark**: the first save whose token is past ``T``. The chunk's
  rows whose keys are in the window are dropped (the stream's version wins);
  the others are applied, and the keys of the chunk's range that the table
  holds but the chunk did not return are deleted, all in that save's commit,
  with its token and the re-snapshot's progress (``changestream.resnapshot``
  in the commit's metadata). A ``kill -9`` therefore loses or repeats no
  chunk: the restarted mirror reads the progress of its last commit and goes
  on after the last applied chunk.

So a chunk row never overwrites a newer change, documents deleted meanwhile
are removed, and once the last chunk is applied the table equals the
collection (and stays so, the stream going on).
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
from bson import json_util
from bson.raw_bson import RawBSONDocument
from bson.timestamp import Timestamp
from deltalake import CommitProperties, DeltaTable, write_deltalake
from pymongo.errors import PyMongoError

from ._delta_layout import KEY, OP, SEQ, UPSERT, latest
from ._delta_rows import decode_raw
from ._merge import CANONICAL, RELAXED, key_json
from ._pymongo import SyncCursorReader
from ._snapshot import SNAPSHOT_MARK, SnapshotBatches, bson_order_key, range_filter
from ._token import token_cluster_time
from .stores import StoredToken

__all__ = ["REQUEST", "STATE", "DeltaResnapshot", "ResnapshotProgress", "bson_order_key",
           "request_snapshot"]

REQUEST = "changestream.resnapshot.request"
"""Commit metadata of a re-snapshot request (its value: when, for people reading the log)."""
STATE = "changestream.resnapshot"
"""Commit metadata of a batch commit: the re-snapshot's progress as JSON."""
_log = logging.getLogger("changestream.mirror")
_EJSON = json_util.CANONICAL_JSON_OPTIONS


def _record_id(at: Timestamp | None) -> dict[str, Any]:
    """The ``_id`` of a chunk's rows as staged changes (ordered before events; keys are
    disjoint), with the chunk's read time as ``at``: the history's ``valid_from`` of them."""
    record: dict[str, Any] = {"_data": SNAPSHOT_MARK, "phase": "resnapshot"}
    if at is not None:
        record["at"] = at
    return record


def request_snapshot(path: str, storage_options: dict[str, str] | None = None) -> int:
    """Make the signal commit in the table at ``path``; its version."""
    if not DeltaTable.is_deltatable(path, storage_options):
        raise ValueError(f"no Delta table at {path}: a re-snapshot is asked of a running "
                         "mirror's table")
    table = DeltaTable(path, storage_options=storage_options)
    empty = pa.schema(table.schema().to_arrow()).empty_table()
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    write_deltalake(table, empty, mode="append", storage_options=storage_options,
                    commit_properties=CommitProperties(custom_metadata={REQUEST: when}))
    return table.version()  # the write's own (read again, a running mirror's next commit)


# -- progress ----------------------------------------------------------------------------------
@dataclasses.dataclass
class ResnapshotProgress:
    """A re-snapshot's progress, as committed with the chunk that made it (JSON in the commit)."""

    request: int = -1
    """Table version of the last request taken up (-1: none)."""
    active: bool = False
    after: str | None = None
    """The last applied chunk's upper ``_id`` (canonical Extended JSON; ``None``: from the start)."""
    chunks: int = 0
    total: int = 0
    """Chunks expected (the collection's estimated count when it started)."""
    keys: int = 0
    """Documents re-read."""
    applied: int = 0
    """Rows the chunks applied (re-read keys not changed by the stream meanwhile)."""
    dropped: int = 0
    """Re-read keys dropped because the stream changed them between the watermarks."""
    deleted: int = 0
    """Delete rows written: keys the table held when the re-snapshot began that their chunk
    did not return (the stream may have deleted some of them already)."""

    def text(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, text: str) -> ResnapshotProgress:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(text).items() if k in fields})

    def status(self) -> str:
        """For the status line: ``resnapshot 3/10 chunks, 30000 keys``."""
        if not self.active:
            return ""
        return f"resnapshot {self.chunks}/{max(self.total, self.chunks)} chunks, {self.keys} keys"


class _Sink(Protocol):
    """What the re-snapshot needs of :class:`changestream.delta.DeltaSink`."""

    path: str
    app_id: str
    json_mode: str
    commit_metadata: dict[str, str]
    position_commit: Mapping[str, Any] | None

    def __call__(self, change: Mapping[str, Any]) -> None: ...
    def load(self) -> StoredToken | None: ...
    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...
    def save_behind(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None: ...
    def flush(self) -> None: ...
    def table(self) -> DeltaTable | None: ...


@dataclasses.dataclass
class _Chunk:
    """A chunk read at ``at``, waiting for the stream to pass ``at`` (its high watermark)."""

    at: Timestamp | None
    documents: dict[str, Mapping[str, Any]]
    """By the table's key text."""
    upper: Any
    last: bool


class DeltaResnapshot:
    """A Delta sink that re-snapshots on request while it streams: consume's handler and store.

    Wraps a :class:`changestream.delta.DeltaSink` (everything is delegated to
    it) and reads chunks from ``collection`` (a PyMongo collection). Requests
    are looked for every ``poll_seconds`` (at a save); :meth:`request`
    starts one from this process.
    """

    def __init__(self, sink: _Sink, collection: Any, *, chunk_size: int = 10_000,
                 poll_seconds: float = 2.0,
                 watermarks: str | None = "changestream_watermarks") -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an integer >= 1, not {chunk_size!r}")
        self.sink = sink
        self.collection = collection
        self.chunk_size = chunk_size
        self.poll_seconds = poll_seconds
        self.watermarks = watermarks
        """The control collection (of the collection's database) of the high watermark writes
        (``None``: none; the stream's own progress, e.g. mongod's periodic no-op, moves it)."""
        self._marking = watermarks is not None
        self.progress = ResnapshotProgress()
        self._json = CANONICAL if sink.json_mode == "canonical" else RELAXED
        self._chunk: _Chunk | None = None
        self._window: set[str] = set()
        self._table_keys: list[Any] | None = None
        """The table's keys when the re-snapshot (re)started, in BSON order (values)."""
        self._table_texts: list[str] = []
        self._polled_at: float | None = None
        self._polled_version: int | None = None
        """The table's version at the last poll: the next reads only the commits after it."""
        self._asked = False

    def progress_text(self) -> str:
        """The status line's part: ``resnapshot 3/10 chunks, 30000 keys`` (empty: none runs)."""
        return self.progress.status()

    # -- consume's handler and store -----------------------------------------------------
    def __call__(self, change: Mapping[str, Any]) -> None:
        chunk = self._chunk
        if chunk is not None and type(change) is RawBSONDocument:
            change = decode_raw(change.raw)  # read below (the window takes its key)
        self.sink(change)
        if chunk is not None:
            key = (change.get("documentKey") or {}).get("_id", _NONE)
            if key is not _NONE:
                self._window.add(key_json(key, self._json))
            token = change.get("_id")
            if (isinstance(token, Mapping) and token.get("_data") != SNAPSHOT_MARK
                    and _past(token, chunk.at)):
                # the high watermark is passed: the chunk is applied now, with this change
                # as the position, not at consume's next save (seconds later: a chunk per
                # save made a re-snapshot of 1M documents take 26 minutes)
                self._save(token, None, behind=False)

    def load(self) -> StoredToken | None:
        stored = self.sink.load()
        self.progress = self._committed_progress()
        self.sink.commit_metadata[STATE] = self.progress.text()
        self._chunk, self._table_keys = None, None
        return stored

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        self._save(token, batch_id, behind=False)

    def save_behind(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """``consume``'s save: the sink commits behind while no re-snapshot runs."""
        self._save(token, batch_id, behind=True)

    def flush(self) -> None:
        """Wait for the sink's commit under way (``consume`` calls it before it returns)."""
        self.sink.flush()

    def _save(self, token: Mapping[str, Any], batch_id: int | None, *, behind: bool) -> None:
        if token.get("_data") == SNAPSHOT_MARK:
            # the first copy, or a recopy after a lost history: a re-snapshot waits for it; a
            # chunk read before it is stale (its window would take every copied key) and the
            # table's keys change: the next chunk is read again from ``progress.after``
            self._chunk, self._table_keys, self._table_texts = None, None, []
            self._window.clear()
            self.sink.save(token, batch_id=batch_id)
            return
        if self._poll_due():  # before the save: the batch behind is committed first (the wait
            self.sink.flush()  # save_behind makes anyway), so the poll never waits on the fetch
            self._poll()
        before = dataclasses.replace(self.progress)
        staged = False
        if self._chunk is not None and _past(token, self._chunk.at):
            self._stage_chunk(self._chunk)
            staged = True
        self.sink.commit_metadata[STATE] = self.progress.text()
        try:
            if behind and not staged and not self.progress.active:
                self.sink.save_behind(token, batch_id=batch_id)
            else:  # a chunk's commit: the next chunk is read after it (its low watermark)
                self.sink.save(token, batch_id=batch_id)
        except BaseException:
            self.progress = before
            self.sink.commit_metadata[STATE] = before.text()
            raise
        if staged:
            self._chunk = None
            self._window.clear()
        if self.progress.active and self._chunk is None:  # (then this save was not behind)
            self._read_chunk()  # the low watermark: the position just committed

    def request(self) -> int:
        """Ask for a re-snapshot (a signal commit in the table); its table version."""
        table = self.sink.table()
        if table is None:
            raise ValueError("the table does not exist yet: its first copy is a snapshot")
        self._asked = True
        return request_snapshot(self.sink.path)

    # -- requests ------------------------------------------------------------------------
    def _poll_due(self) -> bool:
        return self._asked or self._polled_at is None \
            or time.monotonic() - self._polled_at >= self.poll_seconds

    def _poll(self) -> None:
        self._polled_at, self._asked = time.monotonic(), False
        table = self.sink.table()
        if table is None:
            return
        version, since = table.version(), self._polled_version
        self._polled_version = version
        limit = 100 if since is None else version - since  # only the commits since the last
        if limit <= 0:
            return
        newest = -1
        for commit in table.history(limit):
            if REQUEST in commit and int(commit.get("version", -1)) > self.progress.request:
                newest = max(newest, int(commit["version"]))
        if newest < 0:
            return
        count = self.collection.estimated_document_count()
        self.progress = ResnapshotProgress(
            request=newest, active=True, total=max(1, -(-count // self.chunk_size)))
        self._chunk, self._table_keys = None, None  # a new request restarts a running one

    def _committed_progress(self) -> ResnapshotProgress:
        """The progress in this app id's last commit with a token, which the sink's
        :meth:`load` just found (none: a fresh one)."""
        text = (self.sink.position_commit or {}).get(STATE)
        return ResnapshotProgress.parse(str(text)) if text else ResnapshotProgress()

    # -- chunks --------------------------------------------------------------------------
    def _read_chunk(self) -> None:
        after = None if self.progress.after is None else json_util.loads(
            self.progress.after, json_options=_EJSON)
        match = range_filter(after, has_lower=self.progress.after is not None)
        pipeline: list[dict[str, Any]] = [{"$match": match}] if match else []
        pipeline += [{"$sort": {"_id": 1}}, {"$limit": self.chunk_size}]
        database = self.collection.database
        documents: dict[str, Mapping[str, Any]] = {}
        with database.client.start_session() as session:
            read = SyncCursorReader(database, session)  # getMores on the server of the cursor
            batches = SnapshotBatches(read, self.collection.name, pipeline,
                                      batch_size=self.chunk_size)
            for batch in batches:
                for doc in batch:
                    documents[key_json(doc["_id"], self._json)] = doc
            read.close()
        last = len(documents) < self.chunk_size
        upper = None if last else list(documents.values())[-1]["_id"]
        self._chunk = _Chunk(batches.at, documents, upper, last)
        self._window.clear()
        self._mark()

    def _mark(self) -> None:
        """DBLog's high watermark: a write after the chunk's read moves the stream's position past
        the read time even when the collection is idle (the write is in another collection,
        so the stream only advances its token). Without write access: the stream's own
        progress does it, later (logged once)."""
        if not self._marking or self.watermarks is None:
            return
        try:
            self.collection.database[self.watermarks].update_one(
                {"_id": self.sink.app_id}, {"$inc": {"chunks": 1}}, upsert=True)
        except PyMongoError as exc:
            self._marking = False
            _log.warning("re-snapshot: cannot write the high watermark to %s.%s (%s); a "
                         "chunk then waits for the stream's next change or no-op",
                         self.collection.database.name, self.watermarks, exc)

    def _keys_in_range(self, lower: Any, has_lower: bool, chunk: _Chunk) -> list[str]:
        """The table's keys (as the re-snapshot started) in the chunk's ``_id`` range."""
        if self._table_keys is None:
            self._load_table_keys()
        assert self._table_keys is not None
        start = 0 if not has_lower else bisect.bisect_right(self._table_keys,
                                                           bson_order_key(lower))
        end = len(self._table_keys) if chunk.last else bisect.bisect_right(
            self._table_keys, bson_order_key(chunk.upper))
        return self._table_texts[start:end]

    def _load_table_keys(self) -> None:
        table = self.sink.table()
        if table is None:
            self._table_keys, self._table_texts = [], []
            return
        rows = latest(table.to_pyarrow_dataset().to_table(columns=[KEY, SEQ, OP]))
        rows = rows.filter(pc.equal(rows.column(OP), UPSERT))  # the live keys
        texts: list[str] = rows.column(KEY).to_pylist()
        pairs = sorted((bson_order_key(json_util.loads(text, json_options=self._json)), text)
                       for text in texts)
        self._table_keys = [pair[0] for pair in pairs]
        self._table_texts = [pair[1] for pair in pairs]

    def _stage_chunk(self, chunk: _Chunk) -> None:
        """The chunk as changes staged in the sink (it commits them with the batch)."""
        progress = self.progress
        lower = None if progress.after is None else json_util.loads(progress.after,
                                                                   json_options=_EJSON)
        namespace = {"db": self.collection.database.name, "coll": self.collection.name}
        window = self._window
        record_id = _record_id(chunk.at)
        applied = dropped = deleted = 0
        for text, doc in chunk.documents.items():
            if text in window:
                dropped += 1
                continue
            self.sink({"_id": record_id, "operationType": "replace", "ns": namespace,
                       "documentKey": {"_id": doc["_id"]}, "fullDocument": doc})
            applied += 1
        for text in self._keys_in_range(lower, progress.after is not None, chunk):
            if text in chunk.documents or text in window:
                continue
            key = json_util.loads(text, json_options=self._json)
            self.sink({"_id": record_id, "operationType": "delete", "ns": namespace,
                       "documentKey": {"_id": key}})
            deleted += 1
        progress.chunks += 1
        progress.keys += len(chunk.documents)
        progress.applied += applied
        progress.dropped += dropped
        progress.deleted += deleted
        if chunk.last:
            progress.active = False
            progress.total = progress.chunks
            self._table_keys, self._table_texts = None, []
        else:
            progress.after = json_util.dumps(chunk.upper, json_options=_EJSON)


_NONE: Any = object()


def _past(token: Mapping[str, Any], at: Timestamp | None) -> bool:
    """Is the stream past the chunk's read time (its high watermark)?"""
    if at is None:
        return True  # no read time known: the chunk is applied at once (no window)
    time_ = token_cluster_time(token)
    return time_ is not None and time_ > at

