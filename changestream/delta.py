"""An exactly-once Delta Lake sink: a collection kept in step in a Delta table (no JVM).

:class:`DeltaSink` appends merge-ready batches (:func:`changestream.merge_ready`)
to a Delta table with ``deltalake`` (delta-rs) as change-log rows and records,
in the *same* commit, a Delta application transaction ``(app_id, version)``
and the resume token (in the commit's metadata). The table and the stream
position therefore move together: a batch is in the table exactly when its
token is, and a batch whose version the table already holds is skipped (a
replay is a no-op), the mechanism Spark's own Delta sink uses for idempotent
writes. A first load from a consistent snapshot is appended as base rows;
compaction (``_delta_layout``) folds the log into the base in commits of its
own, so no batch pays for the table's size.

It is both halves of :func:`changestream.consume`: the handler (``sink`` is
callable; it stages each change) and the token store (``save`` commits the
staged changes with the token; ``load`` reads the token back from the table).
``foreach_batch`` uses it the same way; the Spark data source's
``foreachBatch`` calls :meth:`DeltaSink.write` with Spark's batch id.
Needs the ``delta`` extra (``pip install 'changestream[delta]'``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from decimal import Decimal
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
    from deltalake.exceptions import CommitFailedError
except ImportError as exc:  # one clear error instead of a missing module deep inside
    raise ImportError(
        f"changestream.delta needs the 'delta' extra: pip install 'changestream[delta]' ({exc})"
    ) from exc

import tenacity
from bson import json_util
from bson.decimal128 import Decimal128
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from ._delta_json import relaxed_dumps
from ._delta_layout import (
    CURRENT_SQL,
    LOG_ROW_GROUP,
    SEQ,
    Compaction,
    compact,
    current_state,
    first_seq,
    layout_schema,
    log_size,
    with_seq,
)
from ._delta_resnapshot import START, boundary, interrupted, stale_deletes
from ._delta_schema import SchemaTextError, arrow_schema
from ._delta_verify import Verification
from ._merge import (
    CANONICAL,
    RELAXED,
    MergeBatch,
    MergeColumns,
    key_json,
    merge_columns,
)
from ._snapshot import SNAPSHOT_MARK, is_snapshot_position
from ._token import ResumeToken, token_cluster_time
from .errors import ChangeStreamError
from .stores import StoredToken, TokenStoreError
from .stores import _stored as _validated  # the other stores' validation, one wording

__all__ = [
    "CURRENT_SQL", "KEY", "OP", "SEQ", "Compaction", "DeltaSink", "DeltaSinkError",
    "DocumentSchemaError", "SchemaTextError", "Verification", "merge_table",
]

KEY = "_key"
"""The merge key column: the document's ``_id`` as compact Extended JSON."""
OP = "_op"
"""``"upsert"`` or ``"delete"``: what a row does to its key (base rows: ``"upsert"``)."""
DOCUMENT = "document"
"""The default data column: the whole document as Extended JSON."""

_META_APP = "changestream.app_id"
_META_TOKEN = "changestream.token"
_META_VERSION = "changestream.version"
_META_COMPACTION = "changestream.compaction"
_META_RESNAPSHOT = "changestream.resnapshot_from"
"""In each commit of a resnapshot under way: the first ``_seq`` written after its start."""
_TOKEN_JSON = json_util.CANONICAL_JSON_OPTIONS.with_options(tz_aware=True, tzinfo=timezone.utc)


class DeltaSinkError(ChangeStreamError):
    """The table cannot be used by this sink (another schema, no position of this app id)."""


class DocumentSchemaError(DeltaSinkError):
    """A document field does not fit its column of the user-given schema; nothing was written."""


def _json_options(json_mode: str) -> json_util.JSONOptions:
    if json_mode == "relaxed":
        return RELAXED
    if json_mode == "canonical":
        return CANONICAL
    raise ValueError(f"json_mode must be 'relaxed' or 'canonical', not {json_mode!r}")


def table_schema(schema: pa.Schema | None) -> pa.Schema:
    """The Delta table's columns: ``_key``, ``_seq``, ``_op``, then the document (JSON) or ``schema``'s fields."""
    if schema is None:
        return layout_schema(pa.schema([(DOCUMENT, pa.string())]))
    schema = arrow_schema(schema)
    taken = {KEY, OP, SEQ} & set(schema.names)
    if taken:
        raise ValueError(f"schema must not have a column named {sorted(taken)[0]!r} (the sink's own)")
    return layout_schema(schema)


