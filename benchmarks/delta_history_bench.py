"""The history table: why ``valid_to`` is derived by a query instead of stored.

    python -m benchmarks.delta_history_bench                    # 100k and 1M rows
    python -m benchmarks.delta_history_bench --sizes 100000 --batch 5000

For each size N a history table of N rows (change rows of N/4 keys, ~150-byte
documents, appended in time order as ``mirror --history`` writes them) is
built, then one batch of ``--batch`` changes is committed two ways:

* **append** (what the sink does): the batch's rows, nothing else;
* **close + append** (a stored ``valid_to``): a delta-rs ``MERGE`` setting
  ``valid_to`` on each changed key's open row, then the append. Keys are the
  newest 5% (skewed) or uniform.

Also timed: the as-of query (``AS_OF_SQL``) by DuckDB over the table, if
DuckDB is installed. Reported as seconds per batch and the ratio to the
append at the smallest size: the append's cost stays flat, the MERGE's grows
with the table (the history is in time order, so a changed key's open row
can sit in any file).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from changestream._delta_history import AS_OF_SQL, history_schema

_TIME = pa.timestamp("us", tz="UTC")
_DATA = pa.schema([("document", pa.string())])
_START = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _rows(keys: list[int], first_seq: int, at: datetime, stored_valid_to: bool) -> pa.Table:
    n = len(keys)
    texts = [f"k{key:09d}" for key in keys]
    docs = [f'{{"_id": {key}, "customer": "c{key % 977}", "status": "paid", '
            f'"items": [{{"sku": "s{key % 31}", "qty": {key % 7}}}], "total": {key % 1000}.5}}'
            for key in keys]
    times = pa.array([at + timedelta(microseconds=i) for i in range(n)], _TIME)
    schema = history_schema(_DATA)
    columns = [pa.array(texts), pa.array(range(first_seq, first_seq + n), pa.int64()),
               pa.array(["upsert"] * n), pa.array(["update"] * n), times,
               pa.array(["{}"] * n), times, pa.array(docs)]
    if stored_valid_to:
        schema = schema.append(pa.field("valid_to", _TIME))
        columns.append(pa.nulls(n, _TIME))
    return pa.Table.from_arrays(columns, schema=schema)


def build(path: Path, size: int, stored_valid_to: bool, rng: random.Random) -> int:
    keys = size // 4
    seq = 1
    for start in range(0, size, 100_000):
        count = min(100_000, size - start)
        batch = [rng.randrange(keys) for _ in range(count)]
        write_deltalake(str(path), _rows(batch, seq, _START + timedelta(seconds=start), stored_valid_to),
                        mode="append")
        seq += count
    return seq


def one_batch(path: Path, seq: int, keys: list[int], close: bool) -> float:
    rows = _rows(keys, seq, _START + timedelta(days=1, seconds=seq), close)
    started = time.perf_counter()
    table = DeltaTable(str(path))
    if close:
        source = pa.table({"_key": rows.column("_key"), "closed_at": rows.column("valid_from")})
        last = source.group_by("_key").aggregate([("closed_at", "min")]).rename_columns(
            ["_key", "closed_at"])
        (table.merge(last, predicate="t._key = s._key AND t.valid_to IS NULL",
                     source_alias="s", target_alias="t")
         .when_matched_update({"valid_to": "s.closed_at"}).execute())
    write_deltalake(table, rows, mode="append")
    return time.perf_counter() - started


def as_of_seconds(path: Path) -> float | None:
    try:
        import duckdb
    except ImportError:
        return None
    history = DeltaTable(str(path)).to_pyarrow_dataset()  # noqa: F841 (read by DuckDB)
    started = time.perf_counter()
    query = AS_OF_SQL.format(table="history", time="TIMESTAMPTZ '2026-01-01 00:10:00+00'")
    duckdb.sql(f"SELECT count(*) FROM ({query})").fetchall()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(1)
    base: float | None = None
    for size in [int(s) for s in args.sizes.split(",")]:
        keys = size // 4

        def newest(keys: int = keys) -> int:
            return keys - 1 - rng.randrange(max(1, keys // 20))

        def uniform(keys: int = keys) -> int:
            return rng.randrange(keys)

        for label, pick in (("newest 5%", newest), ("uniform", uniform)):
            for close in (False, True):
                root = Path(tempfile.mkdtemp(prefix="history_bench_"))
                try:
                    seq = build(root / "h", size, close, rng)
                    times = []
                    for _ in range(args.repeat):
                        batch = [pick() for _ in range(args.batch)]
                        times.append(one_batch(root / "h", seq, batch, close))
                        seq += args.batch
                    seconds = statistics.median(times)
                    if base is None:
                        base = seconds
                    how = "close + append" if close else "append"
                    print(f"{size:>9} rows  {label:<10} {how:<15} {seconds:7.3f} s/batch  "
                          f"x{seconds / base:5.1f}", flush=True)
                    if not close and label == "uniform":
                        query = as_of_seconds(root / "h")
                        if query is not None:
                            print(f"{size:>9} rows  as-of query (DuckDB)       {query:7.3f} s",
                                  flush=True)
                finally:
                    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
