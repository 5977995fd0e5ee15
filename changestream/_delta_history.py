"""The history table beside the Delta sink's current state: every change, SCD type 2.

One row per change, in token order (``docs/mirror.md``, "History"):
``_key``, ``_seq`` (the total order: ``(v + 1) * 2**32 + i`` for the ``i``-th
change of batch ``v``), ``_op`` (``"upsert"``: the row holds the document
after the change; ``"delete"``: the key is gone), ``_operation`` (what
happened: ``snapshot``, ``insert``, ``update``, ``replace``, ``delete``,
``drop``, ...), ``_cluster_time`` and ``_token`` (the change's), ``valid_from``
(its cluster time), then the data columns of the current-state table.

``valid_to`` is *not stored*: it is the key's next row's ``valid_from``
(:data:`HISTORY_SQL`, a window query), null while the row is current.
Storing it would mean rewriting, for every change, the data file holding
the key's previous row: in a copy-on-write table without deletion vectors
(delta-rs writes none) that is an old file for an old document, so a batch
would cost more as the table grows. Appending only keeps a batch's cost
constant (``benchmarks/delta_history_bench.py`` measures both).

Exactly once with the current-state table: batch ``v`` is committed here
first, with the txn ``(app id, v)``, then in the current-state table with
the same txn; the current-state table's token is the position. A process
killed between the two commits leaves batch ``v`` here only; the batch that
replaces it after the restart (the changes after the current table's token,
cut anew) *replaces* those rows in one commit (an overwrite whose predicate
is ``_seq >= (v + 1) * 2**32``), so no change is kept twice or lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from bson import json_util
from bson.timestamp import Timestamp
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from ._delta_layout import DELETE, KEY, OP, REOPEN_EVERY, SEQ, SEQ_SHIFT, UPSERT
from ._delta_recopy import END
from ._merge import CLEARS, change_effect, change_order, key_json
from ._snapshot import SNAPSHOT_MARK

__all__ = ["AS_OF_SQL", "HISTORY_SQL", "HistoryTable", "as_of", "history_schema", "with_valid_to"]

OPERATION = "_operation"
CLUSTER_TIME = "_cluster_time"
TOKEN = "_token"
VALID_FROM = "valid_from"
VALID_TO = "valid_to"

_TIME = pa.timestamp("us", tz="UTC")
_TOKEN_JSON = json_util.CANONICAL_JSON_OPTIONS

HISTORY_SQL = (
    "SELECT *, lead(valid_from) OVER (PARTITION BY _key ORDER BY _seq) AS valid_to FROM {table}"
)
"""Every version with its ``valid_to`` (null while current): DuckDB, Spark SQL, Trino, ..."""

AS_OF_SQL = (
    "SELECT * FROM (" + HISTORY_SQL + ") WHERE _op = 'upsert' AND valid_from <= {time} "
    "AND (valid_to IS NULL OR valid_to > {time})"
)
"""The collection as it was at ``{time}`` (a timestamp literal of the engine): one row per document."""


def history_schema(data: pa.Schema) -> pa.Schema:
    """The history table's columns: the bookkeeping ones first (Delta's statistics cover them)."""
    return pa.schema([
        pa.field(KEY, pa.string()), pa.field(SEQ, pa.int64()), pa.field(OP, pa.string()),
        pa.field(OPERATION, pa.string()), pa.field(CLUSTER_TIME, _TIME),
        pa.field(TOKEN, pa.string()), pa.field(VALID_FROM, _TIME), *data,
    ])


def _time(change: Mapping[str, Any]) -> datetime | None:
    """The change's cluster time (a snapshot record's: the copy's read time), to the second."""
    value = change.get("clusterTime")
    if not isinstance(value, Timestamp):
        token = change.get("_id")
        value = token.get("at") if isinstance(token, Mapping) else None
    if isinstance(value, Timestamp):
        return datetime.fromtimestamp(value.time, timezone.utc)
    return None


def _is_snapshot(change: Mapping[str, Any]) -> bool:
    token = change.get("_id")
    return isinstance(token, Mapping) and token.get("_data") == SNAPSHOT_MARK


DataColumns = Callable[[list[str], list[Mapping[str, Any] | None]], pa.Table]
"""The data columns of documents (``None``: a deleted key), as the current-state table has them."""