def _cell(value: Any, type_: pa.DataType, json_options: json_util.JSONOptions) -> Any:
    """A BSON value as pyarrow takes it for a column of ``type_`` (strings: as the Spark adapter)."""
    if value is None:
        return None
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        if isinstance(value, str):
            return value
        if isinstance(value, ObjectId):
            return str(value)
        return json_util.dumps(value, json_options=json_options)
    if isinstance(value, Decimal128):
        return value.to_decimal()
    if isinstance(value, ObjectId) or (isinstance(value, bool) and not pa.types.is_boolean(type_)):
        raise TypeError(f"{type(value).__name__} does not fit {type_}")
    if isinstance(value, float) and pa.types.is_integer(type_):
        if not value.is_integer():
            raise TypeError(f"{value!r} does not fit {type_}")
        return int(value)
    if isinstance(value, Decimal) and pa.types.is_integer(type_):
        raise TypeError(f"a decimal does not fit {type_}")
    return value


def merge_table(
    batch: MergeBatch, schema: pa.Schema | None = None, json_mode: str = "relaxed"
) -> pa.Table:
    """``batch`` as the merge's source: ``_key``, ``_op`` and the data columns.

    Without ``schema`` the data column ``document`` holds each document as
    Extended JSON (``json_mode``: ``"relaxed"``, as the Spark adapter's JSON
    columns, or ``"canonical"``, which keeps every numeric type). With a
    ``pyarrow.Schema`` each of its fields takes the document's field of that
    name (missing: null; fields not in the schema are not stored); a value
    that does not fit raises :class:`DocumentSchemaError` naming the field,
    the ``_id`` and the value.
    """
    rows = batch.rows
    return _source([row.key_json for row in rows], [row.op for row in rows],
                   [row.document for row in rows], schema, _json_options(json_mode))


def _source(
    keys: list[str],
    ops: list[str],
    documents: Sequence[Mapping[str, Any] | None],
    schema: pa.Schema | None,
    json_options: json_util.JSONOptions,
) -> pa.Table:
    columns: dict[str, pa.Array] = {
        KEY: pa.array(keys, pa.string()),
        OP: pa.array(ops, pa.string()),
    }
    if schema is None:
        columns[DOCUMENT] = pa.array(_json_texts(documents, json_options), pa.string())
        return pa.table(columns)
    columns.update(document_columns(keys, documents, schema, json_options))
    return pa.table(columns)


def _json_texts(
    documents: Sequence[Mapping[str, Any] | None], json_options: json_util.JSONOptions
) -> list[str | None]:
    if json_options is RELAXED:
        return [None if doc is None else relaxed_dumps(doc) for doc in documents]
    return [None if doc is None else json_util.dumps(doc, json_options=json_options)
            for doc in documents]


def _misfit(field: pa.Field, key: str, value: str, exc: BaseException) -> DocumentSchemaError:
    return DocumentSchemaError(
        f"field {field.name!r} of the document with _id {key} does not fit the column type "
        f"{field.type}: {value[:80]} ({exc}); nothing of this batch was written: widen the "
        "schema (a string column takes any value as JSON) and run again"
    )


def document_columns(
    keys: Sequence[str],
    documents: Sequence[Mapping[str, Any] | None],
    schema: pa.Schema,
    json_options: json_util.JSONOptions = RELAXED,
) -> dict[str, pa.Array]:
    """The columns of ``schema`` from documents (``None``: a deleted row, all null).

    Each field takes the document's field of that name (missing: null;
    fields not in the schema are not stored); a value that does not fit
    raises :class:`DocumentSchemaError` naming the field, the ``_id`` and the value.
    """
    columns: dict[str, pa.Array] = {}
    for field in schema:
        values = []
        for key, document in zip(keys, documents, strict=True):
            value = None if document is None else document.get(field.name)
            try:
                cell = _cell(value, field.type, json_options)
                if cell is not None:
                    pa.array([cell], field.type)
            except (TypeError, ValueError, OverflowError, pa.ArrowException) as exc:
                raise _misfit(field, key, json_util.dumps(value), exc) from exc
            values.append(cell)
        columns[field.name] = pa.array(values, field.type)
    return columns


