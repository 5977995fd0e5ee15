"""``DeltaSink.verify``: the table against the collection at one consistent point, cheaply.

Both sides become, per row, two 64-bit hashes computed vectorised (numpy over
Arrow buffers, no Python per row): one of the ``_key`` text, one of the whole
row (``_key`` and every data column). The table side is the current state
(:func:`current_batches`, streamed); the collection side is every document read
with ``readConcern: {level: "snapshot", atClusterTime: T}`` (``T`` the
table's position) in batches, converted by the sink's own converter (the
same code that writes a first load), so equal documents give equal bytes.

The key-hash space is cut into ranges of about ``RANGE_ROWS`` rows; each
range's hash is the sum of its rows' hashes, with its row count. Only ranges
whose hash or count differ are drilled into, row hash against row hash,
which gives the missing, extra and different keys and a few examples. No
document is compared as a Python object.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from bson import json_util
from bson.timestamp import Timestamp
from deltalake import DeltaTable

from ._delta_drift import Drift
from ._delta_layout import KEY, OP, SEQ, UPSERT, latest
from ._snapshot import SnapshotBatches, is_snapshot_position
from ._token import token_cluster_time
from .stores import StoredToken

__all__ = [
    "RANGE_ROWS", "Hashes", "Verification", "compare", "current_batches", "hash_rows",
    "table_hashes", "verify_at", "verify_table",
]

RANGE_ROWS = 1024
"""Rows per range of the key-hash space (a range is drilled into only if it differs)."""
HASH_ROWS = 8_192
"""Rows hashed at a time: the hash takes ~30 bytes of temporaries per byte of text, so a
batch of 65,536 orders made ~0.5 GB of them; 8,192 was also 2.5x faster (3M rows: 8.9 ->
3.5 s, the temporaries stay in the CPU's caches)."""

_U64 = np.uint64
_PRIME = _U64(0x100000001B3)
_PRIME_INVERSE = _U64(pow(0x100000001B3, -1, 1 << 64))
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_NULL = _U64(0x6A09E667F3BCC909)


def _mix(z: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """splitmix64's finaliser: every input bit reaches every output bit."""
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    mixed: np.ndarray[Any, Any] = z ^ (z >> _U64(31))
    return mixed


class _Powers:
    """``P**i`` and ``P**-i`` mod 2**64, grown as longer chunks come (per verification)."""

    def __init__(self) -> None:
        self.up = np.ones(1, _U64)
        self.down = np.ones(1, _U64)

    def need(self, n: int) -> None:
        if len(self.up) > n:
            return
        size = max(n + 1, 2 * len(self.up))
        self.up, self.down = _powers_of(_PRIME, size), _powers_of(_PRIME_INVERSE, size)


def _powers_of(base: np.uint64, size: int) -> np.ndarray[Any, Any]:
    """``base**i`` for ``i < size`` mod 2**64, by doubling (a cumprod is sequential, slow)."""
    powers = np.ones(size, _U64)
    filled, step = 1, base
    with np.errstate(over="ignore"):
        while filled < size:
            count = min(filled, size - filled)
            powers[filled:filled + count] = powers[:count] * step
            filled += count
            step = step * step
    return powers


def _string_hashes(array: pa.Array, powers: _Powers) -> np.ndarray[Any, Any]:
    """A 64-bit hash of each string (polynomial over its bytes, then mixed); nulls: one value."""
    if not pa.types.is_large_string(array.type):
        array = array.cast(pa.large_string())
    n = len(array)
    if n == 0:
        return np.zeros(0, _U64)
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], np.int64)[array.offset:array.offset + n + 1]
    start = int(offsets[0])
    total = int(offsets[-1]) - start
    relative = offsets - start
    powers.need(total)
    with np.errstate(over="ignore"):
        sums = np.zeros(total + 1, _U64)
        if total:
            data = np.frombuffer(buffers[2], np.uint8)[start:start + total].astype(_U64)
            np.cumsum(data * powers.up[:total], out=sums[1:])
        raw = (sums[relative[1:]] - sums[relative[:-1]]) * powers.down[relative[:-1]]
        lengths = (relative[1:] - relative[:-1]).astype(_U64)
        hashes = _mix(raw ^ (lengths * _GOLDEN))
    if array.null_count:
        hashes[np.asarray(array.is_null(), dtype=bool)] = _NULL
    return hashes


def _as_text(column: pa.Array) -> pa.Array:
    """Any column as strings: Arrow's cast where it has one, else JSON of each value."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column
    try:
        return pc.cast(column, pa.large_string())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return pa.array([None if value is None else json.dumps(value, sort_keys=True, default=str)
                         for value in column.to_pylist()], pa.large_string())


def hash_rows(batch: pa.RecordBatch | pa.Table, data: Sequence[str], powers: _Powers
              ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(key hashes, row hashes) of ``batch``'s ``_key`` and ``data`` columns."""
    def column(name: str) -> pa.Array:
        values = batch.column(name)
        return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values

    keys = _string_hashes(column(KEY), powers)
    row = keys.copy()
    with np.errstate(over="ignore"):
        for i, name in enumerate(data):
            values = _string_hashes(_as_text(column(name)), powers)
            row = _mix(row ^ (values + _U64(i + 1) * _GOLDEN))
    return keys, row


