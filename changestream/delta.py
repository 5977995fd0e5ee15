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
staged changes with the token; ``load`` reads the token back from the table;
``consume`` calls ``save_behind``, which commits the batch on a thread of the
sink's own while the next one is fetched, and ``flush`` before it returns).
``foreach_batch`` uses it the same way; the Spark data source's
``foreachBatch`` calls :meth:`DeltaSink.write` with Spark's batch id.
Needs the ``delta`` extra (``pip install 'changestream[delta]'``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

try:
    import deltalake  # noqa: F401  (the extra's presence, checked once with one clear error)
except ImportError as exc:
    raise ImportError(
        f"changestream.delta needs the 'delta' extra: pip install 'changestream[delta]' ({exc})"
    ) from exc

from ._delta_database import DatabaseDroppedError, DatabaseTables, table_directory
from ._delta_drift import RESCUED
from ._delta_history import AS_OF_SQL, HISTORY_SQL
from ._delta_layout import CURRENT_SQL, SEQ, Compaction
from ._delta_resnapshot import DeltaResnapshot, ResnapshotProgress
from ._delta_rows import DOCUMENT as DOCUMENT  # (the Spark writers build the same columns)
from ._delta_rows import KEY, OP, DeltaSinkError, DocumentSchemaError, json_worker_for, merge_table
from ._delta_rows import document_columns as document_columns
from ._delta_rows import struct_columns as struct_columns
from ._delta_schema import SchemaTextError
from ._delta_sink import DeltaSink
from ._delta_sizes import BATCH_BYTES, BATCH_CHANGES, BATCH_SECONDS
from ._delta_verify import Verification
from ._json_worker import JsonWorker
from ._parallel_copy import parallel_copy

__all__ = [
    "AS_OF_SQL", "BATCH_BYTES", "BATCH_CHANGES", "BATCH_SECONDS", "CURRENT_SQL", "HISTORY_SQL",
    "KEY", "OP", "RESCUED", "SEQ", "Compaction",
    "DatabaseDroppedError", "DatabaseSink", "DeltaResnapshot", "DeltaSink", "DeltaSinkError",
    "DocumentSchemaError", "JsonWorker", "ResnapshotProgress", "SchemaTextError", "Verification",
    "merge_table", "parallel_copy", "table_path",
]


class DatabaseSink(DatabaseTables):
    """A whole database, one :class:`DeltaSink` table per collection under ``path/<collection>``.

    Both handler and token store of :func:`changestream.consume`, with
    :meth:`open_stream` as its first argument: one change stream on
    ``database`` serves every table, and each table keeps its own position
    (exactly once on its own, as a :class:`DeltaSink`). Collections without a
    table are copied (a consistent snapshot) while the stream goes on; a
    ``drop`` empties a table; a ``rename`` empties the source's table and
    starts the target's from a copy. ``include(name)`` picks the collections
    (default: all but ``system.*``); the other keyword arguments are each
    table's :class:`DeltaSink`'s (the tables share one :class:`JsonWorker`). See
    ``docs/mirror.md``, "A whole database".
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        database: Any,
        *,
        app_id: str = "changestream",
        include: Any = None,
        full_document: str | None = None,
        copy_batch_size: int = 10_000,
        watch_options: Mapping[str, Any] | None = None,
        **sink_options: Any,
    ) -> None:
        if "://" in os.fspath(path):
            raise ValueError(f"DatabaseSink: {os.fspath(path)!r} is a URI; a whole database is "
                             "mirrored into a local directory (its tables are found by listing "
                             "it): give one DeltaSink per collection for an object store")
        if sink_options.get("history") is not None:
            raise ValueError("DatabaseSink: history= would be one history table for every "
                             "collection; keep history with a DeltaSink per collection")
        sink_options["json_worker"] = json_worker_for(sink_options.get("json_worker"))  # shared
        DeltaSink(os.path.join(os.fspath(path), "_"), app_id=app_id, full_document=full_document,
                  **sink_options)  # the options' mistakes, named before anything is read
        self.app_id = app_id

        def sink_for(table_path: str) -> DeltaSink:
            return DeltaSink(table_path, app_id=app_id, full_document=full_document,
                             **sink_options)

        options = dict(watch_options or {})
        if full_document is not None:
            options.setdefault("full_document", full_document)
        super().__init__(path, database, sink_for, include=include,
                         watch_options=options, copy_batch_size=copy_batch_size)

    def table_path(self, collection: str) -> str:
        """Where ``collection``'s table is (``path/<collection>``, a few characters escaped)."""
        return table_path(self.path, collection)


def table_path(path: str | os.PathLike[str], collection: str) -> str:
    """The table of ``collection`` in a database mirror at ``path``: ``path/<collection>``.

    The name as it is, except ``/``, ``\\``, ``%`` and a leading ``.``, %-escaped.
    """
    return os.path.join(os.fspath(path), table_directory(collection))
