"""A resnapshot into the Delta table: drop the keys the new copy did not bring.

After a lost history (``on_history_lost="resnapshot"``) the collection is
copied again between a ``snapshotStart`` and a ``snapshotEnd`` record. The
copy's records are upserts like any change; the documents deleted while the
history was lost are simply absent from it. So the sink notes, in the commit
of ``snapshotStart``, the first ``_seq`` any later commit can have
(``resnapshot_from``); compaction waits (it would renumber rows to ``_seq``
0); and in the commit of ``snapshotEnd`` it appends a delete for every key
whose newest row is older than that mark. Each step is one commit with its
token, so a kill anywhere repeats at most the step it interrupted: the copy
continues from its stored position and ``snapshotEnd`` comes again until the
deletes are committed, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from ._delta_layout import DELETE, KEY, OP, SEQ, UPSERT, latest

__all__ = ["END", "START", "boundary", "interrupted", "stale_deletes"]

START: Final = "snapshotStart"
END: Final = "snapshotEnd"


def boundary(change: Mapping[str, Any]) -> Literal["snapshotStart", "snapshotEnd"] | None:
    """Is ``change`` a resnapshot's start or end record (else ``None``)?"""
    operation = change.get("operationType") if isinstance(change, Mapping) else None
    if operation == START:
        return START
    if operation == END:
        return END
    return None


def interrupted(change: Mapping[str, Any]) -> bool:
    """A ``snapshotEnd`` after a drop or rename cut the copy short (keep the rows)."""
    info = change.get("snapshot")
    return isinstance(info, Mapping) and bool(info.get("interrupted"))


def stale_deletes(table: DeltaTable, since: int, schema: pa.Schema) -> pa.Table:
    """Delete rows (``_key``, ``_op``, null data) for each live key whose newest row has
    ``_seq < since``: the copy that started at ``since`` did not bring it again.

    Reads only ``_key``, ``_seq`` and ``_op``, vectorised.
    """
    rows = latest(table.to_pyarrow_dataset().to_table(columns=[KEY, SEQ, OP]))
    if rows.num_rows:
        rows = rows.filter(pc.and_(pc.less(rows.column(SEQ), since),
                                   pc.equal(rows.column(OP), UPSERT)))
    keys = rows.column(KEY).combine_chunks() if rows.num_rows else pa.array([], pa.string())
    columns: dict[str, pa.Array] = {
        KEY: keys, OP: pa.array([DELETE] * len(keys), pa.string()),
    }
    for field in schema:
        if field.name not in (KEY, SEQ, OP):
            columns[field.name] = pa.nulls(len(keys), field.type)
    return pa.table(columns)