def struct_columns(
    keys: Sequence[str], documents: pa.StructArray, schema: pa.Schema
) -> dict[str, pa.Array]:
    """The columns of ``schema`` from typed documents (Spark's ``full_document_schema``).

    A field the documents have is cast to its column's type (safe casts only:
    no overflow, no truncation); one they lack is null. A value that does not
    fit raises :class:`DocumentSchemaError`, as from plain Python.
    """
    import pyarrow.compute as pc

    names = [documents.type.field(i).name for i in range(documents.type.num_fields)]
    columns: dict[str, pa.Array] = {}
    for field in schema:
        if field.name not in names:
            columns[field.name] = pa.nulls(len(documents), field.type)
            continue
        values = pc.struct_field(documents, [names.index(field.name)])
        try:
            columns[field.name] = pc.cast(values, field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            for key, value in zip(keys, values, strict=True):  # the first row that does not fit
                try:
                    pc.cast(pa.array([value.as_py()], values.type), field.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as row_exc:
                    raise _misfit(field, key, repr(value.as_py()), row_exc) from exc
            raise _misfit(field, "?", "?", exc) from exc
    return columns


_UNKNOWN: Any = object()
"""Not read from the table yet."""

_COMMIT_ATTEMPTS = 8
"""Commits tried when other writers' commits conflict (with jittered backoff)."""

_LOG_WRITER = WriterProperties(max_row_group_size=LOG_ROW_GROUP)

_REOPEN_EVERY = 100
"""Versions after which the table is opened anew: delta-rs replays, on every write, each
commit since the version a ``DeltaTable`` was opened at (not since the newest checkpoint),
so a long-lived object made each commit cost more (23 -> 142 ms per commit over 1,200
commits); opened anew it starts from the checkpoint delta-rs writes every 100 versions.
"""
"""Commits tried when other writers' commits conflict (with jittered backoff)."""


class DeltaSink:
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

    The table is a base plus an append-only change log (``docs/mirror.md``,
    "The table's layout"): each batch is appended, and the log is compacted
    into the base when it reaches ``log_fraction`` of the base rows a
    compaction would rewrite, or ``max_log_rows`` rows (compaction holds the
    logged keys in memory, and one unit of the base). :meth:`finish` compacts it all: then the
    table read by anything is the collection's current state; in between,
    :meth:`read_current` (or :data:`CURRENT_SQL`) reads it.
    ``target_file_size`` bounds the data files compaction writes (bytes).
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
        target_file_size: int = 64 << 20,
    ) -> None:
        if not isinstance(app_id, str) or not app_id:
            raise ValueError(f"app_id must be a non-empty string, not {app_id!r}")
        if not log_fraction > 0:
            raise ValueError(f"log_fraction must be > 0, not {log_fraction!r}")
        if isinstance(max_log_rows, bool) or not isinstance(max_log_rows, int) or max_log_rows < 1:
            raise ValueError(f"max_log_rows must be an integer >= 1, not {max_log_rows!r}")
        self.path = os.fspath(path)
        self.app_id = app_id
        self.schema: pa.Schema | None = None if schema is None else arrow_schema(schema)
        """The document columns as Arrow (``None``: one JSON column)."""
        self.json_mode = json_mode
        self._json_options = _json_options(json_mode)
        self._table_schema = table_schema(self.schema)
        self.full_document = full_document
        self._storage_options = storage_options
        self.idle_commit_seconds = idle_commit_seconds
        self.log_fraction = log_fraction
        self.max_log_rows = max_log_rows
        self.target_file_size = target_file_size
        self._table: DeltaTable | None = None
        self._opened_at = 0
        self._staged: list[Mapping[str, Any]] = []
        self._staged_table: tuple[pa.Table, bool] | None = None
        self._token_committed_at: float | None = None
        self._position: Any = _UNKNOWN
        """The token of this app id's last commit (``None``: none), once read."""
        self._seen_version: Any = _UNKNOWN
        """The app id's batch version as this sink last saw or wrote it."""
        self._resnapshot_from: int | None = None
        """A resnapshot is under way: keys whose newest ``_seq`` is below this are dropped at
        its end (``_delta_resnapshot``); read back by :meth:`load`."""
        self.commits = 0
        """Commits of batches and positions made by this sink object."""
        self.skipped = 0
        """Batches skipped because the table already held their version."""
        self.compactions: list[Compaction] = []
        """What each compaction by this sink object did."""

    def __repr__(self) -> str:
        return f"DeltaSink({self.path!r}, app_id={self.app_id!r})"

    # -- the table ---------------------------------------------------------------------------
    def table(self) -> DeltaTable | None:
        """The table at its latest version (``None``: it does not exist yet)."""
        if self._table is not None:
            self._table.update_incremental()
            if self._table.version() - self._opened_at < _REOPEN_EVERY:
                return self._table
            self._table = None  # past a checkpoint: reopened from it, below
        if not DeltaTable.is_deltatable(self.path, self._storage_options):
            return None
        table = DeltaTable(self.path, storage_options=self._storage_options)
        self._check_schema(table)
        self._table, self._opened_at = table, table.version()
        if self._seen_version is _UNKNOWN:
            self._seen_version = table.transaction_version(self.app_id)
        return table

    def _check_schema(self, table: DeltaTable) -> None:
        have = pa.schema(table.schema().to_arrow())
        names = [field.name for field in have]
        want = self._table_schema.names
        if names == want:
            return
        if SEQ not in names and names == [n for n in want if n not in (SEQ, OP)]:
            raise DeltaSinkError(
                f"the Delta table at {self.path} has the layout of an earlier changestream (one "
                f"merged row per key, columns {names}); this sink appends a change log "
                f"(columns {want}): mirror into a new path"
            )
        raise DeltaSinkError(
            f"the Delta table at {self.path} has the columns {names}, this sink writes {want}: "
            "give another path, or the schema the table was made with"
        )

    def _create(self) -> DeltaTable:
        try:
            DeltaTable.create(
                self.path, self._table_schema, storage_options=self._storage_options,
                commit_properties=CommitProperties(custom_metadata={_META_APP: self.app_id}),
            )
        except Exception:  # another writer created it first: use theirs
            if not DeltaTable.is_deltatable(self.path, self._storage_options):
                raise
        table = self.table()
        assert table is not None
        return table

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
        table = self.table()
        if table is None:
            self._position = None
            return None
        limit: int | None = 64
        while True:
            history = table.history(limit)
            for commit in history:
                if commit.get(_META_APP) == self.app_id and _META_TOKEN in commit:
                    stored = self._stored(table, commit)
                    self._position = stored.token
                    since = commit.get(_META_RESNAPSHOT)
                    self._resnapshot_from = None if since is None else int(since)
                    return stored
            if limit is None or len(history) < limit:
                self._position = None
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
        if self._staged_table is not None:
            table, cleared = self._staged_table
            written = self._commit(table, batch_id, token, cleared=cleared)
            self._staged_table = None
            if written:
                self._maybe_compact()
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
        if any(boundary(change) for change in staged):
            self._save_bounded(staged, token, batch_id)
            return
        try:
            first_load = self._first_load(staged)
            if first_load:
                self._commit(self._base_rows(staged), batch_id, token, base=True)
            else:
                batch = merge_columns(staged, full_document=self.full_document,
                                      json_options=self._json_options)
                self._commit(batch, batch_id, token)
        except BaseException:
            self._staged = staged + self._staged  # a retried save commits them
            raise
        if not first_load:  # after the commit: a failed compaction loses no batch
            self._maybe_compact()

    def _leaves_copy(self, token: Mapping[str, Any]) -> bool:
        """The copy is over: its end is committed at once (the table's position says so)."""
        position = self._position
        return (is_snapshot_position(position) and position.get("phase") == "copy"
                and not (is_snapshot_position(token) and token.get("phase") == "copy"))

    def _first_load(self, staged: Sequence[Mapping[str, Any]]) -> bool:
        """Are these snapshot records of this app id's first load (appended as base rows)?

        Only while the position is a copy of a new table: each key comes
        once, in no earlier row; after that, snapshot records are changes.
        """
        try:
            if any(change["_id"]["_data"] != SNAPSHOT_MARK or change["_id"]["phase"] != "copy"
                   for change in staged):
                return False
        except (KeyError, TypeError):
            return False
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
                    self._commit(None, None, change["_id"],
                                 resnapshot="abandon" if interrupted(change) else "close")
                done = i + 1
            if done < len(staged):
                self._commit_changes(staged[done:], token, batch_id)
        except BaseException:
            self._staged = staged[done:] + self._staged  # a retried save commits them
            raise
        self._maybe_compact()

    def _commit_changes(self, changes: Sequence[Mapping[str, Any]], token: Mapping[str, Any],
                        batch_id: int | None = None, *, resnapshot: str | None = None) -> None:
        batch = merge_columns(changes, full_document=self.full_document,
                              json_options=self._json_options) if changes else None
        self._commit(batch, batch_id, token, resnapshot=resnapshot)

    def _base_rows(self, staged: Sequence[Mapping[str, Any]]) -> pa.Table:
        """Snapshot records as a merge table: one upsert per key, no collapse needed."""
        keys, documents = [], []
        for change in staged:
            try:
                key = change["documentKey"]["_id"]
            except (KeyError, TypeError):
                continue  # a record of no document (snapshotInterrupted)
            documents.append(change["fullDocument"])
            keys.append(key)
        texts = [key_json(key, self._json_options) for key in keys]
        rows = _source(texts, ["upsert"] * len(texts), documents, self.schema, self._json_options)
        return rows.sort_by(KEY)  # tight key ranges in the file's statistics

    # -- the handler -------------------------------------------------------------------------
    def __call__(self, change: Mapping[str, Any]) -> None:
        """Stage one change (the next :meth:`save` commits it): ``consume``'s handler."""
        self._staged.append(change)

    def stage(self, table: pa.Table, *, cleared: bool = False) -> None:
        """Stage a whole merge table (:func:`merge_table`'s columns); the next :meth:`save` commits it.

        ``foreach_batch``'s path: its ``func`` stages, then it saves the batch's
        token and id in this sink (the store), so both land in one commit.
        """
        if self._staged:
            raise RuntimeError("changes staged by the handler are not saved yet; use one of "
                               "the two ways per sink")
        self._staged_table = (table, cleared)  # replaces a batch whose save failed: re-cut

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
        if not isinstance(batch, (MergeBatch, pa.Table)):
            batch = merge_columns(batch, full_document=self.full_document,
                                  json_options=self._json_options)
        if not self._commit(batch, version, token, cleared=cleared):
            return False
        self._maybe_compact()
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
        resnapshot: str | None = None,
    ) -> bool:
        """One commit of the batch's rows, its version and token; retried on conflicts.

        ``resnapshot``: ``"open"`` notes that a resnapshot starts after these rows,
        ``"close"`` appends the deletes of the keys it did not bring (and ends it),
        ``"abandon"`` ends it without deletes (the copy was cut short).
        """
        if isinstance(batch, MergeBatch):
            cleared = batch.cleared
            source: pa.Table | None = merge_table(batch, self.schema, self.json_mode)
        elif isinstance(batch, MergeColumns):
            cleared = batch.cleared
            source = _source(batch.keys, batch.ops, batch.documents, self.schema,
                             self._json_options)
        else:
            source = batch
        metadata = {_META_APP: self.app_id}
        if token is not None:
            metadata[_META_TOKEN] = json_util.dumps(
                ResumeToken.of(token, check=False).document(), json_options=_TOKEN_JSON
            )
        since = self._resnapshot_from
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
                    return False
                transactions = None
                if number is not None:
                    metadata[_META_VERSION] = str(number)
                    transactions = [Transaction(self.app_id, number)]
                properties = CommitProperties(custom_metadata=metadata,
                                              app_transactions=transactions)
                if source is None:
                    rows = self._table_schema.empty_table()
                else:
                    rows = with_seq(source, self._table_schema,
                                    0 if base else first_seq(table.version()))
                write_deltalake(table, rows, mode="overwrite" if cleared else "append",
                                commit_properties=properties,
                                writer_properties=_LOG_WRITER,
                                storage_options=self._storage_options)
                if number is not None:
                    self._seen_version = number
        self.commits += 1
        if resnapshot is not None:
            self._resnapshot_from = since if resnapshot == "open" else None
        if token is not None:
            self._token_committed_at = time.monotonic()
            self._position = dict(ResumeToken.of(token, check=False).document())
        return True

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

        def give_up(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            raise DeltaSinkError(
                f"the Delta table at {self.path} kept changing under this writer: "
                f"{state.attempt_number} commits conflicted with other writers' ({exc})"
            ) from exc

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(CommitFailedError),
            stop=tenacity.stop_after_attempt(_COMMIT_ATTEMPTS),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=2.0),
            retry_error_callback=give_up,
        )

    # -- compaction ----------------------------------------------------------------------------
    def _maybe_compact(self) -> None:
        if self._resnapshot_from is not None:
            return  # compaction renumbers rows to _seq 0: wait for the resnapshot's end
        table = self.table()
        assert table is not None
        size = log_size(table)
        if size.log_rows and (size.log_rows >= self.max_log_rows
                              or size.log_rows >= self.log_fraction * size.touched_rows):
            self.compact()

    def compact(self) -> Compaction | None:
        """Fold the whole change log into the base now, in a commit of its own (no logical change).

        Rewrites only the base files whose key ranges the log touches. Runs
        by itself when the log is large enough; ``None``: there was no log, or a
        resnapshot is under way (its end needs the rows' numbers; it compacts after).
        """
        if self._position is _UNKNOWN:
            self.load()
        if self._resnapshot_from is not None:
            return None
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
                                 storage_options=self._storage_options)
        if result is not None:
            self.compactions.append(result)
            pa.default_memory_pool().release_unused()  # the rewrite's buffers, back to the OS
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
        from pymongo.collection import Collection
        from pymongo.errors import OperationFailure

        from ._delta_verify import Hashes as _Hashes
        from ._delta_verify import collection_batches, compare, new_powers, table_hashes

        if not isinstance(collection, Collection):
            raise TypeError(f"verify() needs a pymongo Collection, not {type(collection).__name__}")
        started = time.monotonic()
        at = self._verify_at(self.load())
        powers = new_powers()
        data = [name for name in self._table_schema.names if name not in (KEY, SEQ, OP)]
        delta = self.table()
        if delta is not None and log_size(delta).log_rows == 0:  # compacted: stream the base
            batches = delta.to_pyarrow_dataset().to_batches(columns=[KEY, *data],
                                                           batch_size=65_536)
            table = _Hashes.of(iter(batches), data, powers)
        else:  # a change log to fold: the current state in memory
            table = table_hashes(self.read_current(), powers)
        database = collection.database
        session = database.client.start_session(causal_consistency=False)

        def read(command: dict[str, Any]) -> Mapping[str, Any]:
            return database.command(command, session=session,
                                    codec_options=collection.codec_options)

        def convert(documents: list[Mapping[str, Any]]) -> pa.Table:
            keys = [key_json(document["_id"], self._json_options) for document in documents]
            return _source(keys, ["upsert"] * len(keys), documents, self.schema,
                           self._json_options)

        try:
            side = _Hashes.of(collection_batches(read, collection.name, at, convert), data, powers)
        except OperationFailure as exc:
            if exc.code == 239:  # SnapshotTooOld
                raise DeltaSinkError(
                    f"the server no longer keeps the table's position ({at}) for a snapshot read "
                    f"(minSnapshotHistoryWindowInSeconds): catch the table up first "
                    f"(changestream mirror --until-idle, or mirror --verify, which does), then "
                    f"verify") from exc
            raise
        finally:
            session.end_session()
        return compare(table, side, at=at, started=started, examples=examples)

    def _verify_at(self, stored: StoredToken | None) -> Timestamp | None:
        """The cluster time the table holds everything up to (``None``: no position yet)."""
        if stored is None:
            return None
        token = stored.token
        if is_snapshot_position(token):  # a copy reads at readAt (mid-copy: the rest is missing)
            at = token.get("readAt", token.get("at")) if token.get("phase") == "copy" \
                else token.get("at")
            return at if isinstance(at, Timestamp) else None
        return token_cluster_time(token)

    def finish(self) -> Compaction | None:
        """Compact what is logged: afterwards every reader sees the current state, plainly.

        ``changestream mirror --until-idle`` calls it before it exits.
        """
        return self.compact()
