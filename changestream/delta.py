"""An exactly-once Delta Lake sink: a collection kept in step in a Delta table (no JVM).

:class:`DeltaSink` merges merge-ready batches (:func:`changestream.merge_ready`)
into a Delta table with ``deltalake`` (delta-rs) and records, in the *same*
commit, a Delta application transaction ``(app_id, version)`` and the resume
token (in the commit's metadata). The table and the stream position therefore
move together: a batch is in the table exactly when its token is, and a batch
whose version the table already holds is skipped (a replay is a no-op), the
mechanism Spark's own Delta sink uses for idempotent writes.

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
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
except ImportError as exc:  # one clear error instead of a missing module deep inside
    raise ImportError(
        f"changestream.delta needs the 'delta' extra: pip install 'changestream[delta]' ({exc})"
    ) from exc

from bson import json_util
from bson.decimal128 import Decimal128
from bson.objectid import ObjectId

from ._delta_schema import SchemaTextError, arrow_schema
from ._merge import CANONICAL, RELAXED, MergeBatch, merge_ready
from ._token import ResumeToken
from .errors import ChangeStreamError
from .stores import StoredToken

__all__ = [
    "KEY", "OP", "DeltaSink", "DeltaSinkError", "DocumentSchemaError", "SchemaTextError",
    "merge_table",
]

KEY = "_key"
"""The merge key column: the document's ``_id`` as compact Extended JSON."""
OP = "_op"
"""Source-only column of a merge table: ``"upsert"`` or ``"delete"``."""
DOCUMENT = "document"
"""The default data column: the whole document as Extended JSON."""

_META_APP = "changestream.app_id"
_META_TOKEN = "changestream.token"
_META_VERSION = "changestream.version"
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
    """The Delta table's columns: the key, then the document (JSON) or ``schema``'s fields."""
    if schema is None:
        return pa.schema([(KEY, pa.string()), (DOCUMENT, pa.string())])
    schema = arrow_schema(schema)
    taken = {KEY, OP} & set(schema.names)
    if taken:
        raise ValueError(f"schema must not have a column named {sorted(taken)[0]!r} (the sink's own)")
    return pa.schema([pa.field(KEY, pa.string()), *schema])


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
    json_options = _json_options(json_mode)
    rows = batch.rows
    keys = [row.key_json for row in rows]
    columns: dict[str, pa.Array] = {
        KEY: pa.array(keys, pa.string()),
        OP: pa.array([row.op for row in rows], pa.string()),
    }
    documents = [row.document for row in rows]
    if schema is None:
        columns[DOCUMENT] = pa.array(
            [None if doc is None else json_util.dumps(doc, json_options=json_options)
             for doc in documents],
            pa.string(),
        )
        return pa.table(columns)
    columns.update(document_columns(keys, documents, schema, json_options))
    return pa.table(columns)


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


