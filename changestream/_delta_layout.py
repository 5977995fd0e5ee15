"""The Delta table's layout: a key-clustered base plus an append-only change log, compacted.

A merge into a copy-on-write table rewrites every file holding a matched
row, so its cost grows with the table. Instead (``docs/mirror.md``, "The
table's layout", says it for users and for other writers):

* every row carries ``_key`` (the ``_id`` as compact relaxed Extended JSON),
  ``_seq`` (int64) and ``_op`` (``"upsert"`` or ``"delete"``), then the data
  columns;
* **base** rows have ``_seq = 0`` and ``_op = "upsert"``: at most one per
  key, in files sorted by ``_key`` (the first load writes them, and so does
  compaction);
* each batch of changes is **appended** as log rows, one per key (the
  batch's last change of it), with ``_seq = (v + 1) * 2**32 + i``: ``v`` the
  table version the batch was planned on, ``i`` the row's index. A key's row
  with the highest ``_seq`` is its current state; ``"delete"``: gone;
* **compaction** (its own commit, no logical change) folds every log row
  into the base: it rewrites only the base files whose ``_key`` range holds
  a logged key (min/max statistics), into sorted files of bounded size, and
  removes the log files. It runs when the log reaches a fraction of the base
  rows it would rewrite, so each change pays a constant share of rewriting
  (LSM-style), once the log holds ``min_log_rows`` (a compaction's fixed cost
  is then a small share of it), and at most ``max_log_rows`` log rows are ever held.

So a batch costs an append whatever the table's size, and the rewrite per
change is bounded. After a full compaction the table holds only base rows:
the collection's current state.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, write_deltalake

__all__ = [
    "CURRENT_SQL", "DELETE", "FILE_ROWS", "KEY", "LOG_ROW_GROUP", "OP", "REOPEN_EVERY", "SEQ",
    "UPSERT", "Compaction", "LogSize", "ascending", "by_key", "compact", "current_state",
    "file_bytes", "latest", "layout_schema", "log_size", "merge_small", "with_seq",
]

KEY = "_key"
SEQ = "_seq"
OP = "_op"
UPSERT = "upsert"
DELETE = "delete"
SEQ_SHIFT = 32
"""``_seq = (v + 1) << SEQ_SHIFT | i``: room for 4 billion rows per batch."""

CURRENT_SQL = (
    "SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY _key ORDER BY _seq DESC) AS _n "
    "FROM {table}) WHERE _n = 1 AND _op = 'upsert'"
)
"""The collection's current state from the table at any time (DuckDB, Spark SQL, ...)."""


def layout_schema(data: pa.Schema) -> pa.Schema:
    """The table's columns: ``_key``, ``_seq``, ``_op``, then the data columns.

    The bookkeeping columns come first so that Delta's statistics (the first
    32 columns by default) always cover them.
    """
    return pa.schema([pa.field(KEY, pa.string()), pa.field(SEQ, pa.int64()),
                      pa.field(OP, pa.string()), *data])


FILE_ROWS = 65_536
"""Rows of a base file as compaction and a first load's merge write them (about): a
compaction rewrites every file that holds a logged key, whole (``docs/mirror.md``)."""
LOG_ROW_GROUP = 2048
"""Rows per Parquet row group of a log file: compaction reads a key range of the log by
the row groups' ``_key`` statistics (log files are written sorted by ``_key``)."""

REOPEN_EVERY = 100
"""Versions after which the table is opened anew: delta-rs replays, on every write, each
commit since the version a ``DeltaTable`` was opened at (not since the newest checkpoint),
so a long-lived object made each commit cost more (23 -> 142 ms per commit over 1,200
commits); opened anew it starts from the checkpoint delta-rs writes every 100 versions.
"""