class HistoryTable:
    """One Delta table of every change of one collection, written by one :class:`DeltaSink`."""

    def __init__(
        self,
        path: str,
        *,
        app_id: str,
        full_document: str | None,
        json_options: json_util.JSONOptions,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.app_id = app_id
        self.full_document = full_document
        self.json_options = json_options
        self.storage_options = storage_options
        self.rows_written = 0
        """History rows committed by this object (replaced ones included)."""
        self._table: DeltaTable | None = None
        self._opened_at = 0

    def table(self) -> DeltaTable | None:
        """The table at its latest version (``None``: not made yet); kept open between
        batches and opened anew every ``REOPEN_EVERY`` versions, as the sink's."""
        if self._table is not None:
            self._table.update_incremental()
            if self._table.version() - self._opened_at < REOPEN_EVERY:
                return self._table
            self._table = None
        if not DeltaTable.is_deltatable(self.path, self.storage_options):
            return None
        table = DeltaTable(self.path, storage_options=self.storage_options)
        self._table, self._opened_at = table, table.version()
        return table

    @property
    def applied_version(self) -> int | None:
        """The last batch version committed here (``None``: none)."""
        table = self.table()
        return None if table is None else table.transaction_version(self.app_id)

    def rows(
        self,
        changes: Sequence[Mapping[str, Any]],
        version: int,
        data: DataColumns,
        live: Callable[[], Iterable[str]],
        *,
        stale: Sequence[str] = (),
    ) -> pa.Table:
        """The batch's history rows, in token order (``live``: the keys present before it).

        ``stale``: the keys a recopy's ``snapshotEnd`` record deletes (the copy did not
        bring them again: deleted while the history was lost); a ``delete`` row each, at
        that record.
        """
        ordered = [change for _, change in sorted(
            ((change_order(change, i), change) for i, change in enumerate(changes)),
            key=lambda pair: pair[0])]
        keys: list[str] = []
        ops: list[str] = []
        operations: list[str] = []
        times: list[datetime | None] = []
        tokens: list[str] = []
        documents: list[Mapping[str, Any] | None] = []
        present: set[str] | None = None  # the keys live so far (read only for a drop)
        touched: dict[str, bool] = {}  # key -> present after this batch's rows so far

        def add(key: str, op: str, operation: str, change: Mapping[str, Any],
                document: Mapping[str, Any] | None) -> None:
            keys.append(key)
            ops.append(op)
            operations.append(operation)
            times.append(_time(change))
            tokens.append(json_util.dumps(change["_id"], json_options=_TOKEN_JSON,
                                          separators=(",", ":")))
            documents.append(document)
            touched[key] = op == UPSERT

        for change in ordered:
            operation = change.get("operationType")
            if operation in CLEARS:  # every document still present ends here
                if present is None:
                    present = set(live())
                alive = {k for k in present if touched.get(k, True)}
                alive |= {k for k, up in touched.items() if up}
                for key in sorted(alive):
                    add(key, DELETE, str(operation), change, None)
                continue
            if operation == END:
                for key in stale:
                    add(key, DELETE, END, change, None)
                continue
            document_key = change.get("documentKey")
            if not isinstance(document_key, Mapping) or "_id" not in document_key:
                continue  # DDL and other events of no document
            key = key_json(document_key["_id"], self.json_options)
            op, document = change_effect(key, change, self.full_document)
            add(key, op, "snapshot" if _is_snapshot(change) else str(operation), change,
                document)
        first = (version + 1) << SEQ_SHIFT
        seq = pa.array(range(first, first + len(keys)), pa.int64())
        columns = data(keys, documents)
        head = [pa.array(keys, pa.string()), seq, pa.array(ops, pa.string()),
                pa.array(operations, pa.string()), pa.array(times, _TIME),
                pa.array(tokens, pa.string()), pa.array(times, _TIME)]
        schema = history_schema(columns.schema)
        return pa.Table.from_arrays(head + list(columns.columns), schema=schema)

    def write(self, rows: pa.Table, version: int, token: str | None) -> None:
        """Commit batch ``version``'s rows; a batch this table already holds is replaced.

        Only a batch the current-state table does not hold comes here, so a
        version held here is an orphan of a crash between the two commits.
        """
        metadata = {"changestream.app_id": self.app_id, "changestream.version": str(version)}
        if token is not None:
            metadata["changestream.token"] = token
        properties = CommitProperties(custom_metadata=metadata,
                                      app_transactions=[Transaction(self.app_id, version)])
        table = self.table()
        if table is None:
            DeltaTable.create(self.path, rows.schema, storage_options=self.storage_options,
                              commit_properties=CommitProperties(
                                  custom_metadata={"changestream.app_id": self.app_id}))
            table = self.table()
            assert table is not None
        held = table.transaction_version(self.app_id)
        if held is not None and held >= version:
            write_deltalake(table, rows, mode="overwrite",
                            predicate=f"{SEQ} >= {(version + 1) << SEQ_SHIFT}",
                            schema_mode="merge", commit_properties=properties,
                            storage_options=self.storage_options)
        else:
            write_deltalake(table, rows, mode="append", schema_mode="merge",
                            commit_properties=properties, storage_options=self.storage_options)
        self.rows_written += rows.num_rows

    def read(self) -> pa.Table:
        """Every row with its ``valid_to``, by ``_key`` then ``_seq``."""
        table = self.table()
        if table is None:
            raise FileNotFoundError(f"no history table at {self.path} yet")
        return with_valid_to(table.to_pyarrow_table())


def with_valid_to(rows: pa.Table) -> pa.Table:
    """``rows`` sorted by ``_key``, ``_seq`` with ``valid_to``: the key's next ``valid_from``."""
    rows = rows.sort_by([(KEY, "ascending"), (SEQ, "ascending")])
    n = rows.num_rows
    if n == 0:
        return rows.append_column(VALID_TO, pa.array([], _TIME))
    keys = rows.column(KEY).combine_chunks()
    starts = rows.column(VALID_FROM).combine_chunks()
    same = pc.equal(keys.slice(1), keys.slice(0, n - 1)).fill_null(False)
    nxt = pc.if_else(same, starts.slice(1), pa.nulls(n - 1, starts.type))
    return rows.append_column(VALID_TO, pa.concat_arrays([nxt, pa.nulls(1, starts.type)]))


def as_of(history: pa.Table, time: datetime) -> pa.Table:
    """The collection at ``time`` (after every change of cluster time <= ``time``), by ``_key``.

    ``history`` is :func:`with_valid_to`'s; the same as :data:`AS_OF_SQL`.
    """
    if time.tzinfo is None:
        raise ValueError("as_of: give an aware datetime (UTC), not a naive one")
    at = pa.scalar(time.astimezone(timezone.utc), _TIME)
    starts, ends = history.column(VALID_FROM), history.column(VALID_TO)
    keep = pc.and_(pc.and_(pc.equal(history.column(OP), UPSERT), pc.less_equal(starts, at)),
                   pc.or_kleene(pc.is_null(ends), pc.greater(ends, at)))
    return history.filter(keep.fill_null(False))
