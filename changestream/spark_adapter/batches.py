"""``foreach_batch``: feed a change stream to ``func(DataFrame, batch_id)`` in micro-batches.

A background thread polls the stream with ``try_next`` (so fetching overlaps
conversion and ``func``); the loop cuts a batch when it holds ``max_rows``
events or its first event is ``max_seconds`` old, converts it through Arrow,
calls ``func`` and only then saves (resume token, batch id) in the token
store. After a crash the stream
reopens from the stored token and the batch id continues, so a ``func`` that
*replaces* its output for a batch id gives exactly-once results: the re-run
batch may hold more or fewer events than the lost attempt (batches are cut
by time), but it starts at the same event and its output replaces the old.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import bson
import pyarrow as pa
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
            table = pa.Table.from_batches([converter.convert(pending)])
            if table.num_rows:
                run.batch_id = (run.batch_id if run.batch_id is not None else -1) + 1
                func(spark.createDataFrame(table, schema=spark_schema), run.batch_id)
                run.batches += 1
                run.rows += table.num_rows
            run.save(pending[-1]["_id"])
            pending.clear()

        with _Prefetcher(stream, capacity=2 * max_rows) as prefetched:
            while True:
                if stop_event is not None and stop_event.is_set():
                    reason = "stopped"
                    break
                wait = first_at + max_seconds - time.monotonic() if pending else _TICK
                item = prefetched.get(max(wait, 0.0))
                now = time.monotonic()
                if isinstance(item, _Idle):
                    if pending and (until_idle or not item.alive or now - first_at >= max_seconds):
                        flush()
                    if not pending and (
                        until_idle or not item.alive or now - run.saved_at >= idle_seconds
                    ):
                        run.save_if_moved(item.resume_token)  # past every event delivered
                        if not item.alive:
                            reason = "invalidated"  # closed by an invalidate a $match removed
                            break
                        if until_idle:
                            reason = "idle"
                            break
                elif item is not None:
                    if not isinstance(item, Mapping):
                        raise TypeError(
                            "foreach_batch needs change documents (mappings); open the stream "
                            f"without typed=True (got {type(item).__name__})"
                        )
                    if item.get("operationType") == "invalidate":
                        if pending:
                            flush()
                        run.save(item["_id"])
                        reason = "invalidated"
                        break
                    if not pending:
                        first_at = now
                    pending.append(item)
                    if len(pending) >= max_rows or now - first_at >= max_seconds:
                        flush()
                elif pending and now - first_at >= max_seconds:
                    flush()
                if max_batches is not None and run.batches >= max_batches:
                    reason = "max_batches"
                    break
        if pending:
            flush()
    return BatchRunResult(run.batches, run.rows, run.batch_id, run.token, reason)


_TICK = 0.1
"""Longest wait for the next event when no batch is open (bounds ``stop_event`` latency)."""


@dataclasses.dataclass(frozen=True)
class _Idle:
    """A getMore came back empty: the stream's token then (its postBatchResumeToken)."""

    resume_token: Any
    alive: bool


@dataclasses.dataclass(frozen=True)
class _Failed:
    """The stream raised; the consumer re-raises the exception."""

    error: BaseException


class _Prefetcher:
    """Calls ``try_next`` on a background thread so fetching overlaps conversion and ``func``.

    Only this thread touches the stream inside the ``with`` block. The
    queue holds events, :class:`_Idle` markers (in stream order, so an idle
    token is only seen after every event before it) and at most one
    :class:`_Failed`; ``capacity`` bounds the events held in memory.
    """

    def __init__(self, stream: ChangeStream[Any], capacity: int) -> None:
        self._stream = stream
        self._capacity = capacity
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="changestream-prefetch", daemon=True)

    def __enter__(self) -> _Prefetcher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()  # at most one getMore (max_await_time_ms) away

    def get(self, timeout: float) -> Any:
        """The next event or :class:`_Idle`, or ``None`` if nothing came within ``timeout``."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, _Failed):
            raise item.error
        return item

    def _run(self) -> None:
        stream = self._stream
        try:
            while not self._stop.is_set():
                while self._queue.qsize() >= self._capacity and not self._stop.is_set():
                    self._stop.wait(0.01)  # the consumer is behind: do not buffer more
                event = stream.try_next()
                self._queue.put(
                    event if event is not None else _Idle(stream.resume_token, stream.alive)
                )
                if event is None and not stream.alive:
                    return
        except BaseException as exc:
            self._queue.put(_Failed(exc))


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