def with_seq(rows: pa.Table, schema: pa.Schema, first_seq: int) -> pa.Table:
    """``rows`` (``_key``, ``_op``, data columns) as ``schema``'s, numbered from ``first_seq``.

    Log rows come out sorted by ``_key`` (one row per key: the numbers keep their batch's
    order); ``first_seq`` 0 makes base rows (all ``_seq`` 0: a first load, sorted by the caller).
    """
    count = rows.num_rows
    if first_seq == 0:
        seq = pa.array([0] * count, pa.int64()) if count else pa.array([], pa.int64())
    else:
        seq = pc.add(pa.array(range(count), pa.int64()), pa.scalar(first_seq, pa.int64()))
    columns = [rows.column(KEY), seq, rows.column(OP)]
    columns += [rows.column(name) for name in schema.names[3:]]
    table = pa.Table.from_arrays(columns, schema=schema)
    return table if first_seq == 0 else table.sort_by(KEY)


def first_seq(version: int) -> int:
    """The first ``_seq`` of a batch planned on table version ``version``."""
    return (version + 1) << SEQ_SHIFT


# -- what the table holds -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _File:
    path: str
    rows: int
    size: int
    min_key: str | None
    max_key: str | None
    base: bool
    """Only base rows (``_seq`` 0), by its statistics."""


def _files(table: DeltaTable) -> list[_File]:
    actions = pa.table(table.get_add_actions(flatten=True))
    names = set(actions.column_names)
    n = actions.num_rows

    def column(name: str) -> list[Any]:
        return actions.column(name).to_pylist() if name in names else [None] * n

    paths, rows, sizes = column("path"), column("num_records"), column("size_bytes")
    min_key, max_key = column(f"min.{KEY}"), column(f"max.{KEY}")
    max_seq = column(f"max.{SEQ}")
    files = []
    for i in range(n):
        known = min_key[i] is not None and max_key[i] is not None and rows[i] is not None
        files.append(_File(paths[i], rows[i] or 0, sizes[i] or 0, min_key[i], max_key[i],
                           known and max_seq[i] == 0))
    return files


@dataclasses.dataclass(frozen=True)
class LogSize:
    """How much a compaction would do now (from file statistics; nothing read)."""

    log_rows: int
    """Log rows (``_seq`` > 0) in the table."""
    touched_rows: int
    """Base rows in files whose key range overlaps a log file's (an upper bound of the rewrite)."""

    def due(self, fraction: float, min_rows: int, max_rows: int, *, waited: bool = False
            ) -> bool:
        """Is a compaction due: ``max_rows`` log rows, or ``min_rows`` and ``fraction`` of the
        base rows it would rewrite (below ``min_rows`` its fixed cost, the table's listing,
        dataset and commit, ~0.1 s, is most of a compaction's time)?

        ``waited``: the stream waits for the commit the compaction would follow (the end of
        a backlog, or a sink slower than its stream). It is put off until twice the log
        (``2 * min_rows``, ``2 * fraction``; ``max_rows`` still holds), so a run's end pays
        one compaction (``finish()``'s), not two back to back, and a stream never waits for
        more than one batch's worth of put-off rewriting: the next commit, or ``finish()``,
        makes it."""
        rows = self.log_rows
        twice = 2 if waited else 1
        return rows > 0 and (rows >= max_rows or (
            rows >= twice * min_rows and rows >= twice * fraction * self.touched_rows))


def log_size(table: DeltaTable) -> LogSize:
    files = _files(table)
    log = [f for f in files if not f.base]
    if not log:
        return LogSize(0, 0)
    if any(f.min_key is None for f in log):  # no statistics: assume every base file
        return LogSize(sum(f.rows for f in log), sum(f.rows for f in files if f.base))
    spans = _union((f.min_key, f.max_key) for f in log)
    highs = [high for _, high in spans]
    touched = 0
    for f in files:
        if f.base and _overlaps(spans, highs, f.min_key, f.max_key):  # type: ignore[arg-type]
            touched += f.rows
    return LogSize(sum(f.rows for f in log), touched)


