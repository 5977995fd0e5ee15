"""The Delta sink itself (:class:`DeltaSink`): batches and their tokens in one commit each.

The public face is :mod:`changestream.delta` (its docstring says what the sink
guarantees); this module is the class: staging, the first load by appends, the
commit with its application transaction and token, replays skipped, conflicting
writers retried or refused, and compaction triggered (``_delta_layout``).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Literal

try:
    import pyarrow as pa
    from deltalake import (
        CommitProperties,
        DeltaTable,
        Transaction,
        WriterProperties,
        write_deltalake,
    )
except ImportError as exc:  # one clear error instead of a missing module deep inside
    raise ImportError(
        f"changestream.delta needs the 'delta' extra: pip install 'changestream[delta]' ({exc})"
    ) from exc

import tenacity
from bson import json_util

from ._delta_behind import WriteBehind
from ._delta_drift import Drift, RescuedCounts
from ._delta_history import HistoryTable, as_of
from ._delta_layout import (
    FILE_ROWS,
    LOG_ROW_GROUP,
    REOPEN_EVERY,
    SEQ,
    Compaction,
    compact,
    current_state,
    first_seq,
    log_size,
    merge_small,
    with_seq,
)
from ._delta_merger import SmallFileMerger, ThreadTable
from ._delta_recopy import START, boundary, interrupted, stale_deletes
from ._delta_resnapshot import request_snapshot
from ._delta_rows import (
    KEY,
    OP,
    DeltaSinkError,
    base_rows,
    cell,
    check_table_columns,
    commit_retries,
    json_options_for,
    json_worker_for,
    misfit,
    source_table,
    staged_form,
    table_schema,
)
from ._delta_schema import arrow_schema
from ._delta_sizes import BATCH_BYTES, check_sizes, is_record, staged_size
from ._delta_verify import Verification, verify_table
from ._json_worker import JsonWorker
from ._merge import MergeBatch, MergeColumns, merge_columns
from ._snapshot import is_snapshot_position
from ._token import ResumeToken
from .stores import StoredToken, TokenStoreError
from .stores import _stored as _validated  # the other stores' validation, one wording

__all__ = ["DeltaSink"]

_META_APP = "changestream.app_id"
_META_TOKEN = "changestream.token"
_META_VERSION = "changestream.version"
_META_COMPACTION = "changestream.compaction"
_META_RESNAPSHOT = "changestream.resnapshot_from"
"""In each commit of a resnapshot under way: the first ``_seq`` written after its start."""
_TOKEN_JSON = json_util.CANONICAL_JSON_OPTIONS.with_options(tz_aware=True, tzinfo=timezone.utc)


_UNKNOWN: Any = object()
"""Not read from the table yet."""

_LOG_WRITER = WriterProperties(max_row_group_size=LOG_ROW_GROUP)
_BASE_WRITER = WriterProperties()

_SMALL_RUN = 16  # a first load's small files side by side merged at once (or file_rows / 2)


class DeltaSink(WriteBehind):
    """Keeps a Delta table equal to a collection, exactly once; also its own token store.

    ``path`` is the table's location (a directory, or a URI with
    ``storage_options``); the table is created on the first write. ``app_id``
    names the writer in the table's application transactions: one per
    source, so two sources can write one table (their commits are retried
    when they conflict); a second live writer with the same ``app_id`` is
    refused with :class:`DeltaSinkError`. ``schema`` stores the
    documents' fields as columns instead of one JSON column: a
    ``pyarrow.Schema``, a Spark ``StructType`` (converted by pyspark's
    ``to_arrow_schema``), or a Spark DDL string (``"name STRING, qty INT"``)
    or Spark's / Delta's schema JSON (``StructType.json()``), both read
    without a JVM (:class:`SchemaTextError` names a mistake in the text).
    A value that does not fit its column fails the batch with
    :class:`DocumentSchemaError`: nothing is written and the position does
    not move. ``json_mode`` picks relaxed (default) or canonical
    Extended JSON. ``full_document`` is what the stream was opened with (see
    :func:`changestream.merge_ready`). Token-only commits (an idle stream's
    position) are made at most every ``idle_commit_seconds``.

    The table is a base plus an append-only change log (``docs/mirror.md``, "The table's
    layout"): each batch is appended, and the log is compacted into the base when it reaches
    ``log_fraction`` of the base rows a compaction would rewrite and ``min_log_rows`` rows
    (below, its fixed cost, ~0.1 s, outweighs its work; both doubled while the stream waits
    for the batch), or ``max_log_rows`` rows (it holds the logged keys and a unit of base).
    :meth:`finish` compacts it all: then the table read by anything is the collection's
    current state; in between, :meth:`read_current` (or :data:`CURRENT_SQL`) reads it.
    Compaction and the first load's merges write base files of about ``file_rows`` rows
    (at most ``target_file_size`` bytes): a compaction rewrites each file that holds a
    logged key, whole. ``consume`` saves once the staged changes hold about
    ``batch_bytes`` bytes (:meth:`batch_full`; ``None``: only ``save_every`` counts).
    ``json_worker``: a large batch's JSON texts are made in a helper process (``None``: on a
    machine of more than one core; or a :class:`JsonWorker` to share): the stream's own
    interpreter is a mirror's bound.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        app_id: str = "changestream",
        schema: pa.Schema | str | Any | None = None,
        json_mode: Literal["relaxed", "canonical"] = "relaxed",
        full_document: str | None = None,
        storage_options: dict[str, str] | None = None,
        idle_commit_seconds: float = 60.0,
        log_fraction: float = 0.5,
        max_log_rows: int = 2_000_000,
        min_log_rows: int = 50_000,
        target_file_size: int = 64 << 20,
        file_rows: int = FILE_ROWS,
        history: str | os.PathLike[str] | None = None,
        on_mismatch: Literal["fail", "rescue"] = "fail",
        evolve: bool = False,
        batch_bytes: int | None = BATCH_BYTES,
        json_worker: bool | JsonWorker | None = None,
    ) -> None:
        if not isinstance(app_id, str) or not app_id:
            raise ValueError(f"app_id must be a non-empty string, not {app_id!r}")
        check_sizes(log_fraction=log_fraction, max_log_rows=max_log_rows,
                    min_log_rows=min_log_rows, file_rows=file_rows, batch_bytes=batch_bytes)
        self.path, self.app_id = os.fspath(path), app_id
        self.schema: pa.Schema | None = None if schema is None else arrow_schema(schema)
        """The document columns as Arrow (``None``: one JSON column)."""
        self.json_mode = json_mode
        self._json_options = json_options_for(json_mode)
        self._drift: Drift | None = None
        if on_mismatch != "fail" or evolve:
            if self.schema is None:
                raise ValueError("on_mismatch='rescue' and evolve=True need a schema (without "
                                 "one every document is stored whole as JSON)")
            self._drift = Drift(self.schema, on_mismatch, evolve, cell, misfit)
        self._table_schema = table_schema(self.schema if self._drift is None else self._drift.schema)
        self.full_document = full_document
        self.storage_options = storage_options
        self.idle_commit_seconds, self.batch_bytes = idle_commit_seconds, batch_bytes
        self.log_fraction = log_fraction
        self.max_log_rows, self.min_log_rows = max_log_rows, min_log_rows
        self.target_file_size, self.file_rows = target_file_size, file_rows
        self.unit_rows = 250_000
        """Base rows a compaction rewrites at a time (its memory)."""
        self._table: DeltaTable | None = None
        self._opened_at = 0
        self._staged: list[Mapping[str, Any]] = []
        self._staged_bytes = self._staged_records = 0  # of _staged: bytes, about; snapshot records
        self._namespaces: dict[bytes, tuple[Any, Any]] = {}  # raw events' ns: (db, coll)
        self._staged_table: tuple[pa.Table, bool] | None = None
        self.json_worker = json_worker_for(json_worker)
        """Makes large batches' JSON texts in a helper process (``docs/mirror.md``)."""
        self._token_committed_at: float | None = None
        self._position: Any = _UNKNOWN
        """The token of this app id's last commit (``None``: none), once read."""
        self._seen_version: Any = _UNKNOWN
        """The app id's batch version as this sink last saw or wrote it."""
        self.position_commit: Mapping[str, Any] | None = None
        """The metadata of the commit :meth:`load` found (this app id's last with a token)."""
        self._resnapshot_from: int | None = None
        """A resnapshot is under way: keys whose newest ``_seq`` is below this are dropped at
        its end (``_delta_resnapshot``); read back by :meth:`load`."""
        self.commits = 0
        """Commits of batches and positions made by this sink object."""
        self.skipped = 0
        """Batches skipped because the table already held their version."""
        self.compactions: list[Compaction] = []
        """What each compaction by this sink object did."""
        self.history: HistoryTable | None = None
        """The history table (``history=``): every change, SCD type 2 (``_delta_history``)."""
        if history is not None:
            if os.fspath(history) == self.path:
                raise ValueError("history must be another path than the table's")
            self.history = HistoryTable(os.fspath(history), app_id=app_id,
                                        full_document=full_document,
                                        json_options=self._json_options,
                                        storage_options=storage_options)
        self._settling = threading.Lock()  # the write-behind's (``_delta_behind``)
        self._merger = SmallFileMerger(self._merge_small, self.compactions.append, _SMALL_RUN)
        self._merge_table = ThreadTable(self.path, storage_options)  # the merger thread's
        """A first load's small files, merged on a worker thread (``_delta_merger``)."""
        self.commit_metadata: dict[str, str] = {}
        """Extra entries of every batch commit's metadata (a re-snapshot's progress rides
        in the commit that applies its chunk: ``_delta_resnapshot``)."""

    def __repr__(self) -> str:
        return f"DeltaSink({self.path!r}, app_id={self.app_id!r})"

    # -- the table ---------------------------------------------------------------------------
    def table(self) -> DeltaTable | None:
        """The table at its latest version (``None``: it does not exist yet)."""
        self._wait_behind()  # a commit under way uses the table (its error: at the next save)
        if self._table is not None:
            self._table.update_incremental()
            if self._table.version() - self._opened_at < REOPEN_EVERY:
                return self._table
            self._table = None  # past a checkpoint: reopened from it, below
        if not DeltaTable.is_deltatable(self.path, self.storage_options):
            return None
        table = DeltaTable(self.path, storage_options=self.storage_options)
        self._check_schema(table)
        self._table, self._opened_at = table, table.version()
        if self._seen_version is _UNKNOWN:
            self._seen_version = table.transaction_version(self.app_id)
        return table

    def _check_schema(self, table: DeltaTable) -> None:
        adopted = check_table_columns(self.path, pa.schema(table.schema().to_arrow()),
                                      self._table_schema, self._drift)
        if adopted is not None:
            self._table_schema = adopted

    def _create(self) -> DeltaTable:
        try:
            DeltaTable.create(
                self.path, self._table_schema, storage_options=self.storage_options,
                commit_properties=CommitProperties(custom_metadata={_META_APP: self.app_id}),
            )
        except Exception:  # another writer created it first: use theirs
            if not DeltaTable.is_deltatable(self.path, self.storage_options):
                raise
        table = self.table()
        assert table is not None
        return table

    @property
    def rescued(self) -> int:
        """Values this sink put into ``_rescued`` (fields of committed batches; 0 without rescue)."""
        return 0 if self._drift is None else self._drift.rescued

    @property
    def columns(self) -> pa.Schema:
        """The data columns as the table has them now (``_rescued``, evolved ones included)."""
        return self._table_schema.remove(0).remove(0).remove(0)

    def reporting(self, callback: Callable[[Any], object]) -> Callable[[Any], object]:
        """``callback`` for ``consume(on_stats=...)``, with :attr:`rescued` in each report.

        ``ConsumeStats.rescued`` is 0 unless a sink fills it in this way; the
        exporters count it (``changestream_values_rescued_total``).
        """
        return RescuedCounts(callback, lambda: self.rescued)

    @property
    def applied_version(self) -> int | None:
        """The last batch version this app id committed (``None``: none yet)."""
        table = self.table()
        return None if table is None else table.transaction_version(self.app_id)

    def read_current(self) -> pa.Table:
        """The collection's current state as Arrow (``_key`` and the data columns, by ``_key``).

        Right at any time, between compactions too: each key's row with the
        highest ``_seq``, unless that row is a delete. The same as
        :data:`CURRENT_SQL` in DuckDB or Spark SQL.
        """
        table = self.table()
        if table is None:
            return self._table_schema.empty_table().drop_columns([SEQ, OP])
        return current_state(table)

    # -- the token store ---------------------------------------------------------------------
    def load(self) -> StoredToken | None:
        """The token of this app id's last commit, with its batch version (``None``: none).

        A token that is not a resume token (a damaged commit) raises
        :class:`changestream.stores.TokenStoreError` naming the table.
        """
        self._settle()
        table = self.table()
        if table is None:
            self._position, self.position_commit = None, None
            return None
        limit: int | None = 64
        while True:
            history = table.history(limit)
            for commit in history:
                if commit.get(_META_APP) == self.app_id and _META_TOKEN in commit:
                    stored = self._stored(table, commit)
                    self._position, self.position_commit = stored.token, commit
                    since = commit.get(_META_RESNAPSHOT)
                    self._resnapshot_from = None if since is None else int(since)
                    return stored
            if limit is None or len(history) < limit:
                self._position, self.position_commit = None, None
                self._resnapshot_from = None
                return None
            limit = None

    def _stored(self, table: DeltaTable, commit: Mapping[str, Any]) -> StoredToken:
        where = f"the Delta table at {self.path} (commit {commit.get('version')}, app id " \
                f"{self.app_id!r})"
        try:
            token = json_util.loads(str(commit[_META_TOKEN]), json_options=_TOKEN_JSON)
            saved_at = datetime.fromtimestamp(commit["timestamp"] / 1000, timezone.utc)
        except Exception as exc:  # any damage of the text is one error naming the table
            raise TokenStoreError(
                f"the resume token stored in {where} is unreadable: {exc}") from exc
        record = {"token": token, "batch_id": table.transaction_version(self.app_id),
                  "saved_at": saved_at}
        return _validated(record, where)

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """Commit the staged changes with ``token`` (version ``batch_id``, or the next one)."""
        self._settle()
        if self._staged_table is not None:
            table, cleared = self._staged_table
            written = self._commit(table, batch_id, token, cleared=cleared)
            self._staged_table = None
            if written is not None:
                self._maybe_compact(written)
            return
        staged, self._staged = self._staged, []
        if not staged:
            now = time.monotonic()
            if (
                self._token_committed_at is not None
                and now - self._token_committed_at < self.idle_commit_seconds
                and not self._leaves_copy(token)
            ):
                return  # nothing handled since: an older durable token loses nothing
            self._commit(None, None, token)
            return
        if any(not isinstance(change, tuple) and boundary(change) for change in staged):
            self._save_bounded(staged, token, batch_id)
            return
        try:
            first_load = self._first_load(staged)
            if first_load:
                written = self._commit(self._base_rows(staged), batch_id, token, base=True,
                                       changes=staged)
            else:
                written = self._commit_changes(staged, token, batch_id)
        except BaseException:
            self._staged = staged + self._staged  # a retried save commits them
            raise
        if first_load:  # after the commit: a failed merge or compaction loses no batch
            self._merger.after_commit()
        elif written is not None:
            self._maybe_compact(written)

    def _write_history(self, changes: Sequence[Mapping[str, Any]], version: int,
                       token: str | None, stale: Sequence[str]) -> None:
        """The history table's commit of ``changes`` as batch ``version``, before this table's
        (``stale``: the keys a recopy's end deletes in this commit, rows at ``snapshotEnd``)."""
        assert self.history is not None

        def data(keys: list[str], documents: list[Mapping[str, Any] | None]) -> pa.Table:
            rows = source_table(keys, ["upsert"] * len(keys), documents, self.schema,
                                self._json_options, self._drift, count=False)
            return rows.drop_columns([KEY, OP])

        def live() -> list[str]:
            keys: list[str] = self.read_current().column(KEY).to_pylist()
            return keys

        rows = self.history.rows(changes, version, data, live, stale=stale)
        self.history.write(rows, version, token)

    def read_history(self) -> pa.Table:
        """The history table with ``valid_to`` (:data:`HISTORY_SQL`), by ``_key`` then ``_seq``."""
        if self.history is None:
            raise ValueError("this sink keeps no history: give DeltaSink(..., history=PATH)")
        return self.history.read()

    def read_as_of(self, time: datetime) -> pa.Table:
        """The collection as it was at ``time`` (aware), from the history (:data:`AS_OF_SQL`)."""
        return as_of(self.read_history(), time)

    def _leaves_copy(self, token: Mapping[str, Any]) -> bool:
        """The copy is over: its end is committed at once (the table's position says so)."""
        position = self._position
        return (is_snapshot_position(position) and position.get("phase") == "copy"
                and not (is_snapshot_position(token) and token.get("phase") == "copy"))

    def _first_load(self, staged: Sequence[Any]) -> bool:
        """Are these snapshot records of this app id's first load (appended as base rows)? Only
        while the position is a copy of a new table (after that, snapshot records are changes)."""
        if not all(type(change) is not tuple and is_record(change) for change in staged):
            return False  # (a tuple: a stream event's row, _merge.Row)
        if self._position is _UNKNOWN:
            self.load()
        position = self._position
        if position is None:
            return self.applied_version is None
        return (is_snapshot_position(position) and position.get("phase") == "copy"
                and not position.get("marks"))  # a resnapshot's records are changes

    def _save_bounded(self, staged: list[Mapping[str, Any]], token: Mapping[str, Any],
                      batch_id: int | None) -> None:
        """Commit changes holding a resnapshot's ``snapshotStart``/``snapshotEnd`` records.

        Each record ends a commit of its own (with the changes before it and its
        position as the token): the start notes where the copy's rows begin, the
        end deletes every key the copy did not bring (``_delta_resnapshot``).
        """
        done = 0
        try:
            for i, change in enumerate(staged):
                kind = boundary(change)
                if kind is None:
                    continue
                part = staged[done:i]
                if kind == START:
                    self._commit_changes(part, change["_id"], resnapshot="open")
                else:
                    if part:
                        self._commit_changes(part, part[-1]["_id"])
                    self._commit(None, None, change["_id"], changes=[change],
                                 resnapshot="abandon" if interrupted(change) else "close")
                done = i + 1
            if done < len(staged):
                self._commit_changes(staged[done:], token, batch_id)
        except BaseException:
            self._staged = staged[done:] + self._staged  # a retried save commits them
            raise
        self._maybe_compact()

    def _commit_changes(self, changes: Sequence[Mapping[str, Any]], token: Mapping[str, Any],
                        batch_id: int | None = None, *, resnapshot: str | None = None,
                        extra: Mapping[str, str] | None = None) -> DeltaTable | None:
        batch = merge_columns(changes, full_document=self.full_document,
                              json_options=self._json_options) if changes else None
        return self._commit(batch, batch_id, token, changes=changes, resnapshot=resnapshot,
                            extra=extra)

    def _base_rows(self, staged: Sequence[Mapping[str, Any]]) -> pa.Table:
        """Snapshot records as a merge table: one upsert per key, no collapse needed."""
        return base_rows(staged, self.schema, self._json_options, self._drift)

    # -- the handler -------------------------------------------------------------------------
    def __call__(self, change: Mapping[str, Any]) -> None:
        """Stage one change (the next :meth:`save` commits it): ``consume``'s handler. Raw events
        (``document_class=RawBSONDocument``) cost least: only a key's last document is decoded."""
        whole = self.schema is not None or self.history is not None
        form = staged_form(change, self._json_options, self._namespaces, whole=whole)
        if not self._staged:  # (a batch staged again is not recounted)
            self._staged_bytes = self._staged_records = 0
        self._staged_bytes += staged_size(change, form)
        self._staged_records += type(form) is not tuple and is_record(form)
        self._staged.append(form)

    def batch_full(self) -> bool:
        """Whether the staged changes reached ``batch_bytes`` (the first batch: a quarter,
        ``_bytes_full``) or the snapshot records a base file's ``file_rows``: save then."""
        return bool(self._staged) and (
            self._bytes_full(self.batch_bytes, self._staged_bytes, self._staged_records)
            or self._staged_records >= self.file_rows)

    def stage(self, table: pa.Table, *, cleared: bool = False) -> None:
        """Stage a whole merge table (:func:`merge_table`'s columns); the next :meth:`save` commits it.

        ``foreach_batch``'s path: its ``func`` stages, then it saves the batch's
        token and id in this sink (the store), so both land in one commit.
        """
        self._settle()
        if self._staged:
            raise RuntimeError("changes staged by the handler are not saved yet; use one of "
                               "the two ways per sink")
        self._refuse_tables()
        self._staged_table = (table, cleared)  # replaces a batch whose save failed: re-cut

    def _refuse_tables(self) -> None:
        """Merge tables are built outside the sink (Spark): no rescue, evolution or history."""
        if self._drift is not None:
            raise ValueError("a sink with on_mismatch='rescue' or evolve=True builds its rows "
                             "itself: give it changes, not a merge table")
        if self.history is not None:
            raise ValueError("a sink with a history table writes lists of changes (the "
                             "history keeps every change, a merge table only each key's last)")

    # -- whole batches -----------------------------------------------------------------------
    def write(
        self,
        batch: MergeBatch | Sequence[Mapping[str, Any]] | pa.Table,
        version: int,
        token: Mapping[str, Any] | None = None,
        *,
        cleared: bool = False,
    ) -> bool:
        """Append ``batch`` as version ``version`` unless the table holds it; ``True``: written.

        ``batch`` is a :class:`MergeBatch`, a list of changes, or a merge table
        (:func:`merge_table`; the Spark path builds one). For the Spark data
        source's ``foreachBatch``, ``version`` is Spark's batch id: a batch
        Spark runs again is skipped. ``cleared`` (merge tables only): delete every
        row not in ``batch`` (the collection was dropped or renamed in it).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, not {version!r}")
        applied = self.applied_version
        if applied is not None and version <= applied and applied == self._seen_version:
            self.skipped += 1  # before any conversion: cheap
            return False
        if isinstance(batch, pa.Table):
            self._refuse_tables()
        changes: Sequence[Mapping[str, Any]] | None = None
        if isinstance(batch, MergeBatch):
            if self.history is not None:
                raise ValueError("a sink with a history table writes lists of changes (the "
                                 "history keeps every change, a merge batch only the last)")
        elif not isinstance(batch, pa.Table):
            changes = batch
            batch = merge_columns(batch, full_document=self.full_document,
                                  json_options=self._json_options)
        written = self._commit(batch, version, token, cleared=cleared, changes=changes)
        if written is None:
            return False
        self._maybe_compact(written)
        return True

    # -- committing ----------------------------------------------------------------------------
    def _commit(
        self,
        batch: MergeBatch | MergeColumns | pa.Table | None,
        version: int | None,
        token: Mapping[str, Any] | None,
        *,
        cleared: bool = False,
        base: bool = False,
        changes: Sequence[Mapping[str, Any]] | None = None,
        resnapshot: str | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> DeltaTable | None:
        """One commit of the batch's rows, its version and token; retried on conflicts.

        Returns the table as committed (``None``: it held the version already, skipped).

        ``changes``: the raw changes the rows come from; with a history table they are
        committed there first, as the same version (with a recopy's end deletes).
        ``resnapshot``: ``"open"`` notes that a resnapshot starts after these rows,
        ``"close"`` appends the deletes of the keys it did not bring (and ends it),
        ``"abandon"`` ends it without deletes (the copy was cut short).
        """
        drift = self._drift
        if drift is not None and drift.evolve:
            self.table()  # an evolved table's columns first (a restart), then new ones
        if isinstance(batch, MergeBatch):
            batch = batch.columns()
        source = batch if not isinstance(batch, MergeColumns) else source_table(
            batch.keys, batch.ops, batch.documents, self.schema, self._json_options, drift,
            texts=functools.partial(self.json_worker, idle=self._awaited))
        cleared = batch.cleared if isinstance(batch, MergeColumns) else cleared
        if drift is not None and drift.evolve:
            self._table_schema = table_schema(drift.schema)  # new fields, new columns
        metadata = {**(self.commit_metadata if extra is None else extra), _META_APP: self.app_id}
        text = None if token is None else json_util.dumps(
            ResumeToken.of(token, check=False).document(), json_options=_TOKEN_JSON)
        if text is not None:
            metadata[_META_TOKEN] = text
        since = self._resnapshot_from
        history = None if changes is None or self.history is None else changes
        for attempt in self._retrying():
            with attempt:
                table = self.table() or self._create()
                applied = self._check_writer(table)
                metadata.pop(_META_RESNAPSHOT, None)
                if resnapshot == "open":
                    since = first_seq(table.version() + 1)  # above every row of this commit
                elif resnapshot == "close" and since is not None:
                    source = stale_deletes(table, since, self._table_schema)
                if since is not None and resnapshot in (None, "open"):
                    metadata[_META_RESNAPSHOT] = str(since)
                number = version if version is not None or source is None else (
                    -1 if applied is None else applied) + 1
                if number is not None and applied is not None and number <= applied:
                    self.skipped += 1
                    return None
                transactions = None
                if number is not None:
                    metadata[_META_VERSION] = str(number)
                    transactions = [Transaction(self.app_id, number)]
                properties = CommitProperties(custom_metadata=metadata,
                                              app_transactions=transactions)
                if history is not None and number is not None:
                    self._write_history(history, number, text, () if resnapshot != "close"
                                        or source is None else source.column(KEY).to_pylist())
                if source is None:
                    rows = self._table_schema.empty_table()
                else:
                    rows = with_seq(source, self._table_schema,
                                    0 if base else first_seq(table.version()))
                write_deltalake(table, rows, mode="overwrite" if cleared else "append",
                                schema_mode="merge" if drift is not None and drift.evolve
                                else None,
                                commit_properties=properties,
                                writer_properties=_BASE_WRITER if base else _LOG_WRITER,
                                storage_options=self.storage_options)
                if number is not None:
                    self._seen_version = number
        self.commits += 1
        if resnapshot is not None:
            self._resnapshot_from = since if resnapshot == "open" else None
        if drift is not None:  # counted once committed (a failed batch is counted when retried)
            drift.rescued += drift.pending if source is not None else 0
            drift.pending = 0
        if token is not None:
            self._token_committed_at = time.monotonic()
            self._position = dict(ResumeToken.of(token, check=False).document())
        return table

    def _check_writer(self, table: DeltaTable) -> int | None:
        """This app id's batch version; refused if it moved under this sink (another writer)."""
        applied = table.transaction_version(self.app_id)
        if self._seen_version is not _UNKNOWN and applied != self._seen_version:
            raise DeltaSinkError(
                f"another writer holds the Delta table at {self.path} with app id "
                f"{self.app_id!r} (its batch version moved from {self._seen_version} to "
                f"{applied} under this one): run one writer per app id"
            )
        self._seen_version = applied
        return applied

    def _retrying(self) -> tenacity.Retrying:
        """Bounded retries, jittered backoff, of commits that conflicted with other writers'."""
        return commit_retries(self.path)

    # -- compaction ----------------------------------------------------------------------------
    def _maybe_compact(self, table: DeltaTable | None = None, *, waited: bool = False) -> None:
        """Compact when the log is large enough (``waited``: :meth:`LogSize.due`'s); ``table``:
        as the batch's commit left it (not listed again)."""
        if self._resnapshot_from is not None:
            return  # compaction renumbers rows to _seq 0: wait for the resnapshot's end
        table = self.table() if table is None else table
        assert table is not None
        if log_size(table).due(self.log_fraction, self.min_log_rows, self.max_log_rows,
                               waited=waited):
            self.compact()

    def compact(self) -> Compaction | None:
        """Fold the whole change log into the base now, in a commit of its own (no logical change).

        Rewrites only the base files whose key ranges the log touches. Runs
        by itself when the log is large enough; ``None``: there was no log, or a
        resnapshot is under way (its end needs the rows' numbers; it compacts after).
        """
        self._settle()
        if self._position is _UNKNOWN:
            self.load()
        if self._resnapshot_from is not None:
            return None
        self._merger.wait()  # one rewrite of base files at a time
        result: Compaction | None = None
        for attempt in self._retrying():
            with attempt:
                table = self.table()
                if table is None:
                    return None
                properties = CommitProperties(
                    custom_metadata={_META_APP: self.app_id, _META_COMPACTION: "log into base"})
                result = compact(table, self._table_schema, properties,
                                 target_file_size=self.target_file_size,
                                 storage_options=self.storage_options,
                                 unit_rows=self.unit_rows, file_rows=self.file_rows)
        if result is not None:
            self.compactions.append(result)
            pa.default_memory_pool().release_unused()  # the rewrite's buffers, back to the OS
        return result

    def request_snapshot(self) -> int:
        """Ask the mirror running on this table to re-read the collection while it streams.

        A signal commit in the table (no rows); the running mirror sees it
        within seconds and re-reads the collection in chunks of ``_id``
        ranges between watermarks (``docs/mirror.md``, "Re-snapshot while
        streaming"). Returns the signal's table version.
        """
        return request_snapshot(self.path, self.storage_options)

    def _merge_small(self) -> Compaction | None:
        """Merge the first load's small files once enough of them sit side by side (on the
        merger's thread: a table object of its own)."""
        result = None
        for attempt in self._retrying():
            with attempt:
                table = self._merge_table.get()
                properties = CommitProperties(custom_metadata={
                    _META_APP: self.app_id, _META_COMPACTION: "small base files"})
                try:
                    result = merge_small(table, self._table_schema, properties,
                                         self.file_rows // 2, _SMALL_RUN, self.file_rows,
                                         self.target_file_size, self.storage_options)
                except BaseException:
                    self._merge_table.drop()  # opened anew by the next try
                    raise
        return result

    # -- verifying ---------------------------------------------------------------------------
    def verify(self, collection: Any, *, examples: int = 5) -> Verification:
        """Compare the table with ``collection`` at the table's position; a :class:`Verification`.

        The collection is read with ``readConcern: {level: "snapshot",
        atClusterTime: T}``, ``T`` the cluster time of the stored token, so both
        sides are the same moment. Rows are compared by hashes of key ranges
        (vectorised; a range is drilled into only when it differs), which also
        catches damage Delta cannot see (a data file missing from the log). A
        server that no longer keeps ``T`` (SnapshotTooOld) raises
        :class:`DeltaSinkError`: catch up first (``changestream mirror --verify``
        does). In the middle of a copy, the documents not copied yet are
        missing. Nothing is written.
        """
        return verify_table(collection, self.load(), self.table(), self._table_schema,
                            self.schema, self._json_options, examples=examples,
                            drift=self._drift)

    def finish(self) -> Compaction | None:
        """Compact what is logged: afterwards every reader sees the current state, plainly.

        ``changestream mirror --until-idle`` calls it before it exits.
        """
        self._merger.close()
        self.json_worker.close()  # (started again by the next large batch)
        return self.compact()