@dataclasses.dataclass
class Hashes:
    """One side's rows as hashes, with the key texts for examples."""

    keys: np.ndarray[Any, Any]
    rows: np.ndarray[Any, Any]
    texts: pa.ChunkedArray

    @classmethod
    def of(cls, batches: Iterator[pa.RecordBatch | pa.Table], data: Sequence[str],
           powers: _Powers) -> Hashes:
        keys, rows, texts = [], [], []
        for batch in batches:
            if batch.num_rows == 0:
                continue
            k, r = hash_rows(batch, data, powers)
            keys.append(k)
            rows.append(r)
            texts.append(batch.column(KEY))
        chunks: list[pa.Array] = []
        for text in texts:
            chunks.extend(text.chunks if isinstance(text, pa.ChunkedArray) else [text])
        return cls(np.concatenate(keys) if keys else np.zeros(0, _U64),
                   np.concatenate(rows) if rows else np.zeros(0, _U64),
                   pa.chunked_array(chunks, pa.string()) if chunks
                   else pa.chunked_array([], pa.string()))


def table_hashes(current: pa.Table, powers: _Powers) -> Hashes:
    """The table side: the current state (``_key`` and the data columns) in batches."""
    data = [name for name in current.column_names if name not in (KEY, SEQ, OP)]
    return Hashes.of(iter(current.to_batches(max_chunksize=HASH_ROWS)), data, powers)