def _union(spans: Any) -> list[tuple[str, str]]:
    merged: list[tuple[str, str]] = []
    for low, high in sorted(spans):
        if merged and low <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
        else:
            merged.append((low, high))
    return merged


def _overlaps(spans: list[tuple[str, str]], highs: list[str], low: str, high: str) -> bool:
    """Does [low, high] meet one of the disjoint, sorted ``spans`` (``highs``: their ends)?"""
    at = bisect.bisect_left(highs, low)  # the first span ending at or after ``low``
    return at < len(spans) and spans[at][0] <= high


# -- reading the current state ----------------------------------------------------------------
def latest(rows: pa.Table) -> pa.Table:
    """The row with the highest ``_seq`` of each key, sorted by ``_key`` (its newest version).

    Sorted as indices of the two columns, and the rows taken once, only those kept: a
    sort of the whole rows then a filter copied the documents twice (half the time)."""
    if rows.num_rows == 0:
        return rows
    order = pc.sort_indices(rows.select([KEY, SEQ]),
                            sort_keys=[(KEY, "ascending"), (SEQ, "descending")])
    keys = pc.take(rows.column(KEY), order)
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    if len(keys) == 1:
        return rows.take(order)
    changed = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1))
    first = pa.concat_arrays([pa.array([True]), changed.fill_null(True)])
    return rows.take(order.filter(first))


def current_state(table: DeltaTable) -> pa.Table:
    """The collection's current state as Arrow: ``_key`` and the data columns, by ``_key``."""
    dataset = table.to_pyarrow_dataset()
    log = latest(dataset.to_table(filter=pc.field(SEQ) > 0))
    base = dataset.to_table(filter=pc.field(SEQ) == 0)
    if log.num_rows:
        base = base.filter(pc.invert(pc.is_in(base.column(KEY), value_set=log.column(KEY))))
        log = log.filter(pc.equal(log.column(OP), UPSERT))
        base = pa.concat_tables([base, log.cast(base.schema)])
    return by_key(base).drop_columns([SEQ, OP])


_MAX_BYTES = 2**31 - 1
"""What a ``string``/``binary`` array's 32-bit offsets reach."""


