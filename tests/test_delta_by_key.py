"""The current state of a table whose document column passes 2 GiB (a 10M-row table of
240-byte documents): Arrow's ``take`` joined the chunks and overflowed their 32-bit offsets
(``ArrowInvalid: offset overflow``), so ``read_current()`` failed on such a table."""

from __future__ import annotations

import itertools
import random

import pyarrow as pa
import pytest

from changestream import _delta_layout
from changestream._delta_layout import by_key


def _rows(count: int, size: int, chunks: int) -> pa.Table:
    rng = random.Random(7)
    keys = [f'{{"$oid":"{rng.getrandbits(96):024x}"}}' for _ in range(count)]
    texts = [f'{{"n": {n}, "s": "{"x" * rng.randrange(size // 2, size)}"}}' for n in range(count)]
    cut = [count * i // chunks for i in range(chunks + 1)]
    return pa.table({
        "_key": pa.chunked_array([keys[a:b] for a, b in itertools.pairwise(cut)], pa.string()),
        "_seq": pa.chunked_array([list(range(a, b)) for a, b in itertools.pairwise(cut)], pa.int64()),
        "document": pa.chunked_array([texts[a:b] for a, b in itertools.pairwise(cut)], pa.string()),
    })


def test_a_column_past_the_offsets_is_sorted_whole_in_its_own_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = _rows(3000, 400, 3)
    monkeypatch.setattr(_delta_layout, "_MAX_BYTES", 60_000)  # "2 GiB", small
    got = by_key(rows)
    assert got.schema == rows.schema
    assert got.column("document").num_chunks > 1  # cut back into slices that fit
    assert got.to_pylist() == rows.sort_by("_key").to_pylist()


@pytest.mark.slow
def test_a_document_column_of_over_2_gib_is_sorted() -> None:
    rows = _rows(1100, 4_000_000, 4)  # ~2.2 GB of text
    assert rows.column("document").nbytes > 2**31
    got = by_key(rows)
    keys = got.column("_key").to_pylist()
    assert keys == sorted(keys) and got.num_rows == rows.num_rows
    assert got.schema == rows.schema