def current_batches(table: DeltaTable, data: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """The table's current state (``_key`` and ``data``) batch by batch, in no order.

    The base rows are streamed (each batch without the keys the change log holds), then
    the log's newest upsert of each key: memory is the log (bounded by compaction) and one
    batch, not the table (:func:`~changestream._delta_layout.current_state` holds all of it).
    """
    dataset = table.to_pyarrow_dataset()
    log = latest(dataset.to_table(filter=pc.field(SEQ) > 0, columns=[KEY, SEQ, OP, *data]))
    logged = log.column(KEY) if log.num_rows else None
    for batch in dataset.to_batches(filter=pc.field(SEQ) == 0, columns=[KEY, *data],
                                    batch_size=HASH_ROWS):
        if logged is not None:
            batch = batch.filter(pc.invert(pc.is_in(batch.column(KEY), value_set=logged)))
        yield batch
    if logged is not None:
        yield from log.filter(pc.equal(log.column(OP), UPSERT)).select([KEY, *data]).to_batches(
            max_chunksize=HASH_ROWS)


@dataclasses.dataclass(frozen=True)
class Verification:
    """What :meth:`DeltaSink.verify` found: the table against the collection at ``at``."""

    at: Timestamp | None
    """The cluster time both were compared at (the table's position)."""
    table_rows: int
    collection_documents: int
    missing: int
    """Documents of the collection that have no row in the table."""
    extra: int
    """Rows of the table whose key the collection does not have."""
    different: int
    """Keys in both whose row differs from the document."""
    examples: Mapping[str, list[str]]
    """Up to a few ``_key`` texts of each kind (``missing``, ``extra``, ``different``)."""
    ranges: int
    """Key ranges compared by hash."""
    ranges_differing: int
    """Of them, the ranges drilled into."""
    seconds: float

    @property
    def ok(self) -> bool:
        """The table equals the collection."""
        return not (self.missing or self.extra or self.different)

    def summary(self) -> str:
        """One line for people: counts, then examples."""
        when = "" if self.at is None else f" at cluster time {self.at.time}.{self.at.inc}"
        head = (f"{self.table_rows} rows in the table, {self.collection_documents} documents in "
                f"the collection{when}: ")
        if self.ok:
            return head + f"equal ({self.ranges} key ranges compared in {self.seconds:.1f} s)"
        parts = [f"{self.missing} missing", f"{self.extra} extra", f"{self.different} different"]
        shown = "; ".join(f"{kind} e.g. {', '.join(keys)}"
                          for kind, keys in self.examples.items() if keys)
        return head + ", ".join(parts) + f" ({shown})"


def _range_sums(keys: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], bits: int
                ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    ranges = (keys >> _U64(64 - bits)).astype(np.int64) if bits else np.zeros(len(keys), np.int64)
    sums = np.zeros(1 << bits, _U64)
    with np.errstate(over="ignore"):
        np.add.at(sums, ranges, rows)
    counts = np.bincount(ranges, minlength=1 << bits)
    return ranges, sums, counts


def compare(table: Hashes, collection: Hashes, *, at: Timestamp | None, started: float,
            examples: int = 5, range_rows: int = RANGE_ROWS) -> Verification:
    """Range hashes first; rows only in the ranges that differ."""
    rows = max(len(table.keys), len(collection.keys), 1)
    bits = min(max(int(np.ceil(np.log2(max(rows / range_rows, 1)))), 0), 24)
    t_range, t_sums, t_counts = _range_sums(table.keys, table.rows, bits)
    c_range, c_sums, c_counts = _range_sums(collection.keys, collection.rows, bits)
    differing = (t_sums != c_sums) | (t_counts != c_counts)
    t_at = np.flatnonzero(differing[t_range])
    c_at = np.flatnonzero(differing[c_range])
    t_keys, c_keys = table.keys[t_at], collection.keys[c_at]
    common, t_i, c_i = np.intersect1d(t_keys, c_keys, assume_unique=False, return_indices=True)
    changed = t_at[t_i[table.rows[t_at[t_i]] != collection.rows[c_at[c_i]]]]
    extra = t_at[~np.isin(t_keys, common)]
    missing = c_at[~np.isin(c_keys, common)]

    def texts(side: Hashes, at_rows: np.ndarray[Any, Any]) -> list[str]:
        picked = side.texts.take(pa.array(at_rows[:examples], pa.int64()))
        return [str(text) for text in picked.to_pylist()]

    return Verification(
        at=at, table_rows=len(table.keys), collection_documents=len(collection.keys),
        missing=len(missing), extra=len(extra), different=len(changed),
        examples={"missing": texts(collection, missing), "extra": texts(table, extra),
                  "different": texts(table, changed)},
        ranges=1 << bits, ranges_differing=int(differing.sum()),
        seconds=time.monotonic() - started,
    )


def collection_batches(
    read: Callable[[dict[str, Any]], Mapping[str, Any]],
    coll: str,
    at: Timestamp | None,
    convert: Callable[[list[Mapping[str, Any]]], pa.Table],
    batch_size: int = 10_000,
) -> Iterator[pa.Table]:
    """The collection's documents at ``at`` (snapshot read), converted batch by batch.

    ``read(command)`` runs one command (in one session, so getMores find the
    cursor) and returns the reply.
    """
    for documents in SnapshotBatches(read, coll, [], at=at, batch_size=batch_size):
        yield convert(documents)


def new_powers() -> _Powers:
    return _Powers()


def verify_table(
    collection: Any,
    stored: StoredToken | None,
    delta: DeltaTable | None,
    table_schema: pa.Schema,
    schema: pa.Schema | None,
    json_options: json_util.JSONOptions,
    *,
    examples: int = 5,
    drift: Drift | None = None,
) -> Verification:
    """:meth:`changestream.delta.DeltaSink.verify`: ``delta`` is the table (``None``: none yet),
    its current state streamed (:func:`current_batches`).

    ``drift``: the sink's (rescue, evolve), so the documents are converted as it converts
    them; a copy is used (verifying neither counts rescues nor grows the sink's columns).
    """
    from pymongo.collection import Collection
    from pymongo.errors import OperationFailure

    from ._delta_rows import DeltaSinkError, source_table
    from ._merge import key_json
    from ._pymongo import SyncCursorReader

    if not isinstance(collection, Collection):
        raise TypeError(f"verify() needs a pymongo Collection, not {type(collection).__name__}")
    started = time.monotonic()
    at = verify_at(stored)
    powers = new_powers()
    data = [name for name in table_schema.names if name not in (KEY, SEQ, OP)]
    table = Hashes.of(iter(()) if delta is None else current_batches(delta, data), data, powers)
    database = collection.database
    session = database.client.start_session(causal_consistency=False)
    read = SyncCursorReader(database, session, collection.codec_options)  # pinned getMores

    own = None if drift is None else copy.copy(drift)

    def convert(documents: list[Mapping[str, Any]]) -> pa.Table:
        keys = [key_json(document["_id"], json_options) for document in documents]
        return source_table(keys, ["upsert"] * len(keys), documents, schema, json_options,
                            own, count=False)

    try:
        side = Hashes.of(collection_batches(read, collection.name, at, convert), data, powers)
    except OperationFailure as exc:
        if exc.code == 239:  # SnapshotTooOld
            raise DeltaSinkError(
                f"the server no longer keeps the table's position ({at}) for a snapshot read "
                f"(minSnapshotHistoryWindowInSeconds): catch the table up first "
                f"(changestream mirror --until-idle, or mirror --verify, which does), then "
                f"verify") from exc
        raise
    finally:
        read.close()
        session.end_session()
    return compare(table, side, at=at, started=started, examples=examples)


def verify_at(stored: StoredToken | None) -> Timestamp | None:
    """The cluster time the table holds everything up to (``None``: no position yet)."""
    if stored is None:
        return None
    token = stored.token
    if is_snapshot_position(token):  # a copy reads at readAt (mid-copy: the rest is missing)
        at = token.get("readAt", token.get("at")) if token.get("phase") == "copy" \
            else token.get("at")
        return at if isinstance(at, Timestamp) else None
    return token_cluster_time(token)