def by_key(rows: pa.Table) -> pa.Table:
    """``rows`` sorted by ``_key``, whatever their size.

    Arrow's ``take`` joins a column's chunks into one array first, and a string column of
    more than 2 GiB overflows its 32-bit offsets (a 10M-row table of 240-byte documents):
    such columns are taken as ``large_string``/``large_binary``, then cut back to their own
    type in slices that fit.
    """
    order = pc.sort_indices(rows, sort_keys=[(KEY, "ascending")])
    wide = [i for i, field in enumerate(rows.schema)
            if (pa.types.is_string(field.type) or pa.types.is_binary(field.type))
            and rows.column(i).nbytes > _MAX_BYTES]
    if not wide:
        return rows.take(order)
    narrow = rows.schema
    widened = rows
    for i in wide:
        large = pa.large_string() if pa.types.is_string(narrow.field(i).type) else pa.large_binary()
        widened = widened.set_column(i, narrow.field(i).with_type(large),
                                     widened.column(i).cast(large))
    taken = widened.take(order)
    for i in wide:
        column = taken.column(i).combine_chunks()
        step = max(1, len(column) * (_MAX_BYTES // 2) // max(1, column.nbytes))
        taken = taken.set_column(i, narrow.field(i), pa.chunked_array(
            [pa.concat_arrays([column.slice(at, step)]).cast(narrow.field(i).type)  # compacted:
             # a slice's offsets still count from the whole buffer
             for at in range(0, len(column), step)], narrow.field(i).type))
    return taken


def ascending(keys: pa.ChunkedArray | pa.Array) -> bool:
    """Are ``keys`` in ascending order already? One vectorised comparison: the sort it
    spares copies every row (a first load's keys mostly come in order)."""
    if len(keys) < 2:
        return True
    column = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    earlier, later = column.slice(0, len(column) - 1), column.slice(1)
    return bool(pc.all(pc.less_equal(earlier, later)).as_py())


# -- compaction -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Compaction:
    """What one compaction did."""

    log_rows: int
    base_rows_read: int
    rows_written: int
    files_removed: int
    bytes_removed: int
    bytes_written: int


@dataclasses.dataclass
class _Segment:
    """A run of the key space: base files that overlap (a component) or the gap before one."""

    low: str
    high: str
    paths: list[str]
    log_from: int
    log_to: int
    rows: int = 0
    """Base rows in ``paths``."""


def _components(base: list[_File]) -> list[tuple[str, str, list[str], int]]:
    """Base files grouped where their key ranges overlap, in key order (with their rows)."""
    groups: list[tuple[str, str, list[str], int]] = []
    for f in sorted(base, key=lambda f: (f.min_key, f.max_key)):
        low, high = f.min_key, f.max_key
        assert low is not None and high is not None
        if groups and low <= groups[-1][1]:
            g_low, g_high, paths, rows = groups[-1]
            groups[-1] = (g_low, max(g_high, high), [*paths, f.path], rows + f.rows)
        else:
            groups.append((low, high, [f.path], f.rows))
    return groups


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def file_bytes(files: Sequence[_File], file_rows: int, cap: int) -> int:
    """The ``target_file_size`` that cuts files of about ``file_rows`` rows (at most ``cap``).

    delta-rs cuts the files it writes by bytes only (checked every 1,024 rows, against
    its estimate of the file so far: the files come out near ``file_rows``, not at it);
    the bytes a row takes come from ``files``. A rewrite costs whole files, so their
    rows bound what one touched key costs.
    """
    written = [f for f in files if f.rows >= 1024] or [f for f in files if f.rows]
    if not written:
        return cap
    # the best compressed: the sink's own appends (a first load's files) are uncompressed
    # (its WriterProperties name no codec), the files compaction and merges write snappy
    per_row = min(f.size / f.rows for f in written)
    return max(1, min(cap, int(per_row * file_rows)))


def compact(
    table: DeltaTable,
    schema: pa.Schema,
    properties: CommitProperties,
    *,
    target_file_size: int,
    storage_options: dict[str, str] | None = None,
    unit_rows: int = 250_000,
    file_rows: int = FILE_ROWS,
) -> Compaction | None:
    """Fold every log row into the base in one commit (``None``: there is no log).

    Reads the logged keys (one column), then rewrites only the base files
    whose key range holds a logged key, in units of neighbouring key ranges
    of about ``unit_rows`` base rows: the unit's base files and its slice of
    the log (row groups pruned by ``_key`` statistics; log files are written
    sorted by ``_key`` in small row groups), each key's latest row kept, as
    sorted files of about ``file_rows`` rows (at most ``target_file_size``
    bytes): the next compaction that touches a key rewrites its file. Memory: the logged keys
    plus one unit, whatever the table's size. The commit replaces exactly the
    log files and those base files (an overwrite whose predicate names their
    ``_seq``/``_key`` ranges), so a writer's append that lands first makes it
    conflict instead of being lost.
    """
    files = _files(table)
    log_files = [f for f in files if not f.base]
    if not log_files:
        return None
    base_files = [f for f in files if f.base]
    dataset = table.to_pyarrow_dataset()
    fragments = {fragment.path: fragment for fragment in dataset.get_fragments()}
    log = _subset(dataset, fragments, [f.path for f in log_files])
    keys = pc.unique(log.to_table(columns=[KEY]).column(KEY).combine_chunks())
    log_keys: list[str] = keys.take(pc.sort_indices(keys)).to_pylist()
    segments = _segments(_components(base_files), log_keys)
    units = _units(segments, unit_rows)
    ranges = _ranges(segments)
    predicate = " OR ".join(
        [f"{SEQ} > 0"] + [f"({KEY} >= {_quote(low)} AND {KEY} <= {_quote(high)})"
                          for low, high in ranges])
    sizes = {f.path: f for f in files}
    read = [0]

    def batches() -> Iterator[pa.RecordBatch]:
        for low, high, paths in units:
            in_range = (pc.field(KEY) >= low) & (pc.field(KEY) <= high)
            logged = latest(log.to_table(filter=in_range).select(schema.names).cast(schema))
            if paths:
                base = _subset(dataset, fragments, paths).to_table().select(schema.names).cast(schema)
                read[0] += base.num_rows
                base = base.filter(pc.invert(pc.is_in(base.column(KEY),
                                                      value_set=logged.column(KEY))))
            else:
                base = schema.empty_table()
            upserts = logged.filter(pc.equal(logged.column(OP), UPSERT))
            rows = pa.concat_tables([base, _as_base(upserts, schema)]).sort_by(KEY)
            yield from rows.to_batches(max_chunksize=65_536)

    written = _count(batches(), schema)
    write_deltalake(table, written.reader, mode="overwrite", predicate=predicate,
                    target_file_size=file_bytes(base_files or files, file_rows, target_file_size),
                    commit_properties=properties,
                    storage_options=storage_options)
    removed = log_files + [sizes[p] for _, _, paths in units for p in paths]
    table.update_incremental()
    added = sum(f.size for f in _files(table) if f.path not in sizes)
    return Compaction(log_rows=sum(f.rows for f in log_files), base_rows_read=read[0],
                      rows_written=written.rows, files_removed=len(removed),
                      bytes_removed=sum(f.size for f in removed), bytes_written=added)


def merge_small(
    table: DeltaTable,
    schema: pa.Schema,
    properties: CommitProperties,
    small_rows: int,
    min_files: int,
    unit_rows: int,
    target_file_size: int,
    storage_options: dict[str, str] | None = None,
) -> Compaction | None:
    """Merge runs of neighbouring small base files into larger ones.

    A first load appends one file per commit (``--batch`` documents), and
    delta-rs pays for every file on every later commit; this rewrites such
    runs (each at most ``unit_rows`` rows, read whole; merged once it has
    ``min_files`` files or half of ``unit_rows`` rows, so a document is merged
    once) as one sorted file each, in commits of their own that change no
    logical content. Each commit's predicate
    (``_seq = 0`` and the run's key range) matches only those files: log rows
    appended meanwhile are neither removed nor in conflict. ``None``: nothing
    to merge.
    """
    files = _files(table)
    if any(f.min_key is None for f in files):
        return None  # a file without key statistics might hold base rows inside a run's range
    base = [f for f in files if f.base]
    runs: list[list[tuple[str, str, list[str], int]]] = []
    run: list[tuple[str, str, list[str], int]] = []
    for component in _components(base):
        rows = component[3]
        if rows < small_rows and sum(c[3] for c in run) + rows <= unit_rows:
            run.append(component)
            continue
        if _ripe(run, min_files, unit_rows):
            runs.append(run)
        run = [component] if rows < small_rows else []
    if _ripe(run, min_files, unit_rows):
        runs.append(run)
    if not runs:
        return None
    dataset = table.to_pyarrow_dataset()
    fragments = {fragment.path: fragment for fragment in dataset.get_fragments()}
    sizes = {f.path: f for f in base}
    merged = 0
    for run in runs:  # a commit per run: delta-rs cuts files by bytes, a run is one file
        names = [p for c in run for p in c[2]]
        rows = _subset(dataset, fragments, names).to_table().select(schema.names)
        if not ascending(rows.column(KEY)):  # in key order: sorted files of disjoint ranges
            rows = rows.sort_by(KEY)
        merged += rows.num_rows
        write_deltalake(table, rows.cast(schema).combine_chunks(), mode="overwrite",
                        predicate=f"{SEQ} = 0 AND {KEY} >= {_quote(run[0][0])} "
                                  f"AND {KEY} <= {_quote(run[-1][1])}",
                        target_file_size=target_file_size, commit_properties=properties,
                        storage_options=storage_options)
    removed = [sizes[p] for run in runs for c in run for p in c[2]]
    table.update_incremental()
    added = sum(f.size for f in _files(table) if f.path not in sizes and f.base)
    return Compaction(log_rows=0, base_rows_read=merged, rows_written=merged,
                      files_removed=len(removed), bytes_removed=sum(f.size for f in removed),
                      bytes_written=added)


def _ripe(run: list[tuple[str, str, list[str], int]], min_files: int, unit_rows: int) -> bool:
    """A run of small files worth merging: ``min_files`` files, or two or more holding half
    of ``unit_rows`` (merged, they are no longer small: each document is merged once)."""
    return len(run) >= min_files or (len(run) > 1 and 2 * sum(c[3] for c in run) >= unit_rows)


def _units(segments: list[_Segment], unit_rows: int) -> list[tuple[str, str, list[str]]]:
    """Runs of neighbouring touched segments of about ``unit_rows`` base rows each."""
    units: list[tuple[str, str, list[str]]] = []
    rows = 0
    previous_touched = False
    for segment in segments:
        touched = segment.log_to > segment.log_from
        if touched and previous_touched and rows < unit_rows:
            low, _, paths = units[-1]
            units[-1] = (low, segment.high, paths + segment.paths)
            rows += segment.rows
        elif touched:
            units.append((segment.low, segment.high, list(segment.paths)))
            rows = segment.rows
        previous_touched = touched
    return units


def _segments(
    components: list[tuple[str, str, list[str], int]], keys: list[str]
) -> list[_Segment]:
    """Gaps and components in key order, each with the slice of sorted ``keys`` inside it."""
    segments: list[_Segment] = []
    at = 0
    for low, high, paths, rows in components:
        start = bisect.bisect_left(keys, low, at)
        if start > at:
            segments.append(_Segment(keys[at], keys[start - 1], [], at, start))
        end = bisect.bisect_right(keys, high, start)
        segments.append(_Segment(low, high, paths, start, end, rows))
        at = end
    if at < len(keys):
        segments.append(_Segment(keys[at], keys[-1], [], at, len(keys)))
    return segments


def _ranges(segments: list[_Segment]) -> list[tuple[str, str]]:
    """Key ranges covering the touched segments; neighbours merge, untouched files stay out."""
    ranges: list[tuple[str, str]] = []
    previous_touched = False
    for segment in segments:
        touched = segment.log_to > segment.log_from
        if touched and previous_touched:
            ranges[-1] = (ranges[-1][0], segment.high)
        elif touched:
            ranges.append((segment.low, segment.high))
        previous_touched = touched
    return ranges


def _subset(dataset: ds.Dataset, fragments: dict[str, Any], paths: Sequence[str]) -> ds.Dataset:
    """The named data files (paths as the Delta log has them) of the table's dataset."""
    missing = [path for path in paths if path not in fragments]
    if missing:
        raise RuntimeError(f"compaction: the data file {missing[0]} is not in the table")
    return ds.FileSystemDataset([fragments[path] for path in paths], dataset.schema,
                                dataset.format, dataset.filesystem)


def _as_base(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    seq = pa.array([0] * rows.num_rows, pa.int64()) if rows.num_rows else pa.array([], pa.int64())
    return rows.set_column(rows.schema.get_field_index(SEQ), SEQ, seq).cast(schema)


@dataclasses.dataclass
class _Counted:
    reader: pa.RecordBatchReader
    rows: int = 0


def _count(batches: Iterator[pa.RecordBatch], schema: pa.Schema) -> _Counted:
    counted = _Counted(pa.RecordBatchReader.from_batches(schema, iter(())))

    def counting() -> Iterator[pa.RecordBatch]:
        for batch in batches:
            counted.rows += batch.num_rows
            yield batch

    counted.reader = pa.RecordBatchReader.from_batches(schema, counting())
    return counted
