"""Schema drift of a typed Delta sink: rescue what does not fit, or evolve the columns.

With a schema (``DeltaSink(schema=...)``, ``mirror --schema``) documents are
stored as typed columns. Documents drift: a string in an int column, an
``_id`` of another type, a new field, a new key inside a struct. What then
(``docs/mirror.md``, "Schemas that drift"):

* ``on_mismatch="fail"`` (the default): the batch fails with one error naming
  the field, and nothing is written (fields outside the schema are not stored);
* ``on_mismatch="rescue"``: a value that does not fit its column (wholly: a
  top-level field whose value, at any depth, would lose something) and every
  field outside the schema go to the row's ``_rescued`` column, one JSON
  object of those fields (null when nothing was rescued). The columns, the
  ``_key`` and ``_rescued`` give back the whole document; nothing stops;
* ``evolve=True``: a new top-level field becomes a new column (Delta schema
  evolution, ``schema_mode="merge"``) typed from its values: boolean, long,
  double, string or timestamp; nested or mixed values as a JSON string.
  delta-rs cannot change a column's type (Delta's type widening), so a value
  that does not fit an existing column is still a mismatch.

Loosely after Auto Loader's rescued-data column and Delta's schema evolution.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import pyarrow as pa
from bson import json_util
from bson.int64 import Int64

__all__ = ["RESCUED", "Drift", "RescuedCounts"]

RESCUED = "_rescued"
"""The column of what did not fit: a JSON object of the row's rescued fields, or null."""

_TIME = pa.timestamp("us", tz="UTC")

Cell = Callable[[Any, pa.DataType, json_util.JSONOptions], Any]
"""A BSON value as pyarrow takes it for a column of that type (raises if it does not fit)."""
Misfit = Callable[[pa.Field, str, str, BaseException], Exception]
"""The error of a value that does not fit (field, the row's key, the value as JSON, the cause)."""


def _loses_nothing(value: Any, type_: pa.DataType) -> bool:
    """Would ``value`` keep every key in a column of ``type_``? (pyarrow drops a struct's unknown keys)."""
    if value is None:
        return True
    if pa.types.is_struct(type_):
        if not isinstance(value, Mapping):
            return False
        names = {type_.field(i).name: type_.field(i).type for i in range(type_.num_fields)}
        return all(k in names and _loses_nothing(v, names[k]) for k, v in value.items())
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return isinstance(value, list) and all(
            _loses_nothing(v, type_.value_type) for v in value)
    return True


def _new_type(values: Sequence[Any]) -> pa.DataType | None:
    """The column type of a new field from its values (``None``: only nulls so far)."""
    kinds: set[type] = set()
    for value in values:
        if value is None:
            continue
        if isinstance(value, bool):
            kinds.add(bool)
        elif isinstance(value, (int, Int64)):
            kinds.add(int if -(2**63) <= value < 2**63 else str)
        elif isinstance(value, float):
            kinds.add(float)
        elif isinstance(value, datetime.datetime):
            kinds.add(datetime.datetime)
        else:  # strings, ObjectIds, documents, arrays, decimals, ...: a JSON string
            kinds.add(str)
    if not kinds:
        return None
    if kinds == {int, float}:
        return pa.float64()
    if len(kinds) > 1:
        return pa.string()
    kind = kinds.pop()
    return {bool: pa.bool_(), int: pa.int64(), float: pa.float64(),
            datetime.datetime: _TIME}.get(kind, pa.string())


