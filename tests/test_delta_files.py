"""Base files stay about ``file_rows`` rows, whatever compaction folds into them.

A compaction rewrites every base file that holds a logged key, whole. With files cut
only at 64 MB (~900,000 rows of 230-byte orders), one uniform compaction of a 1M-row
table left a single 942,080-row file, and inserts at the top of the key range grew the
top file by every compaction: each later compaction rewrote it all for the few keys it
held. These tests pin the bound: files of about ``file_rows`` rows, the same current
state.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import deltalake
import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from delta_support import plain_state

from changestream._delta_layout import _File, file_bytes
from changestream.delta import DeltaSink

NS = {"db": "d", "coll": "c"}
FILE_ROWS = 4_096  # delta-rs checks a file's size every 1,024 rows


class Orders:
    """Change events and the state they leave, for keys k0000000.. (key order = time order)."""

    def __init__(self) -> None:
        self.state: dict[Any, Any] = {}
        self.count = 0
        self.rng = random.Random(7)

    def _token(self) -> dict[str, Any]:
        self.count += 1
        return {"_data": f"82{self.count:016X}"}

    def _document(self, n: int) -> dict[str, Any]:
        document = {"_id": f"k{n:07d}", "v": self.rng.randrange(10**6),
                    "note": "x" * self.rng.randrange(40, 80)}
        self.state[document["_id"]] = document
        return document

    def snapshot(self, keys: range) -> list[dict[str, Any]]:
        from bson.timestamp import Timestamp

        return [{"_id": {"_data": "snapshot", "phase": "copy", "at": Timestamp(1_800_000_000, 1),
                         "lastId": f"k{n:07d}"}, "operationType": "insert", "ns": NS,
                 "documentKey": {"_id": f"k{n:07d}"}, "fullDocument": self._document(n)}
                for n in keys]

    def change(self, operation: str, n: int) -> dict[str, Any]:
        document = self._document(n)
        return {"_id": self._token(), "operationType": operation, "ns": NS,
                "documentKey": {"_id": document["_id"]}, "fullDocument": document}


def apply(sink: DeltaSink, changes: list[dict[str, Any]]) -> None:
    for change in changes:
        sink(change)
    sink.save(changes[-1]["_id"])


def file_rows(path: Path) -> list[int]:
    actions = pa.table(deltalake.DeltaTable(str(path)).get_add_actions(flatten=True))
    return sorted(actions.column("num_records").to_pylist())


def test_file_bytes_scales_the_files_bytes_per_row_and_keeps_the_cap() -> None:
    # a first load's file is uncompressed (300 bytes a row): the compressed one counts
    files = [_File("a", 2_000, 600_000, "a", "b", True), _File("b", 3_000, 240_000, "c", "d", True)]
    assert file_bytes(files, 10_000, 64 << 20) == 800_000  # 80 bytes a row
    assert file_bytes(files, 10_000, 500_000) == 500_000  # never above target_file_size
    assert file_bytes([], 10_000, 64 << 20) == 64 << 20  # nothing to go by: the cap
    assert file_bytes(files, 0, 64 << 20) == 1


def test_a_uniform_compaction_writes_files_of_about_file_rows(tmp_path: Path) -> None:
    orders = Orders()
    sink = DeltaSink(tmp_path / "t", app_id="a", file_rows=FILE_ROWS)
    for start in range(0, 40_000, 10_000):
        apply(sink, orders.snapshot(range(start, start + 10_000)))
    rng = random.Random(3)
    apply(sink, [orders.change("update", rng.randrange(40_000)) for _ in range(8_000)])
    done = sink.finish()
    assert done is not None and done.base_rows_read == 40_000  # every file held a logged key
    rows = file_rows(tmp_path / "t")
    assert sum(rows) == 40_000
    assert len(rows) >= 40_000 // (2 * FILE_ROWS) and max(rows) <= 2 * FILE_ROWS, rows
    assert plain_state(tmp_path / "t") == orders.state


def test_inserts_at_the_top_do_not_grow_one_file_compaction_after_compaction(
    tmp_path: Path
) -> None:
    orders = Orders()
    sink = DeltaSink(tmp_path / "t", app_id="a", file_rows=FILE_ROWS)
    apply(sink, orders.snapshot(range(10_000)))
    top = 10_000
    rng = random.Random(4)
    for _ in range(4):  # the newest keys: updated and appended to, then compacted
        batch = [orders.change("insert", n) for n in range(top, top + 5_000)]
        batch += [orders.change("update", top - 1 - rng.randrange(2_000)) for _ in range(1_000)]
        top += 5_000
        apply(sink, batch)
        done = sink.finish()
        assert done is not None
        # the last compaction read the top file(s), not everything inserted so far
        assert done.base_rows_read <= 3 * FILE_ROWS, done
    rows = file_rows(tmp_path / "t")
    assert sum(rows) == top and max(rows) <= 2 * FILE_ROWS, rows
    assert plain_state(tmp_path / "t") == orders.state


def test_file_rows_must_be_a_positive_integer(tmp_path: Path) -> None:
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="file_rows must be an integer >= 1"):
            DeltaSink(tmp_path / "t", file_rows=bad)  # type: ignore[arg-type]