class DeltaSink:
    """Keeps a Delta table equal to a collection, exactly once; also its own token store.

    ``path`` is the table's location (a directory, or a URI with
    ``storage_options``); the table is created on the first write. ``app_id``
    names the writer in the table's application transactions: one per
    source, so two sources can write one table. ``schema`` stores the
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
    ) -> None:
        if not isinstance(app_id, str) or not app_id:
            raise ValueError(f"app_id must be a non-empty string, not {app_id!r}")
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
        self._table: DeltaTable | None = None
        self._staged: list[Mapping[str, Any]] = []
        self._staged_table: tuple[pa.Table, bool] | None = None
        self._token_committed_at: float | None = None
        self.commits = 0
        """Commits made by this sink object."""
        self.skipped = 0
        """Batches skipped because the table already held their version."""

    def __repr__(self) -> str:
        return f"DeltaSink({self.path!r}, app_id={self.app_id!r})"

    # -- the table ---------------------------------------------------------------------------
    def table(self) -> DeltaTable | None:
        """The table at its latest version (``None``: it does not exist yet)."""
        if self._table is None:
            if not DeltaTable.is_deltatable(self.path, self._storage_options):
                return None
            self._table = DeltaTable(self.path, storage_options=self._storage_options)
            self._check_schema(self._table)
        else:
            self._table.update_incremental()
        return self._table

    def _check_schema(self, table: DeltaTable) -> None:
        have = pa.schema(table.schema().to_arrow())
        names = [field.name for field in have]
        want = self._table_schema.names
        if names != want:
            raise DeltaSinkError(
                f"the Delta table at {self.path} has the columns {names}, this sink writes {want}: "
                "give another path, or the schema the table was made with"
            )

    def _create(self, properties: CommitProperties) -> None:
        self._table = DeltaTable.create(
            self.path, self._table_schema, storage_options=self._storage_options,
            commit_properties=properties,
        )

    @property
    def applied_version(self) -> int | None:
        """The last batch version this app id committed (``None``: none yet)."""
        table = self.table()
        return None if table is None else table.transaction_version(self.app_id)

    # -- the token store ---------------------------------------------------------------------
    def load(self) -> StoredToken | None:
        """The token of this app id's last commit, with its batch version (``None``: none)."""
        table = self.table()
        if table is None:
            return None
        limit: int | None = 64
        while True:
            history = table.history(limit)
            for commit in history:
                if commit.get(_META_APP) == self.app_id and _META_TOKEN in commit:
                    token = json_util.loads(commit[_META_TOKEN], json_options=_TOKEN_JSON)
                    saved_at = datetime.fromtimestamp(commit["timestamp"] / 1000, timezone.utc)
                    return StoredToken(token, table.transaction_version(self.app_id), saved_at)
            if limit is None or len(history) < limit:
                return None
            limit = None

    def save(self, token: Mapping[str, Any], *, batch_id: int | None = None) -> None:
        """Commit the staged changes with ``token`` (version ``batch_id``, or the next one)."""
        if self._staged_table is not None:
            table, cleared = self._staged_table
            applied = self.applied_version
            version = batch_id if batch_id is not None else (-1 if applied is None else applied) + 1
            self._commit(table, version, token, cleared=cleared)
            self._staged_table = None
            return
        staged, self._staged = self._staged, []
        if not staged:
            now = time.monotonic()
            if (
                self._token_committed_at is not None
                and now - self._token_committed_at < self.idle_commit_seconds
            ):
                return  # nothing handled since: an older durable token loses nothing
            self._commit(None, None, token)
            return
        try:
            batch = merge_ready(staged, full_document=self.full_document,
                                json_options=self._json_options)
            applied = self.applied_version
            version = batch_id if batch_id is not None else (-1 if applied is None else applied) + 1
            self._commit(batch, version, token)
        except BaseException:
            self._staged = staged + self._staged  # a retried save commits them
            raise

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
        """Merge ``batch`` as version ``version`` unless the table holds it; ``True``: written.

        ``batch`` is a :class:`MergeBatch`, a list of changes, or a merge table
        (:func:`merge_table`; the Spark path builds one). For the Spark data
        source's ``foreachBatch``, ``version`` is Spark's batch id: a batch
        Spark runs again is skipped. ``cleared`` (merge tables only): delete every
        row not in ``batch`` (the collection was dropped or renamed in it).
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an integer >= 0, not {version!r}")
        applied = self.applied_version
        if applied is not None and version <= applied:  # before any conversion: cheap
            self.skipped += 1
            return False
        if not isinstance(batch, (MergeBatch, pa.Table)):
            batch = merge_ready(batch, full_document=self.full_document,
                                json_options=self._json_options)
        return self._commit(batch, version, token, cleared=cleared)

    def _commit(
        self,
        batch: MergeBatch | pa.Table | None,
        version: int | None,
        token: Mapping[str, Any] | None,
        *,
        cleared: bool = False,
    ) -> bool:
        metadata = {_META_APP: self.app_id}
        if token is not None:
            metadata[_META_TOKEN] = json_util.dumps(
                ResumeToken.of(token, check=False).document(), json_options=_TOKEN_JSON
            )
        transactions = None
        if version is not None:
            metadata[_META_VERSION] = str(version)
            transactions = [Transaction(self.app_id, version)]
        properties = CommitProperties(custom_metadata=metadata, app_transactions=transactions)
        table = self.table()
        if version is not None and table is not None:
            applied = table.transaction_version(self.app_id)
            if applied is not None and version <= applied:
                self.skipped += 1
                return False
        if isinstance(batch, MergeBatch):
            cleared = batch.cleared
            source = merge_table(batch, self.schema, self.json_mode)
        else:
            source = batch
        if table is None:  # created empty first: the batch and its txn go in one commit
            self._create(CommitProperties(custom_metadata={_META_APP: self.app_id}))
            table = self.table()
            assert table is not None
        if source is None or (source.num_rows == 0 and not cleared):
            self._append_nothing(table, properties)
        else:
            before = table.version()
            self._merge(table, source, cleared, properties)
            table.update_incremental()
            if table.version() == before:  # a merge that changed nothing commits nothing
                self._append_nothing(table, properties)
        self._committed(token)
        return True

    def _committed(self, token: Mapping[str, Any] | None) -> None:
        self.commits += 1
        if token is not None:
            self._token_committed_at = time.monotonic()

    def _append_nothing(self, table: DeltaTable, properties: CommitProperties) -> None:
        write_deltalake(table, self._table_schema.empty_table(), mode="append",
                        commit_properties=properties)

    def _merge(
        self, table: DeltaTable, source: pa.Table, cleared: bool, properties: CommitProperties
    ) -> None:
        columns = {name: f"s.`{name}`" for name in self._table_schema.names}
        merger = (
            table.merge(source, f"t.`{KEY}` = s.`{KEY}`", source_alias="s", target_alias="t",
                        commit_properties=properties)
            .when_matched_delete(f"s.`{OP}` = 'delete'")
            .when_matched_update(updates=columns, predicate=f"s.`{OP}` = 'upsert'")
            .when_not_matched_insert(updates=columns, predicate=f"s.`{OP}` = 'upsert'")
        )
        if cleared:
            merger = merger.when_not_matched_by_source_delete()
        merger.execute()