@dataclasses.dataclass
class Drift:
    """What a typed sink does with documents that do not fit; it owns the growing schema."""

    schema: pa.Schema
    """The data columns now: the user's, ``_rescued`` (under rescue), then evolved ones."""
    on_mismatch: Literal["fail", "rescue"]
    evolve: bool
    cell: Cell
    misfit: Misfit
    rescued: int = 0
    """Values put into ``_rescued`` (fields) in committed batches, by this sink object."""
    pending: int = 0
    """Values rescued in the batch being committed (added to :attr:`rescued` once it is)."""

    def __post_init__(self) -> None:
        if self.on_mismatch not in ("fail", "rescue"):
            raise ValueError(f"on_mismatch must be 'fail' or 'rescue', not {self.on_mismatch!r}")
        if not isinstance(self.evolve, bool):
            raise ValueError(f"evolve must be True or False, not {self.evolve!r}")
        if self.on_mismatch == "rescue" and RESCUED in self.schema.names:
            raise ValueError(f"schema must not have a column named {RESCUED!r} (the sink's own)")
        if self.rescue:
            self.schema = self.schema.append(pa.field(RESCUED, pa.string()))
        self._given = self.schema.names
        """The columns given (and ``_rescued``): an evolved table starts with them."""

    @property
    def rescue(self) -> bool:
        return self.on_mismatch == "rescue"

    def columns(
        self,
        keys: Sequence[str],
        documents: Sequence[Mapping[str, Any] | None],
        json_options: json_util.JSONOptions,
        *,
        count: bool = True,
    ) -> dict[str, pa.Array]:
        """The data columns of these documents (``None``: deleted), ``_rescued`` included.

        Under ``evolve`` new fields first become columns (the schema grows);
        ``count``: these are the batch's (:attr:`pending`), not a copy's (the history's).
        """
        if self.evolve:
            self._grow(documents)
        names = set(self.schema.names)
        rescued: list[dict[str, Any] | None] = [None] * len(documents)
        columns: dict[str, pa.Array] = {}
        for field in self.schema:
            if field.name == RESCUED:
                continue
            values = []
            for row, (key, document) in enumerate(zip(keys, documents, strict=True)):
                value = None if document is None else document.get(field.name)
                try:
                    cell = self.cell(value, field.type, json_options)
                    if cell is not None:
                        pa.array([cell], field.type)
                    if self.rescue and not _loses_nothing(value, field.type):
                        raise ValueError("a key inside it is not in the column's type")
                except (TypeError, ValueError, OverflowError, pa.ArrowException) as exc:
                    if not self.rescue:
                        raise self.misfit(field, key, json_util.dumps(value), exc) from exc
                    cell = None
                    rescued[row] = {**(rescued[row] or {}), field.name: value}
                values.append(cell)
            columns[field.name] = pa.array(values, field.type)
        if self.rescue:
            for row, document in enumerate(documents):
                if document is None:
                    continue
                extra = {k: v for k, v in document.items() if k not in names and k != "_id"}
                if extra:
                    rescued[row] = {**(rescued[row] or {}), **extra}
            if count:
                self.pending = sum(len(r) for r in rescued if r)
            columns[RESCUED] = pa.array(
                [None if r is None else json_util.dumps(r, json_options=json_options)
                 for r in rescued], pa.string())
        return {name: columns[name] for name in self.schema.names if name in columns}

    def _grow(self, documents: Sequence[Mapping[str, Any] | None]) -> None:
        """New top-level fields of ``documents`` as new columns, in the order first seen."""
        known = set(self.schema.names)
        seen: dict[str, list[Any]] = {}
        for document in documents:
            if document is None:
                continue
            for name, value in document.items():
                if name not in known:
                    seen.setdefault(name, []).append(value)
        for name, values in seen.items():
            type_ = _new_type(values)
            if type_ is not None:
                self.schema = self.schema.append(pa.field(name, type_))

    def adopt(self, table_data: pa.Schema) -> bool:
        """Take the table's columns when they are the given ones plus evolved ones (a restart)."""
        if not self.evolve or table_data.names[:len(self._given)] != self._given:
            return False
        grown = [field for field in self.schema if field.name not in table_data.names]
        self.schema = pa.schema([*table_data, *grown])
        return True


class RescuedCounts:
    """An ``on_stats`` callback that adds the sink's rescued values to each report, then passes it on.

    :class:`~changestream.ConsumeStats` counters start at 0 in each ``consume``
    run (``run_id``); the sink's count lives as long as the sink, so each run
    reports what was rescued since its first report.
    """

    def __init__(self, callback: Callable[[Any], object], read: Callable[[], int]) -> None:
        self._callback = callback
        self._read = read
        self._start: dict[str, int] = {}
        self._ended = read()
        """The count when the last run ended (or this callback was made): the next run's 0."""
        self._lock = threading.Lock()

    def __call__(self, stats: Any) -> object:
        now = self._read()
        with self._lock:
            start = self._start.setdefault(stats.run_id, self._ended)
            if stats.final:
                del self._start[stats.run_id]
                self._ended = now
        return self._callback(dataclasses.replace(stats, rescued=now - start))
