"""How big a Delta sink's batches, logs and files get: ``mirror``'s batch defaults, the
checks of the sink's size options, and what one staged change weighs.

Why the batch defaults: each commit has a fixed cost (a Parquet file, a log entry,
the merge's collapse) and a batch collapses each key to its last change, so a
key updated twice in one batch is converted to JSON once. Measured end to end
(``benchmarks/README.md``, "Commit batches"), 50,000 changes a commit took a quarter
less CPU per change than 10,000 at 100k documents and a tenth to a fifth less at 1M,
and ``--batch-seconds`` still bounds how
stale the table gets while changes trickle in. A count alone bounds a batch's
memory only for small documents, so the sink also counts the bytes it keeps and
asks ``consume`` to save once they reach ``BATCH_BYTES``
(:class:`changestream.stores.BatchingTokenStore`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import bson
from bson.raw_bson import RawBSONDocument

from ._snapshot import SNAPSHOT_MARK
from ._token import raw_token_bytes

__all__ = [
    "BATCH_BYTES", "BATCH_CHANGES", "BATCH_SECONDS", "check_sizes", "is_record", "staged_size",
]

BATCH_CHANGES = 100_000
"""Changes per commit at most (``mirror --batch``). A first load's commits hold at most the
sink's ``file_rows`` snapshot records (one base file each: ``DeltaSink.batch_full``)."""

BATCH_SECONDS = 5.0
"""Seconds between commits at most while changes come (``mirror --batch-seconds``)."""

BATCH_BYTES = 64 << 20
"""Bytes of staged changes per commit at most (``mirror --batch-mb``; ``DeltaSink(batch_bytes=)``):
a batch, and the one committing behind it, hold about this much each."""


def staged_size(change: Mapping[str, Any], staged: Any) -> int:
    """The bytes a staged change holds, about: a raw event's size, else its document's text."""
    if type(change) is RawBSONDocument:
        return len(change.raw)
    if type(staged) is tuple:  # a merge Row: its document's text (or BSON)
        document = staged[5]
        return 0 if document is None else len(document)
    return 0  # a decoded event kept whole (DDL, a schema's columns): not counted


_MARK = SNAPSHOT_MARK.encode()


def is_record(staged: Any) -> bool:
    """Whether a staged change that is not a stream's row is a snapshot record of a copy (a
    raw one's token read alone: the event is decoded once, when its batch is committed)."""
    try:
        if type(staged) is RawBSONDocument:  # (a stream's token is not decoded)
            token = raw_token_bytes(staged.raw)
            token_id = bson.decode(token) if token and _MARK in token else {}
        else:
            token_id = staged["_id"]
        return bool(token_id["_data"] == SNAPSHOT_MARK and token_id["phase"] == "copy")
    except (KeyError, TypeError, IndexError, bson.InvalidBSON):
        return False


def check_sizes(*, log_fraction: float, max_log_rows: int, min_log_rows: int, file_rows: int,
                batch_bytes: int | None) -> None:
    """``DeltaSink``'s size options, each refused with one line naming it."""
    if not log_fraction > 0:
        raise ValueError(f"log_fraction must be > 0, not {log_fraction!r}")
    counts: list[tuple[str, object, int]] = [
        ("max_log_rows", max_log_rows, 1), ("min_log_rows", min_log_rows, 0),
        ("file_rows", file_rows, 1)]
    if batch_bytes is not None:  # None: no bound of its own, only consume's save_every
        counts.append(("batch_bytes", batch_bytes, 1))
    for name, value, least in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, not {value!r}")
