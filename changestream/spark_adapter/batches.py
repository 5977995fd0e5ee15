"""``foreach_batch``: feed a change stream to ``func(DataFrame, batch_id)`` in micro-batches.

The loop polls with ``try_next`` (never blocking longer than one getMore),
cuts a batch when it holds ``max_rows`` events or its first event is
``max_seconds`` old, converts it through Arrow, calls ``func`` and only then
saves (resume token, batch id) in the token store. After a crash the stream
reopens from the stored token and the batch id continues, so a ``func`` that
*replaces* its output for a batch id gives exactly-once results: the re-run
batch may hold more or fewer events than the lost attempt (batches are cut
by time), but it starts at the same event and its output replaces the old.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import bson
from bson.raw_bson import RawBSONDocument
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import DataType, StructType

from ..api import watch
from ..stores import TokenStore
from ..stream import ChangeStream
from .convert import EventConverter
from .errors import history_lost_as_error
from .schema import event_ddl

__all__ = ["BatchRunResult", "foreach_batch", "stream_opener"]

_START_OPTIONS = ("resume_after", "start_after", "start_at_operation_time")

StreamOpener = Callable[[Mapping[str, Any] | None], ChangeStream[Any]]


def stream_opener(
    target: Any, pipeline: list[Mapping[str, Any]] | None = None, **options: Any
) -> StreamOpener:
    """An ``open_stream`` for :func:`foreach_batch`: ``watch(target, pipeline, **options)``.

    With a stored token the stream continues with ``start_after`` (which also
    accepts an ``invalidate`` token) and the start options in ``options`` are
    ignored; ``max_await_time_ms`` defaults to 200 so time cuts stay prompt.
    """
    options.setdefault("max_await_time_ms", 200)

    def open_stream(token: Mapping[str, Any] | None) -> ChangeStream[Any]:
        if token is None:
            return watch(target, pipeline, **options)
        kept = {key: value for key, value in options.items() if key not in _START_OPTIONS}
        return watch(target, pipeline, start_after=token, **kept)

    return open_stream


@dataclasses.dataclass(frozen=True)
class BatchRunResult:
    """How a :func:`foreach_batch` run ended."""

    batches: int
    """Calls of ``func`` made by this run."""
    rows: int
    """Rows passed to ``func`` by this run."""
    last_batch_id: int | None
    """The id of the last batch delivered (by this or an earlier run), if any."""
    resume_token: dict[str, Any] | None
    """The token stored last."""
    reason: str
    """``"idle"`` (``until_idle``), ``"max_batches"``, ``"stopped"`` (``stop_event``) or
    ``"invalidated"`` (the stream was invalidated; its token is stored, so the next
    run continues after it)."""


def foreach_batch(
    spark: SparkSession,
    open_stream: StreamOpener,
    func: Callable[[DataFrame, int], object],
    store: TokenStore,
    *,
    max_rows: int = 10_000,
    max_seconds: float = 1.0,
    idle_seconds: float = 60.0,
    full_document_schema: str | None = None,
    publish_full_document_only: bool = False,
    until_idle: bool = False,
    max_batches: int | None = None,
    stop_event: threading.Event | None = None,
) -> BatchRunResult:
    """Run ``func(df, batch_id)`` on micro-batches of a change stream until told to stop.

    ``open_stream(token)`` opens the stream after ``token`` (``None``: the
    first run; see :func:`stream_opener`). Batches hold at most ``max_rows``
    events and are cut ``max_seconds`` after their first event; ``df`` has
    the schema of :func:`changestream.spark_adapter.event_ddl` (for the same
    ``full_document_schema`` / ``publish_full_document_only``). Batches
    without rows are not passed to ``func``. While the stream is idle, its
    postBatchResumeToken is stored every ``idle_seconds`` so a restart stays
    inside the oplog window. Stops when the stream is idle (``until_idle``),
    after ``max_batches`` calls, when ``stop_event`` is set (after the
    current batch), or after an ``invalidate``. Exceptions from ``func`` or
    the stream propagate; nothing is stored for the failed batch.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, not {max_rows}")
    if max_seconds < 0 or idle_seconds < 0:
        raise ValueError("max_seconds and idle_seconds must be >= 0")
    ddl = event_ddl(full_document_schema, publish_full_document_only=publish_full_document_only)
    spark_schema = DataType.fromDDL(ddl)
    assert isinstance(spark_schema, StructType)
    converter = EventConverter(
        to_arrow_schema(spark_schema, timezone="UTC"),
        publish_full_document_only=publish_full_document_only,
    )
    run = _Run(store)
    with history_lost_as_error(run.token), open_stream(run.token) as stream:
        if run.token is None and stream.resume_token is not None:
            run.save(stream.resume_token)  # pin the start: a crash must not move it to "now"
        pending: list[Any] = []
        first_at = 0.0

        def flush() -> None:
            table = converter.convert(pending)
            if table.num_rows:
                run.batch_id = (run.batch_id if run.batch_id is not None else -1) + 1
                func(spark.createDataFrame(table, schema=spark_schema), run.batch_id)
                run.batches += 1
                run.rows += table.num_rows
            run.save(pending[-1]["_id"])
            pending.clear()

        while True:
            if stop_event is not None and stop_event.is_set():
                reason = "stopped"
                break
            event = stream.try_next()
            now = time.monotonic()
            if event is not None:
                if not isinstance(event, Mapping):
                    raise TypeError(
                        "foreach_batch needs change documents (mappings); open the stream "
                        f"without typed=True (got {type(event).__name__})"
                    )
                if event.get("operationType") == "invalidate":
                    if pending:
                        flush()
                    run.save(event["_id"])
                    reason = "invalidated"
                    break
                if not pending:
                    first_at = now
                pending.append(event)
                if len(pending) >= max_rows or now - first_at >= max_seconds:
                    flush()
            elif pending:
                if until_idle or not stream.alive or now - first_at >= max_seconds:
                    flush()
            elif until_idle or not stream.alive or now - run.saved_at >= idle_seconds:
                run.save_if_moved(stream.resume_token)
                if until_idle or not stream.alive:
                    reason = "idle" if stream.alive else "invalidated"
                    break
            if max_batches is not None and run.batches >= max_batches:
                reason = "max_batches"
                break
        if pending:
            flush()
    return BatchRunResult(run.batches, run.rows, run.batch_id, run.token, reason)


class _Run:
    """Progress of one run and its writes to the token store."""

    def __init__(self, store: TokenStore) -> None:
        self.store = store
        stored = store.load()
        self.token: dict[str, Any] | None = dict(stored.token) if stored else None
        self.batch_id: int | None = stored.batch_id if stored else None
        self.batches = 0
        self.rows = 0
        self.saved_at = time.monotonic()

    def save(self, token: Mapping[str, Any]) -> None:
        plain = bson.decode(token.raw) if isinstance(token, RawBSONDocument) else dict(token)
        self.store.save(plain, batch_id=self.batch_id)
        self.token = plain
        self.saved_at = time.monotonic()

    def save_if_moved(self, token: Mapping[str, Any] | None) -> None:
        if token is not None and dict(token) != self.token:
            self.save(token)
        else:
            self.saved_at = time.monotonic()
